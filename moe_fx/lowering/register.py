"""Registers the CUDA kernel of ``moe_fx::experts``; the CPU (and any unregistered device) runs the reference.

At each call the CUDA implementation asks :mod:`moe_fx.lowering.select` which kernel to run (the
choice is cached per shape there and logged once) and runs it:

* ``"deepgemm"``  -> :func:`moe_fx.lowering.experts.deepgemm_experts.deepgemm_experts`
* ``"triton"``    -> :func:`moe_fx.lowering.experts.triton_experts.triton_experts`
* ``"reference"`` -> :func:`moe_fx.ops.experts_reference`

The op's ``impl`` argument is honoured: ``"auto"`` follows the rule; an explicit request that cannot
run raises a ``RuntimeError`` that says why. Under ``"auto"``, a DeepGEMM failure at run time (its JIT
compiler missing, for instance) demotes DeepGEMM for the rest of the process, logs the reason once
and runs Triton instead.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable

import torch

from moe_fx.lowering.select import choose_experts_kernel, decode_rows, mark_kernel_unusable
from moe_fx.ops.checks import check_experts_inputs
from moe_fx.ops.experts import experts_reference

__all__ = ["experts_cuda", "kernel_impl"]

log = logging.getLogger("moe_fx.lowering")

# Kernel modules are imported on first use: importing moe_fx on a machine without Triton or
# DeepGEMM must not fail, and the reference needs neither.
_IMPLS = {
    "deepgemm": ("moe_fx.lowering.experts.deepgemm_experts", "deepgemm_experts"),
    "triton": ("moe_fx.lowering.experts.triton_experts", "triton_experts"),
}


def kernel_impl(kernel: str) -> Callable[..., torch.Tensor]:
    """The Python function that runs ``kernel`` (same signature as :func:`moe_fx.ops.experts_reference`)."""
    if kernel == "reference":
        return experts_reference
    if kernel not in _IMPLS:
        raise ValueError(f"moe_fx: unknown experts kernel {kernel!r}; known: reference, {', '.join(_IMPLS)}")
    module, name = _IMPLS[kernel]
    return getattr(importlib.import_module(module), name)


def experts_cuda(
    hidden: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    activation: str = "silu",
    weights_on_input: bool = False,
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
    impl: str = "auto",
) -> torch.Tensor:
    """CUDA implementation of ``moe_fx::experts``: select a kernel (see module docstring) and run it.

    Shapes and dtypes as in :mod:`moe_fx.ops.experts`: hidden ``[T, H]``, topk ``[T, K]``,
    w13 ``[E, 2I, H]``, w2 ``[E, H, I]`` (bf16/fp16/fp32, or fp8 e4m3 with fp32 128x128 block scales).
    Returns ``[T, H]`` in ``hidden.dtype``.
    """
    check_experts_inputs(hidden, topk_ids, topk_weights, w13, w2, activation, w13_scale, w2_scale, impl)
    if hidden.shape[0] == 0:
        return hidden.new_zeros(hidden.shape)
    fp8 = w13.dtype == torch.float8_e4m3fn
    choice = choose_experts_kernel(
        device_type=hidden.device.type,
        dtype=hidden.dtype,
        hidden=hidden.shape[1],
        intermediate=w2.shape[2],
        num_experts=w13.shape[0],
        request=impl,
        fp8=fp8,
        activation=activation,
        device=hidden.device,
        rows_per_expert=decode_rows(hidden.shape[0], topk_ids.shape[1], w13.shape[0]),
    )
    if choice.error is not None:
        raise RuntimeError(
            f"moe_fx.experts: impl={impl!r} was requested but cannot run: {choice.error} "
            f"(hidden {hidden.dtype} {list(hidden.shape)}, w13 {w13.dtype} {list(w13.shape)}, "
            f"w2 {w2.dtype} {list(w2.shape)}); use impl='auto' to let moe_fx pick one that can"
        )
    args = (hidden, topk_ids, topk_weights, w13, w2, activation, weights_on_input, w13_scale, w2_scale)
    if choice.kernel == "deepgemm" and impl == "auto":
        try:
            return kernel_impl("deepgemm")(*args)
        except (RuntimeError, ImportError) as e:
            # DeepGEMM JIT-compiles at first use; a broken toolchain shows up here, once. Demote it for
            # the process so later calls (and explain) take the next kernel without retrying.
            reason = f"failed at run time ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
            log.warning("moe_fx.experts: DeepGEMM %s; falling back to the next kernel for this process", reason)
            mark_kernel_unusable("deepgemm", f"deep_gemm {reason}")
            return experts_cuda(*args, impl="auto")
    return kernel_impl(choice.kernel)(*args)


torch.library.register_kernel("moe_fx::experts", "cuda", experts_cuda)

# The CUDA kernel of moe_fx::masked_experts (expert parallelism) registers itself on import.
from moe_fx.lowering.experts import masked as _masked  # noqa: E402,F401
from moe_fx.lowering.dispatch import ep_combine_impl, ep_dispatch_impl  # noqa: E402

torch.library.register_kernel("moe_fx::ep_dispatch", ("cpu", "cuda"), ep_dispatch_impl)
torch.library.register_kernel("moe_fx::ep_combine", ("cpu", "cuda"), ep_combine_impl)
