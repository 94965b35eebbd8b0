"""Every MoE layer of a model, so that ``moe_fx.explain()`` lists the ones the pass never saw too.

The graph pass reports the regions it finds (anchored on stacked expert weights) and the capture steps
report the modules they examine. A layer whose experts are written in a way neither recognises (Doge's
retrieval experts stored as embeddings, JetMoE's mixture of attention heads, ...) would otherwise be
missing from the report; :func:`unseen_moe_layers` names it with a reason.
"""

from __future__ import annotations

from torch import nn

from moe_fx.passes.report import RegionReport

__all__ = ["moe_layers", "qualify_layer_names", "unseen_moe_layers"]

#: Class-name endings of MoE blocks (``DogeCDMoE``, ``Llama4TextMoe``, ``Qwen2MoeSparseMoeBlock``); a family
#: prefix such as ``Qwen2Moe`` in ``Qwen2MoeMLP`` (a shared expert) does not make a block.
_BLOCK_SUFFIXES = ("MoE", "Moe", "MoeBlock", "MoEBlock")
_FAMILY_SUFFIXES = ("Experts", "SparseMoeBlock", "MoE", "Moe")


def _is_experts(module: nn.Module) -> bool:
    return type(module).__name__.endswith("Experts")


def _is_moe_block(module: nn.Module) -> bool:
    return type(module).__name__.endswith(_BLOCK_SUFFIXES) and not hasattr(module, "base_model_prefix")


def moe_layers(model: nn.Module) -> list[tuple[str, str]]:
    """``(module path, class name)`` of every MoE layer of ``model``, in module order.

    A layer is an ``*Experts`` module (outermost one; its parent when the attribute holding it is not
    named like experts, JetMoE's ``input_linear`` / ``output_linear``), or an MoE block (``*MoE`` /
    ``*Moe`` class) that holds no ``*Experts`` module.
    """
    out: list[tuple[str, str]] = []
    modules = dict(model.named_modules())
    for path, module in modules.items():
        parent_path, _, attr = path.rpartition(".")
        if _is_experts(module):
            if any(_is_experts(modules[p]) for p in _ancestors(path)):
                continue
            if "expert" not in attr.lower() and parent_path in modules:
                path, module = parent_path, modules[parent_path]
        elif not _is_moe_block(module) or any(_is_experts(m) for m in module.modules()):
            continue
        if (path, type(module).__name__) not in out:
            out.append((path, type(module).__name__))
    return out


def _ancestors(path: str) -> list[str]:
    parts = path.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def _covers(report: RegionReport, path: str) -> bool:
    """Whether ``report`` is about the layer at ``path`` (its own module, one inside it, or one around it;
    ``""`` is the model itself, when the MoE block is what was compiled)."""
    layer = report.layer
    if not path:
        return True
    return layer == path or layer.startswith(path + ".") or path.startswith(layer + ".")


def _family(cls: str) -> str:
    for suffix in _FAMILY_SUFFIXES:
        if cls.endswith(suffix) and len(cls) > len(suffix):
            return cls[: -len(suffix)]
    return ""


def qualify_layer_names(model: nn.Module, reports: list[RegionReport]) -> None:
    """Give reports named relative to a sub-module their full module path in ``model``, in place.

    After a graph break Dynamo traces a decoder layer's forward as a frame of its own, and the module paths
    it records start at that layer (``mlp.experts``). Reports are in the order the layers ran, so the n-th
    report with a relative name takes the n-th module path of ``model`` ending with that name.
    """
    paths = [p for p, _ in model.named_modules()]
    known = set(paths)
    taken = {r.layer for r in reports if r.layer in known}
    for r in reports:
        if not r.layer or r.layer in known:
            continue
        match = next((p for p in paths if p.endswith("." + r.layer) and p not in taken), None)
        if match is not None:
            r.layer = match
            taken.add(match)


def unseen_moe_layers(model: nn.Module, reports: list[RegionReport]) -> list[RegionReport]:
    """A not-matched report for every MoE layer of ``model`` that no report in ``reports`` covers."""
    out = []
    for path, cls in moe_layers(model):
        if any(_covers(r, path) for r in reports):
            continue
        out.append(RegionReport(
            layer=path, family=_family(cls),
            reason=f"the pass found no experts region of this {cls}: no pair of stacked expert weights feeding "
                   "up -> activation -> down products in the traced graph (experts of another kind, such as "
                   "attention heads or embedding rows), and no capture step applies",
        ))  # fmt: skip
    return out
