"""The ``moe_fx`` torch.compile backend: moe_fx passes on Dynamo's graph, then Inductor.

Registered under the ``torch_dynamo_backends`` entry point, so ``torch.compile(m, backend="moe_fx")``
works without importing moe_fx first. ``torch.compile`` loads the entry point when it is called, before
Dynamo traces anything: importing this module then sets the two Dynamo options MoE blocks need to trace
as one graph (:func:`enable_capture`; JetMoE's ``.tolist()`` counts, ``nonzero`` in expert loops), as
``moe_fx.compile`` does.

What a backend cannot do: Dynamo hands it graphs, never the module objects, and by the time it is called
the graph breaks are made. An experts module that loops over the experts a batch hits (DBRX, LongCat-Flash,
Step-3.7, transformers' ``eager``) or a fine-grained FP8 experts module graph-breaks inside its forward, so
no graph holds its block whole; only a capture step that patches the module *before* tracing
(:mod:`moe_fx.capture`, which ``moe_fx.compile`` runs) turns it into one op. The backend warns once per
model about such modules (:func:`_warn_uncaptured`), naming them and ``moe_fx.compile`` as the fix.
"""

from __future__ import annotations

import copy
import functools
import hashlib
import logging
import math
import sys
import time
import warnings
import weakref
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.fx as fx
from torch._dynamo.utils import dynamo_timed

from moe_fx.config import MoEConfig
from moe_fx.passes.manager import PassContext, run_passes
from moe_fx.passes.report import RegionReport

if TYPE_CHECKING:
    from torch._inductor.custom_graph_pass import CustomGraphPass

__all__ = [
    "PASSES_TIMER",
    "CheckedCall",
    "MoEFxBackend",
    "UncapturedExpertsWarning",
    "cache_salt",
    "compile_with_cpp_wrapper_fallback",
    "cpp_wrapper_refusal",
    "enable_capture",
    "make_backend",
    "moe_fx_backend",
    "passes_fingerprint",
    "static_launch_options",
]

log = logging.getLogger("moe_fx")

#: The key of the moe_fx passes in ``torch._dynamo.utils.compile_times()`` (seconds per compiled graph).
PASSES_TIMER = "moe_fx_passes"
#: Whether the compiled code launches user-defined Triton kernels (moe_fx's, and any of the model's own) through
#: Inductor's static CUDA launcher (``torch._inductor.config.static_launch_user_defined_triton_kernels``, torch's C++
#: launch path) instead of Triton's Python launcher: less host time per launch, which a decode step of many layers
#: pays several times a layer. A kernel the static launcher cannot take (device-made TMA descriptors need Triton's
#: global scratch) keeps Triton's launcher, kernel by kernel (Inductor logs why). ``MoEConfig.inductor_options``
#: overrides it. Read at every compile; only graphs with CUDA inputs get it (a CPU graph has no CUDA launch to save).
#: Inductor's compile workers get only ``use_static_triton_launcher`` of the parent's options (torch 2.11-2.13,
#: ``async_compile``), so a kernel compiled in a worker would keep Triton's launcher: with the switch on, the graph
#: compiles its kernels in-process (``compile_threads=1``). On since 2026-12-05 (tenth session, H100, GPT-OSS-20B
#: layers, default-mode generate(), batch 1): in one set of alternating rounds, 12 layers, decode 1.052x of moe_fx
#: without it (195 / 185 tok/s; plain 177; step 5140 / 5407 µs at the same GPU busy time,
#: bench/results/e2e_model_2026-12-05_gpt_oss12_ab_static_h100.md; 1.036x at 2 layers in the ninth session); a cold
#: compile of 16 layers (empty Inductor and Triton caches, one T=1 forward) 25.5 s against 22.4 s
#: (e2e_model_2026-12-05_gpt_oss16_compile_{shipped,static}_h100.md). On the H200, each side in a run of its own:
#: +3% at T=1, +6% in generate()'s decode (``..._s9.md``).
STATIC_LAUNCH_KERNELS = True
#: The Inductor options :data:`STATIC_LAUNCH_KERNELS` puts in every compile of a graph with CUDA inputs.
_STATIC_LAUNCH_OPTIONS = {"static_launch_user_defined_triton_kernels": True, "compile_threads": 1}


