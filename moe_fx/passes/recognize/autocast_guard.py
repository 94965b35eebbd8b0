"""Guard: a region whose expert products autocast runs in another dtype is left as the model wrote it.

Under ``torch.autocast`` (around the call, or inside the model) Dynamo traces each op with the dtype
autocast gives it: an fp32 model's ``linear`` / ``bmm`` / ``_grouped_mm`` then computes in bf16 or fp16
from fp32 inputs. ``moe_fx::experts`` computes in the dtype of its inputs, so it would not equal what
eager autocast computes; such a region is refused with the reason. A region whose products keep
their inputs' dtype (a bf16 model under bf16 autocast) is unaffected and is checked as usual.
"""

from __future__ import annotations

import torch

from moe_fx.passes.graph_utils import is_matmul, tensor_value
from moe_fx.passes.recognize.extract_region import Region

__all__ = ["check_autocast"]


def _float_inputs(node) -> set[torch.dtype]:
    out = set()
    for i in node.all_input_nodes:
        v = tensor_value(i)
        if v is not None and v.dtype.is_floating_point:
            out.add(v.dtype)
    return out


def check_autocast(region: Region) -> str | None:
    """None if every expert product computes in its inputs' dtype; else the reason (autocast recasts it)."""
    for n in sorted(region.nodes, key=lambda n: n.name):
        if not is_matmul(n):
            continue
        out, ins = tensor_value(n), _float_inputs(n)
        if out is None or not ins or out.dtype in ins:
            continue
        have = "/".join(sorted(str(d).replace("torch.", "") for d in ins))
        got = str(out.dtype).replace("torch.", "")
        return (f"autocast: the expert product {n.name} computes in {got} from {have} inputs; moe_fx::experts "
                f"computes in its inputs' dtype, so the region is left as written (cast the model to {got} "
                f"instead of using autocast to have it rewritten)")
    return None
