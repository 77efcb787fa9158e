"""Documented public names of the standard library, for the chat transcripts (:mod:`kimi_jax.training.transcripts`).

Each public module, class, function and method with a docstring gives a :class:`DocEntry`: its dotted name, its
signature as written in the source, the summary line (the docstring's first paragraph on one line) and, for short
top-level functions, their source. Test suites (``test``, ``idle_test``, ``tests`` folders) and private names
(any dotted part starting with ``_``) are left out. Files split as in :mod:`kimi_jax.training.corpus`, so held-out
entries come from modules the model never saw in pre-training or fine-tuning. Licence: PSF-2.0, as the corpus.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import textwrap
import warnings

from kimi_jax.training.corpus import SourceFile, is_heldout, module_name, stdlib_files

MODULE_ALIASES = {"posixpath": "os.path"}  # the name users import (os.path is posixpath on POSIX)
SKIPPED_DIRS = ("test", "tests", "idle_test")
SKIPPED_PACKAGES = ("encodings",)  # a hundred codecs with the same generated docstring
MAX_SUMMARY_CHARS = 200
MIN_SUMMARY_CHARS = 12
MAX_SOURCE_CHARS = 900
MAX_SHORT_SIGNATURE = 60


@dataclasses.dataclass(frozen=True)
class DocEntry:
    """name: dotted name (``os.path.join``); module: its module; kind: module | class | function | method;
    signature: ``(a, *p)`` (a class: its ``__init__`` without ``self``; a module: empty); summary: the first
    docstring paragraph on one line; paragraph: that paragraph as written; source: a short top-level function's
    code, else None."""

    name: str
    module: str
    kind: str
    signature: str
    summary: str
    paragraph: str
    source: str | None = None

    @property
    def display(self) -> str:
        """The name with its signature, long ones cut after a parameter: ``os.path.join(a, *p)``."""
        sig = self.signature
        if len(sig) > MAX_SHORT_SIGNATURE:
            cut = sig.rfind(", ", 0, MAX_SHORT_SIGNATURE - 5)
            sig = sig[:cut] + ", ...)" if cut > 0 else "(...)"
        return self.name + sig

    @property
    def short_name(self) -> str:
        return self.name.rsplit(".", 1)[-1]


def skipped(path: str) -> bool:
    """Test suites, private modules (docstrings about tests or internals) and :data:`SKIPPED_PACKAGES`."""
    parts = path[: -len(".py")].split("/")
    return parts[0] in SKIPPED_PACKAGES or any(p in SKIPPED_DIRS or (p.startswith("_") and p != "__init__")
                                               for p in parts)


def first_paragraph(doc: str, name: str) -> str:
    """The docstring's first paragraph, skipping a leading signature line such as ``reduce(function, ...)``."""
    paragraphs = [p.strip() for p in inspect.cleandoc(doc).split("\n\n") if p.strip()]
    if len(paragraphs) > 1 and paragraphs[0].startswith(f"{name}("):
        paragraphs = paragraphs[1:]
    return paragraphs[0] if paragraphs else ""


def summary_line(paragraph: str) -> str | None:
    """The paragraph on one line, cut at its first sentence when long; None when unusable (too short or long)."""
    line = " ".join(paragraph.split())
    if len(line) > MAX_SUMMARY_CHARS and ". " in line:
        line = line[: line.index(". ") + 1]
    return line if MIN_SUMMARY_CHARS <= len(line) <= MAX_SUMMARY_CHARS else None


def _signature(args: ast.arguments, drop_first: bool) -> str:
    args = ast.arguments(**{f: getattr(args, f) for f in args._fields})
    if drop_first:
        if args.posonlyargs:
            args.posonlyargs = args.posonlyargs[1:]
        elif args.args:
            args.args = args.args[1:]
    return f"({ast.unparse(args)})"


def _class_signature(node: ast.ClassDef) -> str:
    for child in node.body:
        if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) and child.name == "__init__":
            return _signature(child.args, drop_first=True)
    return "()"


def _entry(node: ast.AST, name: str, module: str, kind: str, text: str) -> DocEntry | None:
    doc = ast.get_docstring(node, clean=False)
    if not doc or not doc.strip():
        return None
    paragraph = first_paragraph(doc, name.rsplit(".", 1)[-1])
    summary = summary_line(paragraph)
    if summary is None:
        return None
    signature, source = "", None
    if isinstance(node, ast.ClassDef):
        signature = _class_signature(node)
    elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        signature = _signature(node.args, drop_first=kind == "method")
        if kind == "function":
            code = ast.get_source_segment(text, node)
            source = textwrap.dedent(code) if code and len(code) <= MAX_SOURCE_CHARS else None
    return DocEntry(name, module, kind, signature, summary, paragraph, source)


def doc_entries(source: SourceFile) -> list[DocEntry]:
    """The documented public names of one file, in source order (empty for skipped or unparsable files)."""
    if skipped(source.path):
        return []
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", SyntaxWarning)
            tree = ast.parse(source.text)
    except (SyntaxError, ValueError):
        return []
    module = module_name(source.path)
    module = MODULE_ALIASES.get(module, module)
    entries = [_entry(tree, module, module, "module", source.text)]
    for node in tree.body:
        if not isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) or node.name.startswith("_"):
            continue
        is_class = isinstance(node, ast.ClassDef)
        name = f"{module}.{node.name}"
        entries.append(_entry(node, name, module, "class" if is_class else "function", source.text))
        for child in node.body if is_class else []:
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) and not child.name.startswith("_"):
                entries.append(_entry(child, f"{name}.{child.name}", module, "method", source.text))
    return [e for e in entries if e is not None]


def stdlib_entries(*, heldout_percent: int = 3, root: str | None = None) -> tuple[list[DocEntry], list[DocEntry]]:
    """(train, held-out) entries of the standard library under ``root`` (default: this interpreter's), split by
    file like the pre-training corpus; duplicate names keep their first file's entry."""
    split: dict[bool, list[DocEntry]] = {False: [], True: []}
    seen: set[str] = set()
    for source in stdlib_files(root):
        held = is_heldout(source.path, heldout_percent)
        for entry in doc_entries(source):
            if entry.name not in seen:
                seen.add(entry.name)
                split[held].append(entry)
    return split[False], split[True]
