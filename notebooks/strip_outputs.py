"""Strip outputs, execution counts and cell metadata from notebooks, so the repository holds sources only.

    python notebooks/strip_outputs.py                 # rewrite every notebooks/*.ipynb in place
    python notebooks/strip_outputs.py --check         # exit 1 listing the notebooks that still carry outputs
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import nbformat

HERE = Path(__file__).resolve().parent
KERNELSPEC = {"display_name": "Python 3 (ipykernel)", "language": "python", "name": "python3"}


def stripped(book: nbformat.NotebookNode) -> nbformat.NotebookNode:
    """A copy of ``book`` with no outputs, execution counts or per-cell metadata."""
    book = nbformat.from_dict(book)
    for cell in book.cells:
        cell.metadata = {}
        if cell.cell_type == "code":
            cell.outputs = []
            cell.execution_count = None
    book.metadata = {"kernelspec": book.metadata.get("kernelspec", KERNELSPEC), "language_info": {"name": "python"}}
    return book


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("paths", nargs="*", type=Path, help="notebooks (default: notebooks/*.ipynb)")
    parser.add_argument("--check", action="store_true", help="only report notebooks that are not stripped")
    args = parser.parse_args(argv)
    dirty = []
    for path in args.paths or sorted(HERE.glob("*.ipynb")):
        book = nbformat.read(path, as_version=4)
        clean = stripped(book)
        if clean != book:
            dirty.append(path)
            if not args.check:
                nbformat.write(clean, path)
    if args.check and dirty:
        print("notebooks with outputs (run notebooks/strip_outputs.py):", *map(str, dirty), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
