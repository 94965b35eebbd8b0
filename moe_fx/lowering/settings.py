"""What the code of a compiled graph depends on besides moe_fx's source: the lowering's settings as they are now.

The lowering decides while a graph is compiled (:mod:`moe_fx.lowering.register`): which kernels, layout and tiles
each ``moe_fx`` op runs. Those decisions read module constants (``masked_experts.pipeline.COMBINE_IN_GRAPH``, ...),
``MOE_FX_*`` environment variables (``MOE_FX_DISABLE_DEEPGEMM``), the user's tuned tiles (``triton_tiles.json``
under ``MOE_FX_CACHE_DIR``) and whether DeepGEMM is installed. AOTAutograd's and Inductor's caches key a graph by
its code and Inductor's options, none of which says any of that: a graph compiled before a setting changed came
back from the cache with the old decisions (2026-12-05: a benchmark run with ``COMBINE_IN_GRAPH=True`` on a machine
that had compiled the same model without it ran the old kernels). The moe_fx backend puts
:func:`settings_fingerprint` in the cache key beside the source hash (``moe_fx.backend``).
"""

from __future__ import annotations

import ast
import functools
import hashlib
import importlib.util
import os
import pathlib
import sys

from moe_fx.lowering.triton.configs import cache_path

__all__ = ["ENV_PREFIX", "changed_settings", "settings_fingerprint"]

#: Environment variables read by moe_fx (all of them carry this prefix).
ENV_PREFIX = "MOE_FX_"
_PLAIN = (bool, int, float, str, bytes, type(None))
_UNKNOWN = object()


def _plain(value: object) -> bool:
    """A value whose ``repr`` says all of it: scalars, and tuples, lists, sets and dicts of them."""
    if isinstance(value, _PLAIN):
        return True
    if isinstance(value, (tuple, list, frozenset, set)):
        return all(_plain(v) for v in value)
    if isinstance(value, dict):
        return all(_plain(k) and _plain(v) for k, v in value.items())
    return False


def _constant_value(expr: ast.expr, path: str) -> object:
    """The value of a constant expression (literals and operators on them: ``200 * 1024``), else :data:`_UNKNOWN`
    (a name, an attribute or a call is not known from the source alone)."""
    if any(isinstance(n, (ast.Name, ast.Attribute, ast.Call, ast.Subscript, ast.Lambda)) for n in ast.walk(expr)):
        return _UNKNOWN
    try:
        return eval(compile(ast.Expression(expr), path, "eval"), {"__builtins__": {}}, {})
    except (ArithmeticError, TypeError, ValueError):
        return _UNKNOWN


@functools.cache
def _source_constants(path: str) -> dict[str, object]:
    """The public upper-case names a module's source assigns at its top level, with the value written there when
    it is a constant expression (``200 * 1024``), else :data:`_UNKNOWN`. Names it imports are not its own."""
    tree = ast.parse(pathlib.Path(path).read_text())
    out: dict[str, object] = {}
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        for target in targets:
            if isinstance(target, ast.Name) and target.id.isupper() and not target.id.startswith("_"):
                out[target.id] = _constant_value(node.value, path)
    return out


def changed_settings() -> dict[str, str]:
    """The lowering's settings that differ from what moe_fx's source says (which the source hash covers), as
    ``{name: repr}``: each public upper-case constant of a loaded ``moe_fx.lowering`` module whose value is not the
    one its source writes (or whose source value is not a constant expression), and every ``MOE_FX_*`` environment
    variable. A module not loaded yet holds its source's values, so the answer does not depend on what was
    imported before. Cheap: called at every compile."""
    out: dict[str, str] = {}
    for name, module in sorted(sys.modules.items()):
        path = getattr(module, "__file__", None)
        if path is None or not (name == "moe_fx.lowering" or name.startswith("moe_fx.lowering.")):
            continue
        for attr, default in _source_constants(path).items():
            value = getattr(module, attr, _UNKNOWN)
            if value is not _UNKNOWN and _plain(value) and (default is _UNKNOWN or value != default):
                out[f"{name}.{attr}"] = repr(value)
    for key in sorted(os.environ):
        if key.startswith(ENV_PREFIX):
            out[f"${key}"] = os.environ[key]
    return out


def settings_fingerprint() -> str:
    """A hash of what the lowering reads besides moe_fx's source: :func:`changed_settings`, the user tile cache's
    contents and whether ``deep_gemm`` is installed. Changes whenever one of them does."""
    tiles = cache_path()
    state = {
        **changed_settings(),
        "tiles": hashlib.sha256(tiles.read_bytes()).hexdigest() if tiles.is_file() else "none",
        "deep_gemm": repr(importlib.util.find_spec("deep_gemm") is not None),
    }
    digest = hashlib.sha256()
    for name, value in sorted(state.items()):
        digest.update(f"{name}={value}\n".encode())
    return digest.hexdigest()
