"""The rooms keep apart and every import goes one way (imports inside functions count):

* ``ops`` (the contract) imports no other room; ``lowering`` (kernels) and ``passes`` (graphs) never import
  each other; ``verify`` (the numerical check) imports only ``ops``; ``capture`` (module patchers) may import
  ``passes`` (the structural reader, the report) and ``verify``, and no room but the user verbs imports
  ``capture``; the recognisers (``passes.recognize``) never import the passes that use them;
* fixtures (``testing``) are imported by the demo CLI only, never by the library;
* no module of the package takes part in an import circle.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1] / "moe_fx"

#: room -> rooms it must never import (module level or inside a function)
_VERBS = ("moe_fx.api", "moe_fx.backend", "moe_fx.__main__")
FORBIDDEN = {
    "moe_fx.ops": ("moe_fx.passes", "moe_fx.lowering", "moe_fx.capture", "moe_fx.verify", "moe_fx.testing", *_VERBS),
    "moe_fx.passes": ("moe_fx.lowering", "moe_fx.capture", "moe_fx.testing", *_VERBS),
    "moe_fx.passes.recognize": ("moe_fx.passes.rewrite_moe", "moe_fx.passes.quantize_experts", "moe_fx.passes.split_ep",
                                "moe_fx.passes.manager"),
    "moe_fx.lowering": ("moe_fx.passes", "moe_fx.capture", "moe_fx.verify", "moe_fx.testing", *_VERBS),
    "moe_fx.verify": ("moe_fx.passes", "moe_fx.capture", "moe_fx.lowering", "moe_fx.testing", *_VERBS),
    "moe_fx.capture": ("moe_fx.lowering", "moe_fx.testing", *_VERBS),
    "moe_fx.config": ("moe_fx.ops", "moe_fx.passes", "moe_fx.lowering", "moe_fx.capture", "moe_fx.verify",
                      "moe_fx.testing", *_VERBS),
}


def _modules() -> dict[str, pathlib.Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _resolve(name: str, modules: dict[str, pathlib.Path]) -> str | None:
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def import_graph() -> dict[str, set[str]]:
    """``{module: modules of the package it imports}`` over every import statement of every module."""
    modules = _modules()
    edges: dict[str, set[str]] = {m: set() for m in modules}
    for mod, path in modules.items():
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([base] if base else []))
                names = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            else:
                continue
            for name in names:
                target = _resolve(name, modules) if name.startswith("moe_fx") else None
                if target is not None and target != mod:
                    edges[mod].add(target)
    return edges


def import_cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def test_the_import_graph_is_read():
    edges = import_graph()
    # a few edges every version of the package has: the reader must see them, lazy imports included
    assert "moe_fx.ops.checks" in edges["moe_fx.ops.experts"]
    assert "moe_fx.config" in edges["moe_fx.api"]
    assert any(t.startswith("moe_fx.passes") for t in edges["moe_fx.backend"])
    assert import_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def _within(name: str, room: str) -> bool:
    return name == room or name.startswith(room + ".")


def violations(edges: dict[str, set[str]], room: str) -> list[str]:
    """``"<module> imports <target>"`` for every import of a module of ``room`` that :data:`FORBIDDEN` forbids."""
    return sorted(f"{m} imports {t}" for m, targets in edges.items() if _within(m, room)
                  for t in targets if any(_within(t, f) for f in FORBIDDEN[room]))


@pytest.mark.parametrize("room", sorted(FORBIDDEN))
def test_layers_import_only_downwards(room):
    assert violations(import_graph(), room) == []


def test_the_library_never_imports_its_fixtures():
    edges = import_graph()
    bad = sorted(f"{m} imports {t}" for m, targets in edges.items() if not m.startswith(("moe_fx.testing", "moe_fx.__main__"))
                 for t in targets if t.startswith("moe_fx.testing"))
    assert bad == []


def test_a_forbidden_import_is_caught():
    edges = {"moe_fx.passes.rewrite_moe": {"moe_fx.capture.hit_loops", "moe_fx.verify.probe_plan"},
             "moe_fx.passes.recognize.read_form": {"moe_fx.passes.rewrite_moe", "moe_fx.passes.graph_utils"},
             "moe_fx.capture.hit_loops": {"moe_fx.passes.recognize.read_form"}}
    assert violations(edges, "moe_fx.passes") == ["moe_fx.passes.rewrite_moe imports moe_fx.capture.hit_loops"]
    assert violations(edges, "moe_fx.passes.recognize") == [
        "moe_fx.passes.recognize.read_form imports moe_fx.passes.rewrite_moe"]
    assert violations(edges, "moe_fx.capture") == []


def test_no_import_circles():
    assert import_cycles(import_graph()) == []