def static_launch_options(example_inputs: Sequence[Any]) -> dict[str, Any]:
    """The Inductor options of :data:`STATIC_LAUNCH_KERNELS` for a graph compiled with ``example_inputs``: none when
    the switch is off or no input is a CUDA tensor."""
    return dict(_STATIC_LAUNCH_OPTIONS) if STATIC_LAUNCH_KERNELS and _on_cuda(example_inputs) else {}


def _on_cuda(example_inputs: Sequence[Any]) -> bool:
    return any(isinstance(x, torch.Tensor) and x.device.type == "cuda" for x in example_inputs)


#: Whether decode-sized graphs (:func:`cpp_wrapper_refusal`) compile with Inductor's C++ wrapper (``cpp_wrapper``):
#: the code that allocates a step's buffers and launches its kernels is C++ instead of Python. A decode step in
#: default mode is host-bound (GPT-OSS-20B, 8 layers, batch 1, H100: 9.7 ms of wall against 1.4 ms of GPU work a step),
#: and the C++ wrapper took the step to 5.8 ms: generate() decode 174 against 103 tok/s (1.69x; plain torch.compile
#: 97 tok/s, whose own C++ wrapper does not compile with transformers' ``grouped_mm`` experts on torch 2.11,
#: bench/results/e2e_model_2026-12-06_gpt_oss8_ab_cpp_h100.md; Qwen3-30B-A3B 1.42-1.54x over the Python wrapper, bf16
#: and transformers' FP8 experts, e2e_model_2026-12-06_qwen3{,_fp8}_8_ab_py_h100.md). At full depth (GPT-OSS-20B, 24
#: layers) generate() decodes at 138 against plain's 85 tok/s (1.63x, e2e_model_2026-12-06_full_gpt_oss_gen_b1_cpp_s18_
#: h100.md). It costs a C++ compile per such graph (logged with the graph's whole compile time: on torch 2.11, which builds
#: the wrapper at -O3, 96 s for 4 Qwen3 layers and 144 s for 24 GPT-OSS layers), kept by Inductor's on-disk cache. A graph
#: whose C++ wrapper fails to compile is compiled again with the Python wrapper (logged). On since 2026-12-06.
CPP_WRAPPER = True
#: The most tokens a graph's MoE ops may take for it to get the C++ wrapper: decode steps, whose host time is most of
#: their wall time; their tiles (at most 16 rows per expert) make no TMA descriptors on the device.
CPP_WRAPPER_MAX_TOKENS = 16
#: The expert weight dtypes whose decode graphs were checked under the C++ wrapper on a GPU (bit for bit the Python
#: wrapper's output; fp8 since 2026-12-06, after the lowering stopped making device TMA descriptors in such graphs).
CPP_WRAPPER_WEIGHT_DTYPES = (torch.bfloat16, torch.float16, torch.float8_e4m3fn)
#: Whether a graph whose token count is symbolic gets the C++ wrapper too when the size it was traced with is at most
#: :data:`CPP_WRAPPER_MAX_TOKENS`. Such a graph serves every later size of its rows-per-expert regime (the lowering
#: guards on it), all of them decode sizes. Off: its GPU test passes (bit for bit the Python wrapper's output), but the
#: case it was built for did not need it: ``generate()`` with a batch of 4 and ``dynamic=True`` on transformers'
#: StaticCache traces its decode step with a static batch (the cache's shapes fix it), which the shipped rule already
#: gives the C++ wrapper (1.01x with the switch on, the same graphs; e2e_model_2026-12-06_qwen3_4_b4_ab_dyn_h100.md).
CPP_WRAPPER_DYNAMIC = False


