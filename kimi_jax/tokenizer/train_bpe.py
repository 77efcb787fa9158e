"""Train the embedded `tiny` tokenizer: a byte-level rank BPE in the Kimi tiktoken format.

Corpus (offline, present wherever Python is): the running interpreter's own standard library source, the
top-level `Lib/*.py` files of `sysconfig.get_paths()["stdlib"]` in name order, plus every module docstring a
second time (more prose weight). That text is distributed under the PSF License Agreement (Python Software
Foundation License Version 2); the trained ranks are derived from it.

Vocabulary: 4096 ids = 3840 BPE ranks (256 single bytes, rank = byte value, then 3584 merges in training
order) + 256 special ids 3840..4095 laid out exactly like Kimi K3's 163584..163839 (name -> 3840 + offset,
e.g. "[BOS]" 3840, "<|end_of_msg|>" 3842, "<|open|>" 3843, "[PAD]" 4095; the rest `<|reserved_token_N|>`).
Pre-tokenization uses Kimi's own pattern (`kimi_jax.tokenizer.KIMI_PAT_STR`).

Deterministic: ties between equally frequent pairs go to the smallest (left id, right id), so the same Python
version always produces the same files.

    python -m kimi_jax.tokenizer.train_bpe [--out kimi_jax/assets/tiny] [--max-corpus-bytes 0]
"""

import argparse
import ast
import base64
import collections
import heapq
import json
import platform
import sysconfig
import time
from pathlib import Path

import regex

from kimi_jax.tokenizer import K3_SPECIAL_OFFSETS, KIMI_PAT_STR, NUM_SPECIAL_IDS, load_tokenizer_folder

NUM_BPE_RANKS = 3840
DEFAULT_OUT = Path(__file__).resolve().parent.parent / "kimi_jax" / "assets" / "tiny"


def stdlib_documents(max_bytes: int = 0) -> list[str]:
    """Source of every top-level stdlib module (name order), then each module docstring once more.

    Args:
      max_bytes: stop adding documents past this many UTF-8 bytes (0 = no limit).
    """
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    sources = [p.read_text(encoding="utf-8", errors="replace") for p in sorted(stdlib.glob("*.py"))]
    docstrings = []
    for source in sources:
        try:
            docstring = ast.get_docstring(ast.parse(source))
        except SyntaxError:  # a few stdlib test-support files are not valid for this parser version
            docstring = None
        if docstring:
            docstrings.append(docstring)
    documents, total = [], 0
    for document in sources + docstrings:
        total += len(document.encode("utf-8"))
        if max_bytes and total > max_bytes:
            break
        documents.append(document)
    return documents


def count_pieces(documents: list[str]) -> collections.Counter:
    """Pre-token pieces (Kimi pattern) -> count. `regex` needs V1 mode for the `&&` class intersections."""
    pattern = regex.compile(KIMI_PAT_STR, flags=regex.V1)
    counts: collections.Counter = collections.Counter()
    for document in documents:
        counts.update(pattern.findall(document))
    return counts


def _pairs(word: list[int]) -> collections.Counter:
    return collections.Counter(zip(word, word[1:]))


def _merge(word: list[int], pair: tuple[int, int], new_id: int) -> list[int]:
    merged, i = [], 0
    while i < len(word):
        if i + 1 < len(word) and (word[i], word[i + 1]) == pair:
            merged.append(new_id)
            i += 2
        else:
            merged.append(word[i])
            i += 1
    return merged


