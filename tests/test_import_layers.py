"""The package layers import only downward, and no first-party modules import each other in a cycle.

Layers, bottom to top: ``pallas_kernels`` (ops) <- ``kimi_jax`` (model, weights, tokenizer, training, API) and,
beside it, ``sharding`` (meshes, partition rules, shard_map pieces, planner) <- ``serve`` (engine, server, CLI,
benches). ``kimi_jax`` and ``sharding`` may import each other (the model calls the shard_map pieces; the planner
reads the model's shapes) as long as no modules form a cycle. Every import counts, including those inside
functions. The one documented exception: ``kimi_jax.LLM`` / ``kimi_jax.SamplingParams``
re-export the serving engine's offline API lazily (``kimi_jax/__init__.py`` imports ``serve`` only when the
attribute is first read, after ``kimi_jax`` itself has finished importing, so it cannot cycle).
"""

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
LAYERS = ("pallas_kernels", "kimi_jax", "sharding", "serve")
RANK = {"pallas_kernels": 0, "kimi_jax": 1, "sharding": 1, "serve": 2}
LAZY_REEXPORTS = {("kimi_jax", "serve.engine.llm"), ("kimi_jax", "serve.engine.sampling_params")}


def _module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, pathlib.Path]:
    return {_module_name(p): p for layer in LAYERS for p in (ROOT / layer).rglob("*.py")}


def _imports(name: str, path: pathlib.Path, known: set[str]) -> set[str]:
    """First-party modules ``name`` imports (``from pkg import sub`` resolves to ``pkg.sub`` when it is a module)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1] + ([base] if base else []))
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                found.add(sub if sub in known else base)
    return {m for m in found if m.split(".")[0] in LAYERS}


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    known = set(modules)
    return {name: _imports(name, path, known) for name, path in modules.items()}


def test_layers_import_only_downward():
    upward = sorted((src, dst) for src, dsts in _graph().items() for dst in dsts
                    if RANK[dst.split(".")[0]] > RANK[src.split(".")[0]] and (src, dst) not in LAZY_REEXPORTS)
    assert not upward, "upward imports: " + ", ".join(f"{s} -> {d}" for s, d in upward)


def test_no_import_cycles():
    graph = {src: {d for d in dsts if (src, d) not in LAZY_REEXPORTS} for src, dsts in _graph().items()}
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done
    cycles = []

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                cycles.append(path[path.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


@pytest.mark.parametrize("source, expected", [
    ("import serve.engine\n", {"serve.engine"}),
    ("def f():\n    from serve.engine import llm\n", {"serve.engine.llm"}),
    ("from . import kernel\n", {"pallas_kernels.mxfp4.kernel"}),
])
def test_the_import_scan_sees_every_kind_of_import(tmp_path, source, expected):
    """The checks above can fail: the scan finds plain, function-level and relative imports."""
    path = tmp_path / "mod.py"
    path.write_text(source)
    known = {"serve.engine", "serve.engine.llm", "pallas_kernels.mxfp4", "pallas_kernels.mxfp4.kernel"}
    assert _imports("pallas_kernels.mxfp4.ops", path, known) == expected
