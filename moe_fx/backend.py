"""The ``moe_fx`` torch.compile backend: moe_fx passes on Dynamo's graph, then Inductor.

Registered under the ``torch_dynamo_backends`` entry point, so ``torch.compile(m, backend="moe_fx")``
works without importing moe_fx first.
"""

from __future__ import annotations

import functools
import hashlib
import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.fx as fx

from moe_fx.config import MoEConfig
from moe_fx.passes.manager import PassContext, run_passes
from moe_fx.passes.report import RegionReport

__all__ = ["CheckedCall", "MoEFxBackend", "make_backend", "moe_fx_backend", "passes_fingerprint"]

log = logging.getLogger("moe_fx")


def _fingerprint_of(root: Path, version: str) -> str:
    digest = hashlib.sha256(version.encode())
    for path in sorted(root.rglob("*.py")):
        digest.update(path.relative_to(root).as_posix().encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


@functools.cache
def passes_fingerprint() -> str:
    """A hash of moe_fx's own source (passes, ops, lowering): changes whenever the rewrite may change."""
    from moe_fx._version import __version__

    return _fingerprint_of(Path(__file__).parent, __version__)


def _cache_salt():
    """An Inductor custom pass that does nothing but put :func:`passes_fingerprint` in the cache key."""
    from torch._inductor.custom_graph_pass import CustomGraphPass

    class MoEFxCacheSalt(CustomGraphPass):
        def __call__(self, graph: fx.Graph) -> None:
            return None

        def uuid(self) -> str:
            return "moe_fx-" + passes_fingerprint()

    return MoEFxCacheSalt()


def _run_moe_passes(
    gm: fx.GraphModule, example_inputs: Sequence[Any], config: MoEConfig, sink: list[RegionReport] | None
) -> PassContext:
    import moe_fx.lowering  # noqa: F401  (registers device kernels for the ops)

    from moe_fx.lowering.weights import pack_experts_weights

    ctx = PassContext(config=config, example_inputs=list(example_inputs), pack_weights=pack_experts_weights)
    if torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in example_inputs):
        # The moe_fx ops have no backward; a graph traced for training stays as it is.
        ctx.report.append(RegionReport(layer="<graph>", reason="grad mode is on (training is not supported); "
                                                                "run under torch.no_grad() or inference_mode()"))
        log.info("moe_fx: graph left untouched: grad mode is on and inputs require grad")
    else:
        run_passes(gm, ctx)
    if sink is not None:
        sink.extend(ctx.report)
    return ctx


class CheckedCall:
    """``compiled``, running ``checks`` on the graph inputs before every call.

    The checks keep weights made at rewrite time in step with the model's parameters
    (:mod:`moe_fx.passes.expert_storage`). Dynamo calls what a backend returns with the graph inputs
    as positional arguments. A module-level class, not a closure: it holds the compiled graph and the
    checks, nothing of the compile (no example input).
    """

    def __init__(self, compiled: Callable, checks: Sequence[Callable[[Sequence[Any]], None]]) -> None:
        self.compiled, self.checks = compiled, tuple(checks)

    def __call__(self, *args: Any) -> Any:
        for check in self.checks:
            check(args)
        return self.compiled(*args)


class MoEFxBackend:
    """The torch.compile backend: the moe_fx passes with ``config`` on Dynamo's graph, then Inductor.

    A module-level class whose state is its arguments, so that what ``torch.compile`` returns with it
    pickles as it does with ``backend="inductor"`` (``pickle.dumps(moe_fx.compile(model))``).

    Attributes:
        config: the :class:`MoEConfig` the passes run with.
        sink: a list that collects the pass reports of every graph compiled, or None.
        inductor: False returns the rewritten graph's Python code instead of compiling it with
            Inductor (explain and graph tests).
    """

    def __init__(
        self, config: MoEConfig | None = None, *, sink: list[RegionReport] | None = None, inductor: bool = True
    ) -> None:
        if config is not None and not isinstance(config, MoEConfig):
            raise TypeError(f"moe_fx backend: config must be a MoEConfig or None, got {type(config).__name__}")
        self.config = config or MoEConfig()
        self.sink, self.inductor = sink, inductor

    @property
    def moe_fx_config(self) -> MoEConfig:
        """The config (the name earlier releases gave it on the backend function)."""
        return self.config

    def __repr__(self) -> str:
        return f"MoEFxBackend({self.config!r}, inductor={self.inductor})"

    def __call__(
        self,
        gm: fx.GraphModule,
        example_inputs: Sequence[Any],
        mode: str | None = None,
        options: dict[str, Any] | None = None,
    ) -> Callable:
        # torch.compile(..., backend="moe_fx", mode=..., options=...) hands these on: honour them as
        # Inductor would (mode="reduce-overhead" is {"triton.cudagraphs": True}: CUDA graphs).
        ctx = _run_moe_passes(gm, example_inputs, self.config, self.sink)
        if not self.inductor:
            compiled = gm.forward
        else:
            from torch._inductor import list_mode_options
            from torch._inductor.compile_fx import compile_fx

            patches = {
                **(list_mode_options(mode) if mode else {}),
                **(options or {}),
                "post_grad_custom_post_pass": _cache_salt(),
                **self.config.inductor_options,
            }
            compiled = compile_fx(gm, list(example_inputs), config_patches=patches)
        for action in ctx.after_compile:
            action()
        ctx.after_compile.clear()  # they may hold the example inputs; nothing of the compile outlives it
        return CheckedCall(compiled, ctx.call_checks) if ctx.call_checks else compiled


def make_backend(
    config: MoEConfig | None = None, *, sink: list[RegionReport] | None = None, inductor: bool = True
) -> MoEFxBackend:
    """A torch.compile backend that runs the moe_fx passes with ``config``, then Inductor (a picklable
    :class:`MoEFxBackend`).

    ``sink`` collects the pass reports of every graph compiled; ``inductor=False`` returns the
    rewritten graph's Python code instead of compiling it (for explain and graph tests).
    """
    return MoEFxBackend(config, sink=sink, inductor=inductor)


def moe_fx_backend(gm: fx.GraphModule, example_inputs: Sequence[Any], **compile_kwargs: Any) -> Callable:
    """The default ``backend="moe_fx"``: moe_fx passes with the default :class:`MoEConfig`, then Inductor.

    ``torch.compile``'s ``mode`` and ``options`` arrive here and go to Inductor, so
    ``torch.compile(model, backend="moe_fx", mode="reduce-overhead")`` replays CUDA graphs.
    """
    return MoEFxBackend()(gm, example_inputs, **compile_kwargs)