def train_bpe(piece_counts: collections.Counter, num_ranks: int) -> list[bytes]:
    """Byte-level BPE. Returns token bytes by rank: 256 single bytes, then merged tokens in merge order."""
    vocab = [bytes([b]) for b in range(256)]
    id_of = {token: i for i, token in enumerate(vocab)}
    words = [list(piece.encode("utf-8")) for piece in piece_counts]
    freqs = list(piece_counts.values())
    pair_counts: collections.Counter = collections.Counter()
    pair_words: dict[tuple[int, int], set[int]] = collections.defaultdict(set)
    for w, word in enumerate(words):
        for pair, n in _pairs(word).items():
            pair_counts[pair] += n * freqs[w]
            pair_words[pair].add(w)
    heap = [(-n, pair) for pair, n in pair_counts.items()]
    heapq.heapify(heap)
    while len(vocab) < num_ranks and heap:
        neg_count, pair = heapq.heappop(heap)
        if pair_counts.get(pair, 0) != -neg_count or neg_count == 0:
            continue  # stale heap entry
        token = vocab[pair[0]] + vocab[pair[1]]
        if token not in id_of:  # two different pairs can spell the same bytes: reuse the token
            id_of[token] = len(vocab)
            vocab.append(token)
        new_id = id_of[token]
        changed = set()
        for w in sorted(pair_words[pair]):
            old = words[w]
            new = _merge(old, pair, new_id)
            for p, n in _pairs(old).items():
                pair_counts[p] -= n * freqs[w]
                pair_words[p].discard(w)
                changed.add(p)
            for p, n in _pairs(new).items():
                pair_counts[p] += n * freqs[w]
                pair_words[p].add(w)
                changed.add(p)
            words[w] = new
        for p in changed:
            if pair_counts[p] > 0:
                heapq.heappush(heap, (-pair_counts[p], p))
            else:
                del pair_counts[p]
    if len(vocab) < num_ranks:
        raise ValueError(f"corpus too small: only {len(vocab)} of {num_ranks} ranks could be formed")
    return vocab


def write_tokenizer(out: Path, vocab: list[bytes], provenance: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "tiktoken.model", "w", encoding="ascii") as f:
        for rank, token in enumerate(vocab):
            f.write(f"{base64.b64encode(token).decode('ascii')} {rank}\n")
    added = {str(len(vocab) + offset): {"content": name, "special": True}
             for name, offset in sorted(K3_SPECIAL_OFFSETS.items(), key=lambda kv: kv[1])}
    config = {
        "tokenizer_class": "TikTokenTokenizer",
        "bos_token": "[BOS]",
        "eos_token": "<|end_of_msg|>",
        "extra_eos_tokens": ["[EOS]"],
        "pad_token": "[PAD]",
        "unk_token": "[UNK]",
        "vocab_size": len(vocab) + NUM_SPECIAL_IDS,
        "added_tokens_decoder": added,
        "training": provenance,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=1, ensure_ascii=False) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--max-corpus-bytes", type=int, default=0, help="0 = the whole corpus")
    args = parser.parse_args()
    start = time.perf_counter()
    documents = stdlib_documents(args.max_corpus_bytes)
    corpus_bytes = sum(len(d.encode("utf-8")) for d in documents)
    piece_counts = count_pieces(documents)
    vocab = train_bpe(piece_counts, NUM_BPE_RANKS)
    provenance = {
        "script": "python -m kimi_jax.tokenizer.train_bpe",
        "corpus": "CPython standard library Lib/*.py sources + module docstrings",
        "corpus_license": "PSF-2.0 (Python Software Foundation License)",
        "python": platform.python_version(),
        "num_documents": len(documents),
        "corpus_bytes": corpus_bytes,
        "num_merges": len(vocab) - 256,
    }
    write_tokenizer(args.out, vocab, provenance)
    tokenizer = load_tokenizer_folder(args.out)
    num_tokens = sum(len(tokenizer.encode(d)) for d in documents)
    print(f"{len(documents)} documents, {corpus_bytes} bytes, {len(piece_counts)} distinct pieces; "
          f"vocab {tokenizer.vocab_size}; {corpus_bytes / num_tokens:.2f} bytes/token; "
          f"{time.perf_counter() - start:.1f} s -> {args.out}")


if __name__ == "__main__":
    main()
