"""Gives the kernels of :mod:`._kernels` in the form a device needs: compiled (CUDA) or interpreted (CPU).

Triton decides at *decoration* time whether ``@triton.jit`` compiles or interprets (it reads
``TRITON_INTERPRET`` then). Setting the variable at the top of a test module is fragile: any module
imported earlier in the same process may already have decorated the kernels. So the kernels'
source is loaded a second time, under the interpreter, the first time a CPU tensor needs it. CUDA
tensors get the ordinary import (interpreted too if the whole process runs with
``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import os
import sys
import types

import torch

__all__ = ["KERNELS_MODULE", "is_traced", "kernels", "launch", "triton_available"]

#: The module of moe_fx's Triton kernels (compiled; the interpreted copy carries this name + "_interpreted").
KERNELS_MODULE = "moe_fx.lowering.triton._kernels"


@functools.cache
def triton_available() -> bool:
    """Whether ``import triton`` works in this process."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


@functools.cache
def _interpreted() -> types.ModuleType:
    origin = importlib.util.find_spec(KERNELS_MODULE).origin
    spec = importlib.util.spec_from_file_location(KERNELS_MODULE + "_interpreted", origin)
    if spec is None or spec.loader is None:  # pragma: no cover - the package is broken
        raise ImportError(f"cannot load {origin}")
    module = importlib.util.module_from_spec(spec)
    old = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        spec.loader.exec_module(module)
    finally:
        if old is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = old
    sys.modules[module.__name__] = module
    return module


def kernels(device: torch.device) -> types.ModuleType:
    """The kernel module for tensors on ``device``: interpreted on CPU, compiled elsewhere."""
    if not triton_available():
        raise RuntimeError("moe_fx Triton kernels need the 'triton' package, which does not import here")
    if device.type == "cpu":
        return _interpreted()
    return _compiled()


@functools.cache
def _compiled() -> types.ModuleType:
    return importlib.import_module(KERNELS_MODULE)


def is_traced(t: torch.Tensor) -> bool:
    """Whether ``t`` is a tracing stand-in (fake / functional tensor) rather than real data.

    The Triton wrappers run in two ways: eagerly on real tensors (kernels launch at once), and while
    Inductor traces ``moe_fx::experts`` into its graph (the launches become graph nodes that
    Inductor's own generated code runs). A few host-side conveniences exist only in the first.
    """
    from torch._subclasses.fake_tensor import FakeTensor
    from torch._subclasses.functional_tensor import FunctionalTensor

    return isinstance(t, (FakeTensor, FunctionalTensor))


def launch(name: str, device: torch.device, grid: tuple, *args: object, **kwargs: object) -> None:
    """Launch kernel ``name`` of :mod:`._kernels` on ``grid``, the way the current context wants.

    Through :func:`torch.library.wrap_triton`: while AOTAutograd traces (Inductor compiling a graph
    that holds a moe_fx op) the launch is recorded as a ``triton_kernel_wrapper`` node, and the code
    Inductor generates launches the kernel itself; in eager code (``set_wrap_triton_enabled(False)``)
    and under the CPU interpreter it is a plain launch.
    """
    kernel = getattr(kernels(device), name)
    if kwargs.get("DEVICE_TMA") and device.type == "cuda":
        _set_tma_allocator()
    # Every parameter passed explicitly: torch 2.11's Inductor neither fills a user kernel's defaults in
    # its generated launch ("launcher() missing ... required positional arguments") nor analyses which
    # buffers such a launch writes ("Incorrect number of arguments passed to kernel").
    _launchable(kernel)[grid](*args, **{**_defaults_not_given(kernel, len(args), frozenset(kwargs)), **kwargs})


def _launchable(kernel: object) -> object:
    """``kernel`` wrapped by :func:`torch.library.wrap_triton`, or ``kernel`` itself if interpreted.

    An interpreted kernel (``TRITON_INTERPRET=1``: an ``InterpretedFunction``, not a ``JITFunction``)
    cannot become a graph node and only ever launches eagerly. torch 2.13's ``wrap_triton`` hands
    such a kernel back unchanged; torch 2.11's raises "wrap_triton only works on functions annotated
    with triton.jit", so the interpreter case is decided here, by the kernel's type, for both.
    """
    from torch.library import wrap_triton
    from triton.runtime.jit import JITFunction

    if not isinstance(kernel, JITFunction):
        return kernel
    return wrap_triton(kernel)


@functools.cache
def _defaults_not_given(kernel: object, num_args: int, given_names: frozenset[str]) -> dict[str, object]:
    """``{parameter: default}`` of ``kernel``'s parameters with a default that a call with ``num_args``
    positional arguments and the keywords ``given_names`` leaves out (read once per call shape: it is on
    every eager launch). The caller must not modify the dict."""
    import inspect

    params = list(inspect.signature(getattr(kernel, "fn", kernel)).parameters.values())
    given = {p.name for p in params[:num_args]} | given_names
    return {p.name: p.default for p in params if p.name not in given and p.default is not inspect.Parameter.empty}


@functools.cache
def _set_tma_allocator() -> None:
    """Give Triton the scratch allocator that kernels making tensor descriptors on the device need.

    Such a kernel asks its launcher for a little global memory per program; without an allocator
    Triton raises "no allocator was set". Set once, at the first such launch (or trace: compiled
    graphs launch in the same thread); Inductor sets an equivalent one itself where it does.
    """
    import triton

    if hasattr(triton, "set_allocator"):
        triton.set_allocator(lambda size, alignment, stream: torch.empty(size, dtype=torch.int8, device="cuda"))