def cpp_wrapper_refusal(gm: fx.GraphModule, example_inputs: Sequence[Any], patches: dict[str, Any]) -> str | None:
    """Why the rewritten graph ``gm`` does not get Inductor's C++ wrapper (:data:`CPP_WRAPPER`), or None if it does.

    It does when the switch is on, the graph runs on CUDA, neither CUDA graphs (which remove the host cost, and which
    Inductor skips under the C++ wrapper) nor the caller's own ``cpp_wrapper`` option is set, and the graph holds
    ``moe_fx::experts`` ops only of the kind checked under the C++ wrapper on a GPU: weights of a dtype in
    :data:`CPP_WRAPPER_WEIGHT_DTYPES`, a static token count of at most :data:`CPP_WRAPPER_MAX_TOKENS` (or, with
    :data:`CPP_WRAPPER_DYNAMIC`, a symbolic one traced at such a size).
    """
    from moe_fx.lowering.problem import size_hint
    from moe_fx.passes.graph_utils import bound_op_args, moe_fx_op

    if not CPP_WRAPPER:
        return "moe_fx.backend.CPP_WRAPPER is off"
    if not _on_cuda(example_inputs):
        return "no CUDA input"
    if patches.get("triton.cudagraphs"):
        return "CUDA graphs"
    if "cpp_wrapper" in patches:
        return "cpp_wrapper set by the caller"
    ops = [n for n in gm.graph.nodes if n.op == "call_function" and moe_fx_op(n) is not None]
    if not ops:
        return "no moe_fx op"
    for node in ops:
        if moe_fx_op(node) != "experts":
            return f"moe_fx::{moe_fx_op(node)} (expert parallelism)"
        args = bound_op_args(node)
        hidden = args["hidden"]
        if not isinstance(hidden, torch.Tensor) or args["w13"].dtype not in CPP_WRAPPER_WEIGHT_DTYPES:
            return f"{args['w13'].dtype} weights"
        dims = hidden.shape[:-1]
        if not all(isinstance(d, int) for d in dims):
            if not CPP_WRAPPER_DYNAMIC:
                return "a dynamic token count"
            dims = [size_hint(d) for d in dims]
        tokens = math.prod(dims)
        if tokens > CPP_WRAPPER_MAX_TOKENS:
            return f"{tokens} tokens (more than {CPP_WRAPPER_MAX_TOKENS})"
    return None


def compile_with_cpp_wrapper_fallback(
    compile_fn: Callable[..., Callable], gm: fx.GraphModule, example_inputs: list[Any], patches: dict[str, Any],
    cpp_wrapper: bool,
) -> Callable:
    """``compile_fn(gm, example_inputs, config_patches=...)`` with ``cpp_wrapper`` added to ``patches`` when asked;
    if that compile fails (a C++ wrapper that does not compile: torch 2.11 declares no C shim for some ops), ``gm``
    compiles again with the Python wrapper, and the failure is logged. Dynamo's own signals raised from inside a compile
    (``TorchDynamoException``: ``TensorifyScalarRestartAnalysis`` asks Dynamo to trace the frame again) are not
    failures and pass through. Inductor's passes rewrite the graph they are given, so the C++ attempt compiles a copy
    of ``gm``'s graph (the module's attributes are shared, not copied)."""
    from torch._dynamo.exc import TorchDynamoException

    if not cpp_wrapper:
        return compile_fn(gm, example_inputs, config_patches=patches)
    attempt = fx.GraphModule(gm, copy.deepcopy(gm.graph))  # fx copies nodes with shallow copies of their meta
    attempt.meta.update(gm.meta)
    start = time.perf_counter()
    try:
        compiled = compile_fn(attempt, example_inputs, config_patches={**patches, "cpp_wrapper": True})
    except TorchDynamoException:
        raise
    except Exception as err:  # noqa: BLE001  (any failure of the optional wrapper falls back to the default one)
        log.warning("moe_fx: Inductor's C++ wrapper failed for this graph, compiling it with the Python wrapper: %s",
                    str(err).splitlines()[0] if str(err) else type(err).__name__)
        return compile_fn(gm, example_inputs, config_patches=patches)
    log.info("moe_fx: graph compiled with Inductor's C++ wrapper in %.1f s", time.perf_counter() - start)
    return compiled


def enable_capture() -> None:
    """Set the Dynamo options that let MoE blocks trace into one graph.

    ``capture_dynamic_output_shape_ops`` lets a ``range(E)`` loop over ``nn.ModuleList`` experts with
    ``torch.where`` / ``nonzero`` trace without a graph break; ``capture_scalar_outputs`` does the
    same for ``.item()`` / ``.tolist()`` counts (JetMoE). Both are process-wide Dynamo settings; importing
    this module sets them (``torch.compile(..., backend="moe_fx")`` imports it before tracing).
    """
    cfg = torch._dynamo.config
    if not (cfg.capture_dynamic_output_shape_ops and cfg.capture_scalar_outputs):
        log.info("moe_fx: enabling torch._dynamo.config.capture_dynamic_output_shape_ops and capture_scalar_outputs")
    cfg.capture_dynamic_output_shape_ops = True
    cfg.capture_scalar_outputs = True


enable_capture()


class UncapturedExpertsWarning(UserWarning):
    """``backend="moe_fx"`` met experts modules only ``moe_fx.compile`` rewrites (see the module docstring)."""


