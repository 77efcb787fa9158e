"""The offline training corpus: the running interpreter's Python standard library.

Source: every ``*.py`` file under ``sysconfig.get_paths()["stdlib"]`` (``site-packages`` and ``__pycache__``
excluded), read as UTF-8 (files that are not valid UTF-8 are skipped). Each file gives two documents: its
source text, and its docstrings (module, classes, functions) as plain prose, each under its qualified name.
Licence: the CPython standard library is distributed under the Python Software Foundation License (PSF-2.0);
the corpus is derived from it and the trained weights are a derivative work under those terms.

Split: by file, deterministically: a file is held out when ``sha256(relative path) % 100 < heldout_percent``,
so both documents of a file land on the same side and the split does not depend on the file set.
Tokenisation: each document is encoded (special-token text stays plain text) and followed by ``eos``;
the documents of each split are concatenated in sorted path order into one uint16 token stream.
"""

from __future__ import annotations

import ast
import dataclasses
import hashlib
import inspect
import os
import platform
import sysconfig
import warnings
from collections.abc import Iterator

import numpy as np

LICENSE = "PSF-2.0 (Python Software Foundation License), CPython standard library"
EXCLUDED_DIRS = ("site-packages", "__pycache__")


@dataclasses.dataclass(frozen=True)
class SourceFile:
    """One standard-library file: its path relative to the stdlib root and its text."""

    path: str
    text: str


@dataclasses.dataclass(frozen=True)
class Corpus:
    """Token streams of the two splits plus provenance.

    train, heldout: uint16 ``[tokens]``; train_files, heldout_files: file counts; source_bytes: UTF-8 bytes of
    all documents; python: the interpreter version whose standard library was read; tokenizer: fingerprint
    of the tokenizer that encoded it; heldout_percent: the split.
    """

    train: np.ndarray
    heldout: np.ndarray
    train_files: int
    heldout_files: int
    source_bytes: int
    python: str
    tokenizer: str
    heldout_percent: int

    def fingerprint(self) -> str:
        """sha256 of both token streams (identical corpora have identical fingerprints)."""
        h = hashlib.sha256()
        h.update(self.train.tobytes())
        h.update(self.heldout.tobytes())
        return h.hexdigest()[:16]

    def save(self, path: str) -> None:
        np.savez(path, train=self.train, heldout=self.heldout,
                 meta=np.array([self.train_files, self.heldout_files, self.source_bytes, self.heldout_percent],
                              np.int64),
                 python=np.array(self.python), tokenizer=np.array(self.tokenizer))

    @classmethod
    def load(cls, path: str) -> "Corpus":
        with np.load(path) as z:
            train_files, heldout_files, source_bytes, heldout_percent = (int(v) for v in z["meta"])
            return cls(train=z["train"], heldout=z["heldout"], train_files=train_files,
                       heldout_files=heldout_files, source_bytes=source_bytes, python=str(z["python"]),
                       tokenizer=str(z["tokenizer"]), heldout_percent=heldout_percent)


def tokenizer_fingerprint(tokenizer) -> str:
    """sha256 over the bytes of every token id: a saved corpus is reused only with the same tokenizer."""
    h = hashlib.sha256()
    for i in range(tokenizer.vocab_size):
        h.update(tokenizer.token_bytes(i) + b"\0")
    return h.hexdigest()[:16]


def stdlib_root() -> str:
    return sysconfig.get_paths()["stdlib"]


def stdlib_files(root: str | None = None) -> Iterator[SourceFile]:
    """The ``*.py`` files under ``root`` (default: this interpreter's stdlib) in sorted path order."""
    root = root or stdlib_root()
    paths = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d not in EXCLUDED_DIRS]
        paths.extend(os.path.relpath(os.path.join(folder, f), root) for f in files if f.endswith(".py"))
    for rel in sorted(paths):
        with open(os.path.join(root, rel), "rb") as f:
            raw = f.read()
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            continue
        yield SourceFile(rel.replace(os.sep, "/"), text)


