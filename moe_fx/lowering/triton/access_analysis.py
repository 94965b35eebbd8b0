"""Inductor's analysis of which buffers a moe_fx kernel launch reads and writes, made once per specialisation.

When a graph holding moe_fx's kernel launches compiles, torch analyses each ``triton_kernel_wrapper`` launch to learn
which of its tensors the kernel writes (``torch._higher_order_ops.triton_kernel_wrap.identify_accessed_tensors``;
``identify_mutated_tensors`` in older torch): it generates the kernel's Triton IR and walks it. It does so for every
launch, several times per compile (AOTAutograd's two functionalising passes, Inductor's lowering), with no cache,
and the IR generation is most of a moe_fx layer's tracing time: 8 GPT-OSS-sized layers at T=1 traced in 2.0 s on the
2-core CPU machine, 1.5 s of it in 48 IR generations (3 launches a layer, twice each), all for three distinct
kernel specialisations. A model's layers launch the same kernels with the same constants and dtypes, so the answer
is the same for each.

The answer depends only on the kernel and on what torch's IR generation reads of each argument (``generate_ttir``):
a tensor's dtype (the IR is made from an empty tensor of that dtype), a symbolic size (made 2), a tensor
descriptor's metadata, any other value itself (constants, and integers that Triton specialises on). Its result names
the kernel's parameters, never a tensor. :func:`install` wraps torch's analysis with a memo keyed by exactly that,
for moe_fx's own kernels; every other kernel, and any argument the key cannot hold, goes to torch's analysis as
before. Each caller gets its own copy of the answer.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable, Hashable
from typing import Any

import torch

from moe_fx.lowering.triton._loader import KERNELS_MODULE

__all__ = ["ANALYSES", "analysis_key", "install"]

#: The analysis functions of ``torch._higher_order_ops.triton_kernel_wrap`` that :func:`install` wraps (whichever the
#: installed torch has; both take ``(kernel, kwargs, tma_descriptor_metadata)``).
ANALYSES = ("identify_accessed_tensors", "identify_mutated_tensors")


def _jit_function(kernel: Any) -> Any:
    """The ``JITFunction`` of a kernel (an autotuner's inner one)."""
    from triton.runtime.autotuner import Autotuner

    return kernel.fn if isinstance(kernel, Autotuner) else kernel


def _argument_key(value: Any) -> Hashable:
    """What torch's IR generation reads of one argument (see the module docstring); raises TypeError when the value
    cannot be held in a key."""
    import sympy
    from torch._inductor.ir import TensorBox

    if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool, sympy.Expr)):
        return ("symbolic",)
    if isinstance(value, (torch.Tensor, TensorBox)):
        return ("tensor", value.dtype)
    hash(value)
    return ("value", type(value), value)


def analysis_key(kernel: Any, kwargs: dict[str, Any], tma_descriptor_metadata: Any) -> Hashable | None:
    """The memo key of one analysis, or None when it must not be memoised (not a moe_fx kernel, a tensor descriptor
    argument, an argument that cannot be held in a key)."""
    jit = _jit_function(kernel)
    if getattr(getattr(jit, "fn", None), "__module__", None) != KERNELS_MODULE or tma_descriptor_metadata:
        return None
    if jit is not kernel:  # an autotuner (torch makes one per launch to hold its constants): IR of its first config
        configs = getattr(kernel, "configs", None) or []
        kwargs = {**kwargs, **(configs[0].kwargs if configs else {})}
    try:
        args = tuple(sorted((name, _argument_key(value)) for name, value in kwargs.items()))
    except TypeError:
        return None
    import triton

    return jit, args, repr(triton.runtime.driver.active.get_current_target())


def _memoised(analysis: Callable[..., Any]) -> Callable[..., Any]:
    memo: dict[Hashable, Any] = {}

    @functools.wraps(analysis)
    def memoised(kernel: Any, kwargs: dict[str, Any], tma_descriptor_metadata: Any, *rest: Any) -> Any:
        key = analysis_key(kernel, kwargs, tma_descriptor_metadata) if not rest else None
        if key is None:
            return analysis(kernel, kwargs, tma_descriptor_metadata, *rest)
        if key not in memo:
            memo[key] = analysis(kernel, kwargs, tma_descriptor_metadata)
        return copy.deepcopy(memo[key])

    memoised.moe_fx_memo = memo  # type: ignore[attr-defined]
    memoised.moe_fx_wrapped = analysis  # type: ignore[attr-defined]
    return memoised


@functools.cache
def install() -> tuple[str, ...]:
    """Wrap torch's kernel access analysis with the memo (once per process; the decomposition rule of
    :mod:`moe_fx.lowering.register` calls it before it traces a plan's launches); returns the names wrapped. The
    wrapped functions keep their names in their module, where torch's callers look them up at each call."""
    from torch._higher_order_ops import triton_kernel_wrap

    wrapped = []
    for name in ANALYSES:
        analysis = getattr(triton_kernel_wrap, name, None)
        if analysis is not None and not hasattr(analysis, "moe_fx_memo"):
            setattr(triton_kernel_wrap, name, _memoised(analysis))
            wrapped.append(name)
    return tuple(wrapped)