#: Models the backend already warned about (once per model).
_WARNED: weakref.WeakSet = weakref.WeakSet()


def _compiled_model() -> torch.nn.Module | None:
    """The module ``torch.compile`` was given, found on the Python stack of the current compile, or None.

    A backend is never handed the model; what it can see is Dynamo's frame wrapper (``torch/_dynamo/eval_frame.py``),
    which holds the callable it compiles (``fn``: the model's forward, bound to the model). Read-only, at compile
    time only; None when it cannot be found (then nothing is said).
    """
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_filename.endswith(("_dynamo/eval_frame.py", "_dynamo\\eval_frame.py")):
            fn = frame.f_locals.get("fn")
            owner = fn if isinstance(fn, torch.nn.Module) else getattr(fn, "__self__", None)
            if isinstance(owner, torch.nn.Module):
                return getattr(owner, "_orig_mod", owner)
        frame = frame.f_back
    return None


def _warn_uncaptured(config: MoEConfig) -> None:
    """Warn once per model about experts modules that only a capture step (``moe_fx.compile``) rewrites
    (the backend entry: ``moe_fx.compile`` and ``explain`` ran the capture steps themselves and do not ask)."""
    if not config.enabled:
        return
    model = _compiled_model()
    if model is None or model in _WARNED:
        return
    from moe_fx.capture.steps import uncaptured_modules

    found = uncaptured_modules(model)
    _WARNED.add(model)
    if not found:
        return
    names = ", ".join(f"{path} ({cls})" for path, cls, _ in found)
    warnings.warn(
        f"moe_fx: torch.compile(model, backend='moe_fx') leaves {len(found)} experts module(s) of "
        f"{type(model).__name__} as written: {names}. They loop over the experts a batch hits (or are FP8 "
        "checkpoint experts), which graph-breaks before a torch.compile backend sees them, and a backend never "
        "sees modules. Use model = moe_fx.compile(model) (same torch.compile arguments), which captures before "
        "tracing those whose form it proves; moe_fx.explain(model, *inputs) shows which entry rewrites each layer.",
        UncapturedExpertsWarning, stacklevel=2,
    )


#: The files of the package whose content a compiled graph depends on: its source, and the data the lowering reads
#: while it plans (the shipped tile table, ``lowering/triton/tuned_tiles.json``: an upgrade that only retunes tiles
#: must not replay a cached graph's old tiles)
FINGERPRINTED = ("*.py", "*.json")