def is_heldout(path: str, heldout_percent: int) -> bool:
    return int(hashlib.sha256(path.encode()).hexdigest(), 16) % 100 < heldout_percent


def module_name(path: str) -> str:
    """``json/decoder.py`` -> ``json.decoder``; ``email/__init__.py`` -> ``email``."""
    parts = path[: -len(".py")].split("/")
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def docstrings(source: SourceFile) -> str:
    """The file's docstrings as prose: ``qualified.name`` then the cleaned docstring, blank-line separated.

    Empty when the file has no docstrings or does not parse with this interpreter's grammar."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", SyntaxWarning)  # old escape sequences in string literals
            tree = ast.parse(source.text)
    except (SyntaxError, ValueError):
        return ""
    entries = []

    def visit(node: ast.AST, prefix: str) -> None:
        doc = ast.get_docstring(node, clean=False) if isinstance(
            node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) else None
        if doc and doc.strip():
            entries.append(f"{prefix}\n\n{inspect.cleandoc(doc)}\n")
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                visit(child, f"{prefix}.{child.name}")

    visit(tree, module_name(source.path))
    return "\n".join(entries)


def documents(source: SourceFile) -> list[str]:
    """The source text and (when non-empty) the docstring prose of one file."""
    prose = docstrings(source)
    return [source.text] + ([prose] if prose else [])


def build_corpus(tokenizer, *, heldout_percent: int = 3, root: str | None = None) -> Corpus:
    """Read, split and tokenise the standard library (``tokenizer``: kimi_jax Tokenizer; eos = first eos id)."""
    eos = tokenizer.eos_token_ids[0]
    streams: dict[bool, list[np.ndarray]] = {False: [], True: []}
    counts = {False: 0, True: 0}
    source_bytes = 0
    for source in stdlib_files(root):
        held = is_heldout(source.path, heldout_percent)
        counts[held] += 1
        for doc in documents(source):
            source_bytes += len(doc.encode("utf-8"))
            streams[held].append(np.asarray(tokenizer.encode(doc) + [eos], np.uint16))
    cat = lambda parts: np.concatenate(parts) if parts else np.zeros(0, np.uint16)  # noqa: E731
    return Corpus(train=cat(streams[False]), heldout=cat(streams[True]), train_files=counts[False],
                  heldout_files=counts[True], source_bytes=source_bytes, python=platform.python_version(),
                  tokenizer=tokenizer_fingerprint(tokenizer), heldout_percent=heldout_percent)


def token_stream(tokenizer, *, heldout: bool, heldout_percent: int = 3, max_tokens: int | None = None,
                 root: str | None = None, seed: int | None = None) -> np.ndarray:
    """One split's documents as :func:`build_corpus` tokenises them, in sorted path order (so the held-out stream
    is a prefix of ``Corpus.heldout``) or in a file permutation drawn from ``seed``; cut at ``max_tokens``."""
    sources = [s for s in stdlib_files(root) if is_heldout(s.path, heldout_percent) == heldout]
    if seed is not None:
        sources = [sources[i] for i in np.random.default_rng(seed).permutation(len(sources))]
    eos = tokenizer.eos_token_ids[0]
    parts, count = [], 0
    for source in sources:
        for doc in documents(source):
            parts.append(np.asarray(tokenizer.encode(doc) + [eos], np.uint16))
            count += len(parts[-1])
        if max_tokens is not None and count >= max_tokens:
            break
    stream = np.concatenate(parts) if parts else np.zeros(0, np.uint16)
    return stream if max_tokens is None else stream[:max_tokens]


def load_or_build(path: str | None, tokenizer, *, heldout_percent: int = 3) -> Corpus:
    """Load a saved corpus from ``path`` when it exists and was made with ``tokenizer`` and the same split, else
    build it (and save it there when given)."""
    if path and os.path.exists(path):
        corpus = Corpus.load(path)
        if (corpus.tokenizer, corpus.heldout_percent) == (tokenizer_fingerprint(tokenizer), heldout_percent):
            return corpus
    corpus = build_corpus(tokenizer, heldout_percent=heldout_percent)
    if path:
        corpus.save(path)
    return corpus
