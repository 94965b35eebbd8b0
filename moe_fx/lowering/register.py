"""Registers every device implementation of the moe_fx ops (``ops/`` defines them and knows nothing of this).

For ``moe_fx::experts`` and ``moe_fx::masked_experts``, two things each:

* **eager kernels** (CPU and CUDA dispatch keys): validate, plan (:mod:`moe_fx.lowering.experts`), and
  run the plan's kernels at once, or the op's torch reference when the plan says so. ``kernel="triton"``
  on CPU runs the Triton kernels under Triton's interpreter (slow; for tests);
* **a decomposition for compiled graphs**: a ``torch_dispatch`` rule for ``FunctionalTensorMode``, the
  mode AOTAutograd traces graphs under (the mechanism of ``torch.library.triton_op``). When Inductor
  compiles a graph holding the op on a CUDA device, the rule runs the same plan on the traced
  tensors: each Triton launch becomes a ``triton_kernel_wrapper`` node and each DeepGEMM GEMM an
  extern call, so the code Inductor generates launches the kernels itself, with the tiles, grids
  and buffers decided once at compile time, and no Python of moe_fx runs per call. When the plan is
  the reference (CPU, or no kernel can run) the op stays one opaque call.

The expert-parallel ops get their kernels from :mod:`moe_fx.lowering.prepare_finalize`:
``ep_dispatch`` / ``ep_combine`` from :mod:`~moe_fx.lowering.prepare_finalize.ep`, ``ep_agree_step`` /
``ep_remaining_rounds`` from :mod:`~moe_fx.lowering.prepare_finalize.rounds`. They stay opaque calls in
compiled graphs (their Python runs at each call, or once when a CUDA graph is recorded).
"""

from __future__ import annotations

import torch
from torch._library.triton import set_wrap_triton_enabled
from torch._subclasses.fake_tensor import FakeTensor
from torch._subclasses.functional_tensor import FunctionalTensor, FunctionalTensorMode

from moe_fx.lowering.experts import plan_experts, plan_masked_experts, run_experts, run_masked_experts_op
from moe_fx.lowering.prepare_finalize.ep import (
    ep_combine_impl,
    ep_dispatch_impl,
    ep_dispatch_recv_impl,
    ep_dispatch_send_impl,
)
from moe_fx.lowering.prepare_finalize.rounds import agree_step, remaining_rounds
from moe_fx.ops.checks import check_experts, check_masked_experts
from moe_fx.ops.experts import bind_experts, reference_of
from moe_fx.ops.masked_experts import bind_masked_experts, masked_reference_of

__all__ = ["experts_eager", "masked_experts_eager"]

_LIB = torch.library.Library("moe_fx", "IMPL")


def _eager(bind, check, plan_of, run, reference):
    """An eager kernel (CPU and CUDA): bind by the schema, validate, plan, run the plan or the reference."""

    def kernel(*args: object, **kwargs: object) -> torch.Tensor:
        a = bind(*args, **kwargs)
        check(a)
        plan = plan_of(a)
        if plan.reference:
            return reference(a)
        with set_wrap_triton_enabled(False):
            return run(a, plan)

    return kernel


#: Eager kernel of ``moe_fx::experts`` (see the module docstring).
experts_eager = _eager(bind_experts, check_experts, plan_experts, run_experts, reference_of)
#: Eager kernel of ``moe_fx::masked_experts``.
masked_experts_eager = _eager(bind_masked_experts, check_masked_experts, plan_masked_experts, run_masked_experts_op,
                              masked_reference_of)


def _plain_tensors(types: tuple) -> bool:
    """Only tensors the decomposition understands (tensor subclasses keep the op as it is)."""
    return all(issubclass(t, FakeTensor) or t in (torch.Tensor, FunctionalTensor) for t in types)


def _decomposition(bind, plan_of, run):
    """A FunctionalTensorMode rule: trace the plan's kernels into the graph, or keep the op."""

    def rule(mode, op, types, args, kwargs):
        a = bind(*args, **kwargs)
        first = a["hidden"] if "hidden" in a else a["x"]
        if first.device.type != "cuda" or not _plain_tensors(types):
            return mode.__torch_dispatch__(op, types, args, kwargs)
        plan = plan_of(a)
        if plan.reference:
            return mode.__torch_dispatch__(op, types, args, kwargs)
        from moe_fx.lowering.triton.access_analysis import install

        install()  # torch analyses each traced kernel launch: once per kernel specialisation, not once per layer
        with mode:
            return run(a, plan)

    return rule


for _key in ("CPU", "CUDA"):
    _LIB.impl("experts", experts_eager, _key)
    _LIB.impl("masked_experts", masked_experts_eager, _key)
    _LIB.impl("ep_dispatch", ep_dispatch_impl, _key)
    _LIB.impl("ep_dispatch_send", ep_dispatch_send_impl, _key)
    _LIB.impl("ep_dispatch_recv", ep_dispatch_recv_impl, _key)
    _LIB.impl("ep_combine", ep_combine_impl, _key)
    _LIB.impl("ep_remaining_rounds", remaining_rounds, _key)
# No tensor arguments: the dispatcher reaches it through the composite key.
_LIB.impl("ep_agree_step", agree_step, "CompositeExplicitAutograd")

torch.library.register_torch_dispatch(
    "moe_fx::experts", FunctionalTensorMode, _decomposition(bind_experts, plan_experts, run_experts), lib=_LIB
)
torch.library.register_torch_dispatch(
    "moe_fx::masked_experts", FunctionalTensorMode,
    _decomposition(bind_masked_experts, plan_masked_experts, run_masked_experts_op), lib=_LIB,
)
