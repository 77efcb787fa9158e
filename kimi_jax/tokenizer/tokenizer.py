"""The Kimi tokenizer: rank-BPE over tiktoken with Kimi's pre-tokenizer and a 256-id special block."""

from collections.abc import Iterable

import tiktoken

# Kimi's pre-tokenizer: o200k-style and case-aware, with a leading Han-run rule and Han removed from the
# letter classes (`&&` class intersection, supported by tiktoken's regex engine). Copied from the `pat_str`
# of `tokenization_kimi.py` in the Kimi K2/K3 checkpoints, as quoted verbatim by several public ports
# (e.g. North-Shore-AI/tiktoken_ex `lib/tiktoken_ex/kimi.ex` "upstream_pat_str"); spec KIMI_K3.md 8.1.
KIMI_PAT_STR = "|".join([
    r"""[\p{Han}]+""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+""",
])


class Tokenizer:
    """Byte-level rank BPE (tiktoken) plus named special tokens.

    Ids [0, num_bpe_ranks) are BPE ranks; [num_bpe_ranks, vocab_size) are special tokens.
    """

    def __init__(self, mergeable_ranks: dict[bytes, int], special_tokens: dict[str, int], *,
                 bos_token: str | None, eos_tokens: Iterable[str], pad_token: str | None,
                 name: str = "kimi", pat_str: str = KIMI_PAT_STR):
        """Args:
          mergeable_ranks: token bytes -> rank, ranks exactly 0..len-1.
          special_tokens: name -> id, ids exactly len(mergeable_ranks)..vocab_size-1.
          bos_token, pad_token: names in `special_tokens` or None.
          eos_tokens: names in `special_tokens` that end a generation (first = the tokenizer's eos).
        Raises:
          ValueError: ranks or special ids not contiguous, or a role token name unknown.
        """
        num_ranks = len(mergeable_ranks)
        if sorted(mergeable_ranks.values()) != list(range(num_ranks)):
            raise ValueError("BPE ranks must be exactly 0..N-1")
        if sorted(special_tokens.values()) != list(range(num_ranks, num_ranks + len(special_tokens))):
            raise ValueError(f"special ids must be exactly {num_ranks}..{num_ranks + len(special_tokens) - 1}")
        self.special_tokens = dict(special_tokens)
        self.num_bpe_ranks = num_ranks
        self.vocab_size = num_ranks + len(special_tokens)
        self.bos_token_id = self._role_id(bos_token, "bos_token")
        self.pad_token_id = self._role_id(pad_token, "pad_token")
        self.eos_token_ids = tuple(dict.fromkeys(self._role_id(t, "eos_token") for t in eos_tokens))
        self._encoding = tiktoken.Encoding(name=name, pat_str=pat_str, mergeable_ranks=mergeable_ranks,
                                           special_tokens=special_tokens, explicit_n_vocab=self.vocab_size)

    def _role_id(self, name: str | None, field: str) -> int | None:
        if name is None:
            return None
        if name not in self.special_tokens:
            raise ValueError(f"{field} {name!r} is not a special token")
        return self.special_tokens[name]

    def encode(self, text: str, *, allow_special: bool = False) -> list[int]:
        """Token ids of `text`. With allow_special False, text spelling a special token is plain text."""
        if allow_special:
            return self._encoding.encode(text, allowed_special="all")
        return self._encoding.encode(text, allowed_special=set(), disallowed_special=())

    def decode(self, ids: Iterable[int], *, skip_special_tokens: bool = False) -> str:
        """Text of `ids`; invalid UTF-8 (e.g. a cut multi-byte character) becomes U+FFFD."""
        return b"".join(self.token_bytes(i) for i in ids
                        if not (skip_special_tokens and self.is_special(i))).decode("utf-8", errors="replace")

    def token_bytes(self, token_id: int) -> bytes:
        """Bytes of one token (a special token's bytes are its name in UTF-8)."""
        if not 0 <= token_id < self.vocab_size:
            raise ValueError(f"token id {token_id} is outside the vocabulary [0, {self.vocab_size})")
        return self._encoding.decode_single_token_bytes(token_id)

    def special_token_id(self, name: str) -> int:
        """Id of a special token by name, e.g. "<|open|>"; KeyError if the tokenizer has no such token."""
        return self.special_tokens[name]

    def is_special(self, token_id: int) -> bool:
        return self.num_bpe_ranks <= token_id < self.vocab_size
