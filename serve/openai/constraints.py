"""Constrained decoding with llguidance: grammars compiled against our tokenizer, one matcher per sequence.

`GuidanceConstraint` implements the engine's `TokenConstraint` protocol: before each sampling step the engine
asks `allowed_token_bitmask()` (int32 words, bit i%32 of word i//32 = token i allowed, `[ceil(vocab/32)]`),
applies it to the logits on device, samples, and calls `advance(token)`. `is_terminated()` turns true once the
grammar has ended (or the matcher failed, e.g. a token it did not allow was forced on it).
"""

from __future__ import annotations

import threading
import weakref

import llguidance
import numpy as np


class _TokenizerView:
    """The attributes llguidance's `TokenizerWrapper` reads, taken from a kimi_jax `Tokenizer`.

    Special tokens are spelled `0xFF + name` (llguidance's convention), so grammars can name them as `<[id]>`
    and free-text terminals can never produce them.
    """

    def __init__(self, tokenizer):
        self._tokenizer = tokenizer
        self.eos_token_id = tokenizer.eos_token_ids[0]
        self.bos_token_id = tokenizer.bos_token_id
        self.special_token_ids = [i for i in range(tokenizer.vocab_size) if tokenizer.is_special(i)]
        special = set(self.special_token_ids)
        self.tokens = [b"\xff" + tokenizer.token_bytes(i) if i in special else tokenizer.token_bytes(i)
                       for i in range(tokenizer.vocab_size)]

    def __call__(self, text: str) -> list[int]:
        if isinstance(text, bytes):
            raise TypeError("takes str")  # tells TokenizerWrapper to pass str
        return self._tokenizer.encode(text)


_cache: "weakref.WeakKeyDictionary[object, llguidance.LLTokenizer]" = weakref.WeakKeyDictionary()
_cache_lock = threading.Lock()


def guidance_tokenizer(tokenizer) -> llguidance.LLTokenizer:
    """The llguidance view of `tokenizer`, built once per tokenizer object (about 1 s for a 164K vocabulary)."""
    with _cache_lock:
        if tokenizer not in _cache:
            wrapper = llguidance.TokenizerWrapper(_TokenizerView(tokenizer))
            _cache[tokenizer] = llguidance.LLTokenizer(wrapper, n_vocab=tokenizer.vocab_size,
                                                       eos_token=list(tokenizer.eos_token_ids))
        return _cache[tokenizer]


def bitmask_of(token_ids, vocab_size: int) -> np.ndarray:
    """int32 `[ceil(vocab/32)]` bitmask with exactly `token_ids` set."""
    words = np.zeros((vocab_size + 31) // 32, np.uint32)
    for token_id in token_ids:
        words[token_id // 32] |= np.uint32(1 << (token_id % 32))
    return words.view(np.int32)


def allowed_ids(bitmask: np.ndarray, vocab_size: int) -> np.ndarray:
    """Token ids whose bit is set in an int32 `[ceil(vocab/32)]` bitmask."""
    bits = np.unpackbits(bitmask.view(np.uint8), bitorder="little")[:vocab_size]
    return np.flatnonzero(bits)


class GuidanceConstraint:
    """One sequence's grammar state (the engine's `TokenConstraint`).

    The mask covers the model's vocabulary (`vocab_size`), which may be padded beyond the tokenizer's
    (`tokenizer_vocab_size`); padding ids are never allowed.
    """

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int, tokenizer_vocab_size: int,
                 eos_token_ids: tuple[int, ...]):
        self._matcher = matcher
        self._num_words = (vocab_size + 31) // 32
        self._num_tokenizer_bytes = (tokenizer_vocab_size + 31) // 32 * 4
        self._eos_mask = bitmask_of(eos_token_ids, vocab_size)

    def allowed_token_bitmask(self) -> np.ndarray:
        """int32 `[ceil(vocab/32)]`; only end-of-sequence tokens once the matcher has stopped or failed."""
        if self._matcher.is_stopped():
            return self._eos_mask.copy()
        mask = np.zeros(self._num_words, np.int32)
        self._matcher.unsafe_compute_mask_ptr(mask.ctypes.data, self._num_tokenizer_bytes)
        return mask

    def advance(self, token_id: int) -> None:
        if not self._matcher.is_stopped():
            self._matcher.consume_token(token_id)

    def is_terminated(self) -> bool:
        return self._matcher.is_stopped()

    @property
    def error(self) -> str:
        """Why the matcher failed ("" while it has not)."""
        return self._matcher.get_error()


class ConstraintFactory:
    """Makes a fresh `GuidanceConstraint` per sequence (the `SamplingParams.constraint_factory`).

    The grammar is checked once here, so a bad schema is reported before the request reaches the engine.
    """

    def __init__(self, tokenizer, grammar: str, *, vocab_size: int | None = None):
        """Args:
          tokenizer: a kimi_jax `Tokenizer` (or anything with its interface).
          grammar: an llguidance grammar (from `grammars.py`).
          vocab_size: the model's vocabulary (mask width); None = the tokenizer's.
        Raises:
          ValueError: the grammar (e.g. a JSON schema inside it) is invalid, or vocab_size is below the
            tokenizer's.
        """
        self._ll_tokenizer = guidance_tokenizer(tokenizer)
        self._tokenizer_vocab_size = tokenizer.vocab_size
        self._vocab_size = tokenizer.vocab_size if vocab_size is None else vocab_size
        if self._vocab_size < tokenizer.vocab_size:
            raise ValueError(f"model vocabulary {self._vocab_size} is smaller than the tokenizer's "
                             f"{tokenizer.vocab_size}")
        self._eos_token_ids = tuple(tokenizer.eos_token_ids)
        self.grammar = grammar
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, self._ll_tokenizer)
        if is_error:
            raise ValueError(messages[0])

    def __call__(self) -> GuidanceConstraint:
        matcher = llguidance.LLMatcher(self._ll_tokenizer, self.grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(matcher.get_error())
        return GuidanceConstraint(matcher, self._vocab_size, self._tokenizer_vocab_size, self._eos_token_ids)