def _fingerprint_of(root: Path, version: str) -> str:
    """A hash of ``version`` and every :data:`FINGERPRINTED` file under ``root`` (names and contents)."""
    digest = hashlib.sha256(version.encode())
    for path in sorted(p for pattern in FINGERPRINTED for p in root.rglob(pattern)):
        digest.update(path.relative_to(root).as_posix().encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


@functools.cache
def passes_fingerprint() -> str:
    """A hash of moe_fx's own source (passes, ops, lowering) and of its shipped tile table: changes whenever the
    rewrite or the kernels it plans may change."""
    from moe_fx._version import __version__

    return _fingerprint_of(Path(__file__).parent, __version__)


def cache_salt(inner: Any = None) -> CustomGraphPass:
    """An Inductor custom pass that puts in the cache key (AOTAutograd's and Inductor's) what the compiled code depends
    on besides the graph: :func:`passes_fingerprint` (moe_fx's source) and the lowering's settings as they are at this
    compile (:func:`~moe_fx.lowering.settings.settings_fingerprint`).

    ``backend="moe_fx"`` sets it on every compile. Code that calls ``torch.ops.moe_fx.experts`` itself under plain
    Inductor (``torch.compile(fn)``) should pass ``options={"post_grad_custom_post_pass": cache_salt()}``: the op's
    kernels are chosen while AOTAutograd traces it, and AOTAutograd's cache keys a graph by its ops' names, so
    without the salt a warm cache replays the kernels of the moe_fx (and settings) that compiled it first.

    ``inner``: the ``post_grad_custom_post_pass`` the user set (in ``torch.compile``'s ``options``, in
    ``MoEConfig.inductor_options`` or in ``torch._inductor.config``; a pass, or a list of them as torch 2.13 takes), which
    this slot would otherwise replace: the salt runs it on every graph and adds its ``uuid()`` to the key. A pass
    Inductor cannot key (a plain callable, or a ``uuid()`` of None) gives the salt no uuid either, so Inductor skips its
    caches for the graph, as it would for that pass alone.
    """
    from torch._inductor.custom_graph_pass import CustomGraphPass

    from moe_fx.lowering.settings import settings_fingerprint

    inners = tuple(inner) if isinstance(inner, (list, tuple)) else (() if inner is None else (inner,))

    class MoEFxCacheSalt(CustomGraphPass):
        def __call__(self, graph: fx.Graph) -> None:
            for p in inners:
                p(graph)

        def uuid(self) -> str | None:
            keys = [p.uuid() if isinstance(p, CustomGraphPass) else None for p in inners]
            if not all(keys):
                return None
            return "-".join([f"moe_fx-{passes_fingerprint()}-{settings_fingerprint()}", *map(str, keys)])

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
        captured: True when the caller ran the module capture steps itself (``moe_fx.compile``,
            ``explain``); False (the backend entry) warns once per model about the modules only they capture.
    """

    def __init__(
        self, config: MoEConfig | None = None, *, sink: list[RegionReport] | None = None, inductor: bool = True,
        captured: bool = False,
    ) -> None:
        if config is not None and not isinstance(config, MoEConfig):
            raise TypeError(f"moe_fx backend: config must be a MoEConfig or None, got {type(config).__name__}")
        self.config = config or MoEConfig()
        self.sink, self.inductor, self.captured = sink, inductor, captured

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
        # timed under Dynamo's name for it, so that torch._dynamo.utils.compile_times() (and benchmarks)
        # show what moe_fx adds to a compile beside Dynamo's tracing and Inductor's compile_fx
        with dynamo_timed(PASSES_TIMER):
            if not self.captured:
                _warn_uncaptured(self.config)
            ctx = _run_moe_passes(gm, example_inputs, self.config, self.sink)
        if not self.inductor:
            compiled = gm.forward
        else:
            import torch._inductor.config as inductor_config
            from torch._inductor import list_mode_options
            from torch._inductor.compile_fx import compile_fx

            patches = {
                **static_launch_options(example_inputs),
                **(list_mode_options(mode) if mode else {}),
                **(options or {}),
                **self.config.inductor_options,
            }
            # the salt takes Inductor's one post-grad slot: the user's pass (set there or globally) runs inside it
            patches["post_grad_custom_post_pass"] = cache_salt(
                patches.get("post_grad_custom_post_pass", inductor_config.post_grad_custom_post_pass))
            refusal = cpp_wrapper_refusal(gm, example_inputs, patches)
            if refusal is None:  # the first compile of such a graph takes longer: say why
                log.info("moe_fx: a decode-sized graph: compiling it with Inductor's C++ wrapper (a C++ compile, minutes "
                         "for a deep model on torch 2.11, once: Inductor's disk cache keeps it; moe_fx.backend.CPP_WRAPPER)")
            else:
                log.debug("moe_fx: Python wrapper for this graph: %s", refusal)
            compiled = compile_with_cpp_wrapper_fallback(compile_fx, gm, list(example_inputs), patches, refusal is None)
        for action in ctx.after_compile:
            action()
        ctx.after_compile.clear()  # they may hold the example inputs; nothing of the compile outlives it
        return CheckedCall(compiled, ctx.call_checks) if ctx.call_checks else compiled


def make_backend(
    config: MoEConfig | None = None, *, sink: list[RegionReport] | None = None, inductor: bool = True,
    captured: bool = False,
) -> MoEFxBackend:
    """A torch.compile backend that runs the moe_fx passes with ``config``, then Inductor (a picklable
    :class:`MoEFxBackend`).

    ``sink`` collects the pass reports of every graph compiled; ``inductor=False`` returns the
    rewritten graph's Python code instead of compiling it (for explain and graph tests); ``captured=True``
    says the caller ran the module capture steps (no warning about the modules they capture).
    """
    return MoEFxBackend(config, sink=sink, inductor=inductor, captured=captured)


def moe_fx_backend(gm: fx.GraphModule, example_inputs: Sequence[Any], **compile_kwargs: Any) -> Callable:
    """The default ``backend="moe_fx"``: moe_fx passes with the default :class:`MoEConfig`, then Inductor.

    ``torch.compile``'s ``mode`` and ``options`` arrive here and go to Inductor, so
    ``torch.compile(model, backend="moe_fx", mode="reduce-overhead")`` replays CUDA graphs.
    """
    return MoEFxBackend()(gm, example_inputs, **compile_kwargs)
