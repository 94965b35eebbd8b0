"""Whole transformers MoE models: ``torch.compile(model, backend="moe_fx")`` against plain ``torch.compile(model)``.

The whole-model check of issues 10 and 16. Models are transformers 5.x causal LMs at the real per-layer sizes of

* ``qwen3``   Qwen3-30B-A3B  (E=128, K=8, H=2048, I=768, 32 heads / 4 kv heads, head_dim 128)
* ``olmoe``   OLMoE-1B-7B    (E=64,  K=8, H=2048, I=1024, 16 / 16 heads, head_dim 128)
* ``mixtral`` Mixtral-8x7B   (E=8,   K=2, H=4096, I=14336, 32 / 8 heads, head_dim 128)

with ``--layers`` decoder layers (default 2), bf16, random weights (nothing is downloaded) and a reduced
vocabulary (``--vocab``, default 32000). Every MoE model, backend and mode gets its own copy of the same
weights, so a rewrite by moe_fx can never touch what plain Inductor runs. ``--layers full`` builds each
model at its released depth (Qwen3-30B-A3B 48, OLMoE 16, Mixtral-8x7B 32, GPT-OSS-20B 24 layers, DeepSeek-V3 61,
which does not fit one GPU; random
weights made on the GPU: about 61, 14, 93 and 42 GB of bf16) and implies ``--share-weights``: each side
gets its own module tree on the one model's tensors (one copy of the weights on the GPU), and the run
checks at the end that no tensor of that model changed (storage, version counter; meta
``shared_weights_changed``). A model whose weights alone exceed the GPU's free memory (a lower bound on their
bytes: Mixtral-8x7B's 32 layers on an 80 GB H100) is not built; the results say why (meta
``models_skipped_for_memory``).

``--weights`` picks what the experts hold (one kind per run; merge runs with ``--merge``):
``bf16``; ``fp8_checkpoint``, transformers' fine-grained FP8 experts made from the bf16 model
(moe_fx.testing.fp8), moe_fx through ``moe_fx.compile`` against plain ``torch.compile`` of the same FP8
model where that runs (offline it cannot: transformers' FP8 kernels come from the Hub) and of the
dequantised bf16 model otherwise; ``quantize_fp8``, ``MoEConfig(quantize="fp8")`` on the bf16 model against
plain bf16. Every forward row also has each side's logit error against the eager model (the dequantised
one for ``fp8_checkpoint``): ``max |logits - eager| / mean |eager|`` of the last position.

What is measured (all moe_fx / plain pairs are timed alternately, in rounds, in one process, so clock and
thermal drift hit both; numbers are medians):

* **forward** at each T of ``--tokens`` (batch 1, sequence T, ``use_cache=False``, ``logits_to_keep=1``:
  the LM head runs on the last position only, as in generate's prefill), in each mode of ``--modes``
  (``default``, ``reduce-overhead`` = CUDA graphs). Per backend:
  - ``wall``: one forward, from a synchronised idle GPU to ``torch.cuda.synchronize()`` after it;
  - ``host``: the same call up to its return, without synchronising (the GPU is idle at the start, so
    this is the time the host needs to enqueue one forward; a host sync inside the forward shows up here);
  - ``gpu``: torch.profiler, the sum of the durations of all GPU activities (kernels, memcpy, memset)
    over ``--prof-iters`` forwards, divided by their number; ``kernels``: GPU activities per forward.
  and ``first_call_s``, the wall seconds of the row's first call, with ``compile``: what Dynamo compiled
  during it (from ``torch._dynamo.utils.compile_times()``: ``tracing_s`` Dynamo's own part, ``passes_s``
  the moe_fx passes, ``inductor_s`` Inductor, ``backend_calls``, ``restarts``; all zero when a compiled
  graph fitted). At full depth the first compile takes minutes; timestamped progress lines say when each
  starts and ends.
* **layer host**: the host time (and wall time) of ONE decoder layer, moe_fx minus plain, in the default
  mode at ``--layer-host-tokens``: models of ``--layers`` and ``2 * --layers`` layers are timed in the
  same rounds, ``per layer = (t(2L) - t(L)) / L``. Attention is compiled by Inductor in both, so the
  difference is what the MoE layer costs moe_fx above Inductor's own code for it.
* **generate**: greedy ``generate()`` of ``--gen-batch`` random prompts of ``--gen-prompt`` tokens, a
  static KV cache (``StaticCache``, reset before each call), ``--gen-new`` new tokens (``min_new_tokens``
  = ``max_new_tokens``), ``model.forward = torch.compile(model.forward, ...)`` with
  ``generation_config.disable_compile = True`` (transformers' documented recipe; the default mode only:
  the CUDA-graph variant is bench/generate_cudagraphs.py, which isolates its segfault). Reported: new
  tokens/s of whole calls, and decode tokens/s from ``(t(N new) - t(1 new))``, for eager, plain and
  moe_fx; whether the greedy tokens equal eager's; each side's warm-up seconds and what it compiled.
  ``--ab-set MODULE.ATTR=VALUE`` (repeatable) adds a fourth side: moe_fx compiled (under a backend object of
  its own, so it never reuses moe_fx's graphs) and called with those constants in force, timed in the same
  alternating rounds: the A/B of a lowering switch without the drift between two runs (``--set`` applies a
  constant to the whole run instead).

``--no-deepgemm`` sets ``MOE_FX_DISABLE_DEEPGEMM=1`` before moe_fx is imported (moe_fx then runs its
Triton kernels); a run without it uses DeepGEMM where ``deep_gemm`` imports and the shapes fit. Merge
the two runs (and runs split over device calls) with ``--merge A.json B.json ...``.

Compilation: ``--dynamic true`` (default) compiles each (model, backend, mode) once for every T >= 2
and once more for T = 1 (Dynamo specialises sizes 0 and 1); ``--dynamic false`` compiles per T
(closer to what a fixed-shape server sees, ~5x the compile time). Compile time counts against
``--budget-s``: a cell that would start after the budget is recorded as skipped; a cell that started runs
to its end (at full depth its two compiles take minutes). ``--specialize-float`` sets
``torch._dynamo.config.specialize_float = True`` for both sides: with ``dynamic=True`` Dynamo otherwise
makes the models' float attributes (RMSNorm eps, rotary scaling) graph inputs, AOTAutograd cannot turn
all of them into tensors and the whole compile restarts once (``restarts`` in the rows; 13-24% of a
48-layer compile on CPU, bench/results/compile_time_2026-12-03.md).

Targets (issue 10, kept by issue 16) are printed per row: default mode >= 1.0x everywhere and >= 1.3x at T >= 1024;
reduce-overhead >= 1.5x at T >= 1024; generate decode >= 1.2x; one MoE layer's host time <= 40 µs above
plain.

    python bench/e2e_model.py [--models qwen3,olmoe,mixtral] [--tokens 1,16,256,1024,4096]
        [--modes default,reduce-overhead] [--no-deepgemm] [--budget-s 420] [--tag TAG]
    python bench/e2e_model.py --models qwen3 --layers full --tokens 16,1024,4096 --modes default
    python bench/e2e_model.py --models qwen3,mixtral --weights fp8_checkpoint --tokens 16,1024,4096 --modes default
    python bench/e2e_model.py --models gpt_oss --layers 16 --no-forward --gen-batch 1
        --ab-set moe_fx.backend.STATIC_LAUNCH_KERNELS=True     # (one line) generate(): with and without a switch
    python bench/e2e_model.py --merge A.json B.json [--tag TAG]
    python bench/e2e_model.py --smoke        # CPU, tiny model, ~2-3 min on 2 cores: checks the script end to end

Writes ``e2e_model_<date>[_tag].{md,json,png}`` to ``--out`` (default bench/results), after every cell.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import datetime
import functools
import gc
import json
import os
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)  # bench/moe_layer.py's helpers

from moe_layer import (  # noqa: E402
    allow_many_compiles,
    apply_settings,
    current_settings,
    layer_floor,
    log,
    machine_meta,
    measure_limits,
    qualified_setting,
    settings_applied,
)
from pass_time import compile_metrics, compile_split  # noqa: E402

# What is measured where (the targets).
TARGET_DEFAULT = 1.0
TARGET_DEFAULT_LARGE = 1.3
TARGET_GRAPHS_LARGE = 1.5
TARGET_GENERATE = 1.2
TARGET_LAYER_HOST_US = 40.0
LARGE_T = 1024
BACKENDS = ("plain", "moe_fx")
#: The generate() side that runs moe_fx with ``--ab-set``'s constants (compiled and called with them in force).
AB_SIDE = "moe_fx_ab"


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """One model's per-layer sizes (a transformers family and its MoE / attention shape)."""

    family: str
    experts: int
    top_k: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    norm_topk_prob: bool = True
    depth: int = 2  # the released model's decoder layers (``--layers full``)


MODELS = {
    "qwen3": ModelSpec("qwen3_moe", 128, 8, 2048, 768, 32, 4, 128, depth=48),
    "olmoe": ModelSpec("olmoe", 64, 8, 2048, 1024, 16, 16, 128, norm_topk_prob=False, depth=16),
    "mixtral": ModelSpec("mixtral", 8, 2, 4096, 14336, 32, 8, 128, depth=32),
    # GPT-OSS-20B's layer: biased experts, clamped interleaved SwiGLU with alpha, H = 2880 (Triton only)
    "gpt_oss": ModelSpec("gpt_oss", 32, 4, 2880, 2880, 64, 8, 64, depth=24),
    # DeepSeek-V3's MoE layer (256 routed experts of I = 2048, one shared expert, grouped top-k, MLA attention
    # whose ranks scale with head_dim: q 1536, kv 512 at 64); 22.5 GB of experts per layer: its 61 layers do
    # not fit one H200, a few do
    "deepseek_v3": ModelSpec("deepseek_v3", 256, 8, 7168, 2048, 128, 128, 64, depth=61),
}
#: What the expert weights are (``--weights``): the moe_fx side and the plain side of each row.
WEIGHTS = {
    "bf16": "the model's bf16 experts; moe_fx = torch.compile(model, backend='moe_fx')",
    "fp8_checkpoint": (
        "transformers' fine-grained FP8 experts (e4m3, 128x128 scale_inv, built from the random bf16 model); "
        "moe_fx = moe_fx.compile(fp8 model); plain = torch.compile of the same FP8 model where it runs, else "
        "of the dequantised bf16 model (meta: plain_model)"
    ),
    "quantize_fp8": "bf16 checkpoint; moe_fx = moe_fx.compile(model, MoEConfig(quantize='fp8')); plain = bf16",
}
SMOKE_MODELS = {
    name: dataclasses.replace(spec, experts=8, top_k=2, hidden=64, intermediate=32, heads=4, kv_heads=2, head_dim=16)
    for name, spec in MODELS.items()
}


# ---------------------------------------------------------------------------------------------- models


def build_config(spec: ModelSpec, layers: int, vocab: int):
    """The transformers config of ``spec`` with ``layers`` decoder layers, every one of them MoE."""
    import transformers

    common = dict(
        vocab_size=vocab,
        hidden_size=spec.hidden,
        num_hidden_layers=layers,
        num_attention_heads=spec.heads,
        num_key_value_heads=spec.kv_heads,
        max_position_embeddings=8192,
        tie_word_embeddings=False,
        num_experts_per_tok=spec.top_k,
    )
    if spec.family == "qwen3_moe":
        cfg = transformers.Qwen3MoeConfig(
            intermediate_size=4 * spec.intermediate, moe_intermediate_size=spec.intermediate,
            num_experts=spec.experts, head_dim=spec.head_dim, norm_topk_prob=spec.norm_topk_prob,
            decoder_sparse_step=1, mlp_only_layers=[], **common,
        )
    elif spec.family == "olmoe":
        cfg = transformers.OlmoeConfig(
            intermediate_size=spec.intermediate, num_experts=spec.experts, norm_topk_prob=spec.norm_topk_prob, **common
        )
    elif spec.family == "mixtral":
        cfg = transformers.MixtralConfig(
            intermediate_size=spec.intermediate, num_local_experts=spec.experts, head_dim=spec.head_dim, **common
        )
    elif spec.family == "gpt_oss":
        cfg = transformers.GptOssConfig(
            intermediate_size=spec.intermediate, num_local_experts=spec.experts, head_dim=spec.head_dim,
            layer_types=["sliding_attention", "full_attention"] * (layers // 2) + ["sliding_attention"] * (layers % 2),
            **common,
        )
    elif spec.family == "deepseek_v3":
        hd = spec.head_dim
        cfg = transformers.DeepseekV3Config(
            moe_intermediate_size=spec.intermediate, intermediate_size=9 * spec.intermediate,
            n_routed_experts=spec.experts, n_shared_experts=1, n_group=min(8, spec.experts // 2),
            topk_group=min(4, spec.experts // 4),
            first_k_dense_replace=0, q_lora_rank=24 * hd, kv_lora_rank=8 * hd, qk_rope_head_dim=hd,
            qk_nope_head_dim=2 * hd, v_head_dim=2 * hd, **{**common, "num_key_value_heads": spec.heads},  # MLA: no GQA
        )
    else:
        raise ValueError(f"unknown family {spec.family!r}")
    if spec.hidden // spec.heads != spec.head_dim and spec.family == "olmoe":
        raise ValueError(f"OLMoE's head_dim is hidden / heads: {spec.hidden} / {spec.heads} != {spec.head_dim}")
    return cfg


def build_model(spec: ModelSpec, layers: int, vocab: int, device: str, dtype, seed: int = 0):
    """A randomly initialised causal LM of ``spec`` on ``device`` in ``dtype``, in eval mode, no grad."""
    import torch
    import transformers

    torch.manual_seed(seed)
    cfg = build_config(spec, layers, vocab)
    with torch.device(device):
        # GPT-OSS's attention sinks have no sdpa path: its eager attention, as its users run it
        attn = "eager" if spec.family == "gpt_oss" else "sdpa"
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation=attn)
    model.eval().requires_grad_(False)
    return model


def weight_bytes_at_least(spec: ModelSpec, layers: int, vocab: int, itemsize: int) -> int:
    """A lower bound on the bytes of one copy of the model's weights: its experts (gate, up, down), the router,
    the q / k / v / o projections at their head counts (none for DeepSeek-V3's low-rank MLA) and the two vocabulary
    matrices (norms, biases, sinks and shared experts left out, so the bound never overstates what a model needs)."""
    experts = spec.experts * 3 * spec.hidden * spec.intermediate + spec.experts * spec.hidden
    mla = spec.family == "deepseek_v3"
    attention = 0 if mla else 2 * spec.hidden * spec.head_dim * (spec.heads + spec.kv_heads)
    return itemsize * (layers * (experts + attention) + 2 * vocab * spec.hidden)


def memory_refusal(spec: ModelSpec, layers: int, s: Settings) -> str | None:
    """Why a model is not built on this GPU (its weights alone exceed the free memory), or None.

    The weights are made on the GPU, so a model that cannot fit would otherwise run out of memory while it is built
    (Mixtral-8x7B at its 32 layers holds ~93 GB of bf16: an H200, not an 80 GB H100). Without ``--share-weights``
    every side holds a copy of its own beside the model's (three in all)."""
    import torch

    if s.device != "cuda":
        return None
    copies = 1 if s.share_weights else 3
    need = copies * weight_bytes_at_least(spec, layers, s.vocab, s.dtype.itemsize)
    free, total = torch.cuda.mem_get_info()
    if need <= free:
        return None
    return (f"not built: its weights need at least {need / 1e9:.0f} GB ({copies} cop{'y' if copies == 1 else 'ies'}), "
            f"this GPU has {free / 1e9:.0f} of {total / 1e9:.0f} GB free")


def experts_implementation(model) -> str:
    """The experts implementation transformers chose for ``model`` (``grouped_mm`` by default in 5.x)."""
    return str(getattr(model.config, "_experts_implementation", None))


# ---------------------------------------------------------------------------------------------- timing


def synchronize() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def time_alternating(calls: dict[str, Callable[[], Any]], rounds: int, per_round: int) -> dict[str, dict]:
    """Time each callable ``rounds * per_round`` times, alternating between them round by round.

    The order of the callables rotates every round. Every call starts on an idle, synchronised GPU:
    ``host`` is the time until the call returns, ``wall`` until ``synchronize()`` after it returns.
    Returns ``{name: {"wall_us": median, "host_us": median, "wall_all": [...], "host_all": [...]}}``.
    """
    names = list(calls)
    samples = {n: {"wall": [], "host": []} for n in names}
    for r in range(rounds):
        order = names[r % len(names):] + names[: r % len(names)]
        for name in order:
            fn = calls[name]
            for _ in range(per_round):
                synchronize()
                t0 = time.perf_counter()
                fn()
                t1 = time.perf_counter()
                synchronize()
                t2 = time.perf_counter()
                samples[name]["host"].append((t1 - t0) * 1e6)
                samples[name]["wall"].append((t2 - t0) * 1e6)
    return {
        n: {
            "wall_us": statistics.median(s["wall"]),
            "host_us": statistics.median(s["host"]),
            "wall_spread_us": spread(s["wall"]),
            "samples": len(s["wall"]),
        }
        for n, s in samples.items()
    }


def spread(values: list[float]) -> float:
    """Half the distance between the 25th and the 75th percentile (a robust +- for a median)."""
    if len(values) < 4:
        return 0.0
    q = statistics.quantiles(values, n=4)
    return (q[2] - q[0]) / 2


def moe_kernel(name: str) -> bool:
    """Whether a GPU kernel named ``name`` belongs to moe_fx's MoE layer: one of moe_fx's Triton kernels (the
    ``*_kernel`` functions of :mod:`moe_fx.lowering.triton._kernels`, as Inductor names them, with or without an
    index suffix) or one of DeepGEMM's GEMMs. Inductor's own kernels (``triton_*``) and cuBLAS's are not."""
    return "deep_gemm" in name or any(name == n or name.startswith(n + "_") for n in _moe_kernel_names())


@functools.cache
def _moe_kernel_names() -> tuple[str, ...]:
    from moe_fx.lowering.triton import _kernels

    return tuple(n for n in vars(_kernels) if n.endswith("_kernel"))


TOP_KERNELS = 8  # kernels per side kept in a row's ``top_kernels`` (where the GPU time goes)


def gpu_time_per_call(fn: Callable[[], Any], iters: int) -> dict[str, Any]:
    """What the GPU does in one call of ``fn``, from torch.profiler: :func:`tally_gpu` of the GPU-side
    activities Kineto records (kernels, memcpy, memset) over ``iters`` calls; its numbers are None without
    CUDA."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    if not torch.cuda.is_available():
        return tally_gpu([], 0)
    synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        synchronize()
    return tally_gpu(gpu_activities(prof), iters)


def gpu_activities(prof) -> list[tuple[str, float]]:
    """``(name, ns)`` of every GPU-side activity (kernel, memcpy, memset) a finished torch.profiler run recorded."""
    from torch.autograd import DeviceType

    return [(ev.name(), ev.duration_ns() if hasattr(ev, "duration_ns") else 1e3 * ev.duration_us())
            for ev in prof.profiler.kineto_results.events() if ev.device_type() == DeviceType.CUDA]


def tally_gpu(events: list[tuple[str, float]], iters: int, top: int = TOP_KERNELS) -> dict[str, Any]:
    """Per call, from ``(name, ns)`` GPU activities of ``iters`` calls: ``gpu_us`` (the time the GPU is busy,
    not the wall time), ``kernels`` (activities), ``moe_us`` (the part in what :func:`moe_kernel` names) and
    ``top_kernels``, the ``top`` names with the most GPU time as ``[name, µs, launches]``, names cut at 100
    characters (C++ template names run to thousands). None / [] without events (no CUDA)."""
    if not iters:
        return {"gpu_us": None, "kernels": None, "moe_us": None, "top_kernels": []}
    by_name: dict[str, list[float]] = {}
    for name, ns in events:
        tally = by_name.setdefault(name, [0.0, 0])
        tally[0] += ns
        tally[1] += 1
    ranked = sorted(by_name.items(), key=lambda kv: -kv[1][0])
    return {
        "gpu_us": sum(ns for _, ns in events) / 1e3 / iters,
        "kernels": len(events) / iters,
        "moe_us": sum(ns for name, ns in events if moe_kernel(name)) / 1e3 / iters,
        "top_kernels": [[name[:100], ns / 1e3 / iters, n / iters] for name, (ns, n) in ranked[:top]],
    }


def expected_experts_hit(t: int, e: int, k: int) -> float:
    """Experts one layer's ``t`` tokens hit, each choosing ``k`` of ``e`` uniformly: ``e (1 - (1 - k/e)^t)``."""
    return e * (1 - (1 - k / e) ** t)


def routers_of(model) -> list:
    """``model``'s transformers routers: the modules whose class name ends in ``Router`` (``Qwen3MoeTopKRouter``,
    ``DeepseekV3TopkRouter``, ...)."""
    return [m for m in model.modules() if type(m).__name__.lower().endswith("router")]


@contextlib.contextmanager
def routed_experts_counted(model) -> Iterator[list[int]]:
    """While the block runs, each forward of a router of ``model`` (:func:`routers_of`; it returns a tuple whose
    last item is the top-k expert ids) appends to the yielded list the distinct experts it picked: one count per
    MoE layer and forward, in layer order. Deep models with random weights route far from uniformly (a 48-layer Qwen3-30B-A3B
    hit fewer experts per layer at T=1024 than the uniform count), so the floor counts the experts the tokens
    actually reach."""
    import torch

    hits: list[int] = []

    def record(module, args, output) -> None:
        ids = output[-1] if isinstance(output, tuple) and output else None
        if isinstance(ids, torch.Tensor) and not ids.is_floating_point() and not ids.is_complex():
            hits.append(int(torch.unique(ids).numel()))

    handles = [m.register_forward_hook(record) for m in routers_of(model)]
    try:
        yield hits
    finally:
        for handle in handles:
            handle.remove()


def routed_experts_hit(model, input_ids) -> list[int]:
    """Distinct experts each MoE layer's router picks for ``input_ids`` in one eager forward of ``model``, in layer
    order (:func:`routed_experts_counted`); empty, and no forward, where the model has no router."""
    import torch

    if not routers_of(model):
        return []
    with routed_experts_counted(model) as hits, torch.no_grad():
        forward_call(model, input_ids, "default")()
    return hits


def moe_floor_us(spec: ModelSpec, layers: int, t: int, fp8: bool, limits: dict | None,
                 hits: list[int] | None = None) -> float | None:
    """The roofline floor of one forward's routed-expert layers (:func:`moe_layer.layer_floor`): with ``hits``
    (:func:`routed_experts_hit`), one term per MoE layer with the experts its tokens reached; without, ``layers``
    layers under uniform routing. None without measured limits."""
    if not limits:
        return None
    if hits:
        return sum(layer_floor(t, hit, spec.top_k, spec.hidden, spec.intermediate, fp8, limits)[2] for hit in hits)
    hit = expected_experts_hit(t, spec.experts, spec.top_k)
    return layers * layer_floor(t, hit, spec.top_k, spec.hidden, spec.intermediate, fp8, limits)[2]


def gpu_ceiling(plain: dict, moe: dict, floor_us: float | None) -> float | None:
    """The most moe_fx could gain in GPU time: plain's GPU µs over moe_fx's with its MoE kernels at the floor,
    ``plain_gpu / (moe_gpu - moe_kernels + floor)``; None where a figure is missing (CPU, no MoE kernel seen)."""
    if floor_us is None or not plain.get("gpu_us") or not moe.get("gpu_us") or not moe.get("moe_us"):
        return None
    return plain["gpu_us"] / (moe["gpu_us"] - moe["moe_us"] + floor_us)


# ---------------------------------------------------------------------------------------------- cells


@dataclasses.dataclass
class Settings:
    """What one run measures (from the command line)."""

    device: str
    dtype: Any
    vocab: int
    layers: int | None  # None: each model's full depth
    dynamic: bool
    rounds: int
    per_round: int
    warmup: int
    prof_iters: int
    gen_batch: int
    gen_prompt: int
    gen_new: int
    gen_rounds: int
    weights: str = "bf16"
    share_weights: bool = False
    ab_set: tuple[str, ...] = ()  # --ab-set: generate()'s third compiled side, moe_fx with these constants

    def layers_of(self, spec: ModelSpec) -> int:
        """The decoder layers a model of ``spec`` gets in this run."""
        return spec.depth if self.layers is None else self.layers


def compile_forward(model, backend: str, mode: str, dynamic: bool, weights: str = "bf16") -> Callable:
    """``torch.compile(model, mode=...)`` for ``"plain"``; for ``"moe_fx"``, ``backend="moe_fx"`` on bf16
    weights and ``moe_fx.compile`` (module capture, ``MoEConfig``) for the fp8 kinds of ``--weights``.
    ``model`` may be a module or a bound ``forward``."""
    import torch

    kwargs: dict[str, Any] = {"dynamic": dynamic}
    if mode != "default":
        kwargs["mode"] = mode
    if backend == "moe_fx" and weights == "bf16":
        kwargs["backend"] = "moe_fx"
    elif backend == "moe_fx":
        import moe_fx

        return moe_fx.compile(model, moe_fx_config(weights), **kwargs)
    return torch.compile(model, **kwargs)


def moe_fx_config(weights: str):
    """The ``MoEConfig`` the moe_fx side compiles with for ``--weights`` (None: ``backend="moe_fx"``'s default)."""
    import moe_fx

    return moe_fx.MoEConfig(quantize="fp8" if weights == "quantize_fp8" else None)


def ab_backend(pairs: tuple[str, ...], seen: list[dict[str, object]], model=None, weights: str = "bf16") -> Callable:
    """``backend="moe_fx"`` as an object of its own, for the A/B side: Dynamo keeps compiled frames per backend,
    so the A/B side compiles its own graphs (with its constants in force) instead of reusing moe_fx's. Appends
    to ``seen``, at each compile, the values ``pairs``' constants have then (the record that they were in force).
    For the fp8 kinds of ``--weights`` it is what ``moe_fx.compile`` gives the moe_fx side: the module capture of
    ``model`` (the A/B side's own module tree), then a backend with that side's ``MoEConfig``."""
    from moe_fx.backend import enable_capture, make_backend, moe_fx_backend

    if weights == "bf16":
        inner = moe_fx_backend
    else:
        from moe_fx.capture.steps import capture_modules

        config = moe_fx_config(weights)
        enable_capture()
        capture_modules(model, config)
        inner = make_backend(config, captured=True)

    def moe_fx_ab(gm, example_inputs, **kwargs):
        seen.append(current_settings(list(pairs)))
        return inner(gm, example_inputs, **kwargs)

    return moe_fx_ab


def forward_call(compiled: Callable, input_ids, mode: str) -> Callable[[], Any]:
    """One forward of ``compiled`` on ``input_ids`` (a new CUDA-graph step first in reduce-overhead mode)."""
    import torch

    graphs = mode == "reduce-overhead"

    def call():
        if graphs:
            torch.compiler.cudagraph_mark_step_begin()
        return compiled(input_ids=input_ids, use_cache=False, logits_to_keep=1)

    return call


def forward_target(mode: str, t: int) -> float | None:
    """The issue's speed-up target for a forward row (None where it sets none)."""
    if mode == "default":
        return TARGET_DEFAULT_LARGE if t >= LARGE_T else TARGET_DEFAULT
    if mode == "reduce-overhead" and t >= LARGE_T:
        return TARGET_GRAPHS_LARGE
    return None


def progress(text: str) -> None:
    """A timestamped progress line (compiles at full depth take minutes: the log says where the time goes)."""
    log(f"[{datetime.datetime.now():%H:%M:%S}] {text}")


def compiling_call(fn: Callable[[], Any], label: str) -> dict[str, Any]:
    """Call ``fn`` once (synchronised), logging its start and end: ``{"first_call_s": wall seconds, "compile":
    what Dynamo compiled during the call}`` (:func:`pass_time.compile_split`: tracing, moe_fx passes, Inductor;
    zeros when the call found a compiled graph)."""
    progress(f"{label}: first call (compiles if no graph fits yet)")
    before = compile_metrics()
    synchronize()
    start = time.perf_counter()
    try:
        fn()
        synchronize()
    except Exception as err:
        # the row keeps one line: the log keeps the traceback, and the row says which backend failed
        progress(f"{label}: failed\n{traceback.format_exc()}")
        if hasattr(err, "add_note"):  # Python 3.11+
            err.add_note(f"in {label}")
        raise
    first = time.perf_counter() - start
    split = compile_split(before, compile_metrics())
    if split["backend_calls"]:
        passes = f", moe_fx passes {split['passes_s']:.1f} s" if split["passes_s"] else ""
        restarts = f" ({split['restarts']} Dynamo restart(s): traced again)" if split["restarts"] else ""
        progress(f"{label}: compiled, first call {first:.1f} s: Dynamo tracing {split['tracing_s']:.1f} s{passes}, "
                 f"Inductor {split['inductor_s']:.1f} s, {split['backend_calls']} backend call(s){restarts}")
    else:
        progress(f"{label}: first call {first:.2f} s, nothing compiled")
    return {"first_call_s": first, "compile": split}


def measure_forward(calls: dict[str, Callable], s: Settings, reference: Callable[[], Any] | None = None,
                    label: str = "forward") -> dict:
    """Warm up (compiles; the first call of each backend timed by :func:`compiling_call`), time alternately,
    profile: the per-backend numbers of one forward row; with ``reference`` (the eager model's forward on the
    same tokens), each backend's ``logits_err`` too."""
    import torch

    with torch.no_grad():
        first = {name: compiling_call(fn, f"{label} {name}") for name, fn in calls.items()}
        for fn in calls.values():
            for _ in range(s.warmup - 1):
                fn()
        synchronize()
        timed = time_alternating(calls, s.rounds, s.per_round)
        for name in calls:
            timed[name].update(first[name])
        for name, fn in calls.items():
            timed[name].update(gpu_time_per_call(fn, s.prof_iters))
        if reference is not None:
            want = reference().logits.float()
            for name, fn in calls.items():
                timed[name]["logits_err"] = logits_error(fn().logits.float(), want)
    return timed


def logits_error(got, want) -> float:
    """``max |got - want| / mean |want|``: the worst logit's error against the logits' typical size."""
    return float((got - want).abs().max() / want.abs().mean().clamp_min(1e-30))


def run_cell(row: dict, measure: Callable[[], dict], budget: Budget, errors: tuple, skip: str | None = None) -> dict:
    """``row`` filled with ``measure()``'s numbers, or with the reason it has none.

    ``skip`` (or a spent budget) records the row unmeasured; an error in ``errors`` is recorded in the
    row and the run carries on. ``cell_s`` is the cell's wall time, compiles included.
    """
    if skip or budget.exceeded():
        row["error"] = skip or "skipped: time budget"
        return row
    t0 = time.time()
    try:
        row.update(measure())
    except errors as err:
        row["error"] = error_text(err)
    row["cell_s"] = round(time.time() - t0, 1)
    return row


def forward_row(calls: dict[str, Callable], mode: str, t: int, s: Settings, reference: Callable[[], Any],
                label: str, spec: ModelSpec, layers: int, base_model, limits: dict | None) -> dict:
    """The numbers of one forward row: per-backend times, logit errors against ``reference`` (``base_model``'s
    eager forward on the row's tokens), first-call and compile seconds, speed-up and the issue's target for it;
    the MoE floor (:func:`moe_floor_us`) of the experts each layer's router reached in that reference forward
    (:func:`routed_experts_counted`; uniform routing where no router is seen) and the GPU-time ceiling of the
    speed-up (:func:`gpu_ceiling`)."""
    with routed_experts_counted(base_model) as counted:
        row: dict[str, Any] = measure_forward(calls, s, reference, label)
    hits = counted or None
    row["experts_hit"] = hits
    row["moe_floor_us"] = moe_floor_us(spec, layers, t, s.weights != "bf16", limits, hits)
    row["gpu_ceiling"] = gpu_ceiling(row["plain"], row["moe_fx"], row["moe_floor_us"])
    row["speedup"] = row["plain"]["wall_us"] / row["moe_fx"]["wall_us"]
    row["target"] = forward_target(mode, t)
    row["ok"] = None if row["target"] is None else row["speedup"] >= row["target"]
    return row


def mean_text(values: list[int] | None) -> str:
    """The mean of ``values`` to one decimal, '-' for none."""
    return f"{sum(values) / len(values):.1f}" if values else "-"


def layer_host_cell(model_name: str, spec: ModelSpec, base_model, compiled: dict, t: int, s: Settings) -> dict:
    """The one-layer host-time row: a model with twice the layers is built and compiled next to ``base_model``'s
    default-mode compilations (``compiled[(backend, "default")]``, compiled here if that mode was not run)."""
    import torch

    bigger = build_model(spec, 2 * s.layers, s.vocab, s.device, s.dtype)
    x = torch.randint(3, s.vocab, (1, t), device=s.device)
    calls = {}
    for b in BACKENDS:
        small = compiled.get((b, "default"))
        if small is None:
            small = compile_forward(copy.deepcopy(base_model), b, "default", s.dynamic)
        calls[b] = forward_call(small, x, "default")
        calls[b + "_x2"] = forward_call(compile_forward(copy.deepcopy(bigger), b, "default", s.dynamic), x, "default")
    return layer_host_row(model_name, calls, s.layers, t, s)


def layer_host_row(model_name: str, calls: dict[str, Callable], layers: int, t: int, s: Settings) -> dict:
    """Host and wall time of one decoder layer per backend, from models of ``layers`` and ``2 * layers``.

    ``calls`` maps ``"plain"``, ``"moe_fx"``, ``"plain_x2"``, ``"moe_fx_x2"`` to forwards of the same T.
    """
    import torch

    with torch.no_grad():
        for fn in calls.values():
            for _ in range(s.warmup):
                fn()
        timed = time_alternating(calls, s.rounds, s.per_round)
    row: dict[str, Any] = {"kind": "layer_host", "model": model_name, "T": t, "mode": "default", "layers": layers}
    for b in BACKENDS:
        row[b] = {
            "host_per_layer_us": (timed[b + "_x2"]["host_us"] - timed[b]["host_us"]) / layers,
            "wall_per_layer_us": (timed[b + "_x2"]["wall_us"] - timed[b]["wall_us"]) / layers,
            "host_us": timed[b]["host_us"],
            "host_x2_us": timed[b + "_x2"]["host_us"],
        }
    row["delta_host_us"] = row["moe_fx"]["host_per_layer_us"] - row["plain"]["host_per_layer_us"]
    row["target"] = TARGET_LAYER_HOST_US
    row["ok"] = row["delta_host_us"] <= TARGET_LAYER_HOST_US
    return row


def static_cache(model, batch: int, max_len: int):
    """A ``StaticCache`` for ``model``, allocated now, outside any compiled code.

    Allocated eagerly, its tensors are marked as static addresses (``StaticLayer.lazy_initialization``
    skips that when it runs inside a compiled prefill) and the compiled forward does not recompile when
    the cache goes from uninitialised to initialised. ``reset()`` before each generate() call.
    """
    import transformers

    cfg = model.config
    cache = transformers.StaticCache(config=cfg, max_cache_len=max_len)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    cache.early_initialization(batch, cfg.num_key_value_heads, head_dim, model.dtype, model.device)
    return cache


def cache_kwarg(model) -> str:
    """The name under which forward()/generate() take a cache: ``cache`` (transformers >= 5.2x) or ``past_key_values``."""
    import inspect

    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def generate_row(model_name: str, models: dict[str, Any], s: Settings) -> dict:
    """Greedy generate() with a static cache: eager, plain torch.compile and moe_fx, timed alternately.

    ``models`` maps ``"eager"``, ``"plain"``, ``"moe_fx"`` (and :data:`AB_SIDE` with ``--ab-set``) to model objects
    with the same weights (one object more than once with ``--share-weights``); each compiled side gets its own
    compiled forward (``torch.compile(model.forward, ...)``, transformers' recipe), installed as ``model.forward``
    for its calls. The A/B side is moe_fx compiled and run with ``s.ab_set``'s constants, in the same alternating
    rounds: a lowering switch compared without the drift between two runs.
    """
    import torch

    base = models["eager"]
    g = torch.Generator().manual_seed(1)
    prompts = torch.randint(3, base.config.vocab_size, (s.gen_batch, s.gen_prompt), generator=g).to(s.device)
    mask = torch.ones_like(prompts)
    max_len = s.gen_prompt + s.gen_new
    caches, runs, forwards = {}, {}, {}
    ab_compiles: list[dict[str, object]] = []  # the --ab-set constants as each of the A/B side's compiles saw them
    cache_kw = cache_kwarg(base)  # before any forward is replaced: read from its signature
    for name, model in models.items():
        model.generation_config.disable_compile = True  # eager stays eager; compiled forwards are compiled once
        own = type(model).forward.__get__(model)  # the class's forward: never another side's compiled one
        if name == AB_SIDE:
            forwards[name] = torch.compile(own, backend=ab_backend(s.ab_set, ab_compiles, model, s.weights),
                                           dynamic=s.dynamic)
        else:
            forwards[name] = own if name == "eager" else compile_forward(own, name, "default", s.dynamic, s.weights)
        caches[name] = static_cache(model, s.gen_batch, max_len)

    def run(name: str, new: int):
        caches[name].reset()
        models[name].forward = forwards[name]
        # every call of the A/B side (its compiles happen inside some of them) with its constants, then back
        with settings_applied(list(s.ab_set)) if name == AB_SIDE else contextlib.nullcontext():
            return models[name].generate(
                prompts, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                pad_token_id=0, **{cache_kw: caches[name]},
            )

    with torch.no_grad():
        tokens, warm, outs = {}, {}, {}
        for name in models:  # warm-up: compiles prefill and decode

            def warm_up(name: str = name) -> None:
                for new in (1, s.gen_new):
                    outs[name] = run(name, new)

            first = compiling_call(warm_up, f"generate {model_name} {name} warm-up (prefill and decode)")
            warm[name] = {"warmup_s": first["first_call_s"], "compile": first["compile"]}
            tokens[name] = outs[name][:, s.gen_prompt:].cpu()
        synchronize()
        for name in models:
            runs[name] = {"full": [], "one": []}
        names = list(models)
        for r in range(s.gen_rounds):
            for name in names[r % len(names):] + names[: r % len(names)]:
                for key, new in (("full", s.gen_new), ("one", 1)):
                    synchronize()
                    t0 = time.perf_counter()
                    run(name, new)
                    synchronize()
                    runs[name][key].append(time.perf_counter() - t0)
        # what the GPU does per decode step, beside its wall time: host-bound when the GPU is idle most of it
        steps = {name: decode_step_gpu(functools.partial(run, name), s.gen_new) for name in models if name != "eager"}
    for model in models.values():
        model.__dict__.pop("forward", None)  # the class's forward again
    row: dict[str, Any] = {
        "kind": "generate", "model": model_name, "mode": "default", "batch": s.gen_batch,
        "prompt": s.gen_prompt, "new": s.gen_new,
    }
    for name in models:
        full, one = statistics.median(runs[name]["full"]), statistics.median(runs[name]["one"])
        rate = decode_rate(s.gen_batch, s.gen_new, full, one)
        row[name] = {
            "s_per_call": full,
            "s_per_call_1_new": one,
            "new_tok_s": s.gen_batch * s.gen_new / full,
            "decode_tok_s": rate,
            "same_tokens_as_eager": float((tokens[name] == tokens["eager"]).float().mean()),
            "step_wall_us": s.gen_batch / rate * 1e6 if rate else None,
            **steps.get(name, {}),
            **warm[name],
        }
    plain, mine = row["plain"]["decode_tok_s"], row["moe_fx"]["decode_tok_s"]
    row["speedup"] = mine / plain if plain and mine else None
    if AB_SIDE in models:
        ab = row[AB_SIDE]["decode_tok_s"]
        row["ab_set"] = list(s.ab_set)
        row["ab_compiles"] = ab_compiles
        row["ab_speedup"] = ab / mine if ab and mine else None
    row["target"] = TARGET_GENERATE
    row["ok"] = None if row["speedup"] is None else row["speedup"] >= TARGET_GENERATE
    return row


def decode_step_gpu(generate: Callable[[int], Any], new: int) -> dict[str, float | None]:
    """GPU busy time and GPU activities per decode step, from one profiled ``generate(new)`` call and one
    ``generate(1)`` call (the prefill and the fixed cost cancel): ``step_gpu_us``, ``step_kernels``; None
    without CUDA or with fewer than 2 new tokens."""
    if new < 2:
        return {"step_gpu_us": None, "step_kernels": None}
    full, one = gpu_time_per_call(lambda: generate(new), 1), gpu_time_per_call(lambda: generate(1), 1)
    if full["gpu_us"] is None or one["gpu_us"] is None:
        return {"step_gpu_us": None, "step_kernels": None}
    return {"step_gpu_us": (full["gpu_us"] - one["gpu_us"]) / (new - 1),
            "step_kernels": (full["kernels"] - one["kernels"]) / (new - 1)}


def decode_rate(batch: int, new: int, t_full: float, t_one: float) -> float | None:
    """Decode tokens/s from calls generating ``new`` and 1 token(s); None when the difference is noise (<= 0)."""
    if new < 2 or t_full <= t_one:
        return None
    return batch * (new - 1) / (t_full - t_one)


# ---------------------------------------------------------------------------------------------- the run


def deepgemm_state(disabled: bool) -> str:
    """Whether DeepGEMM can be used in this run, in words (recorded per row)."""
    if disabled:
        return "disabled"
    import importlib.util

    if importlib.util.find_spec("deep_gemm") is None:
        return "not installed"
    import torch  # noqa: F401  (deep_gemm's extension links libc10)

    try:
        import deep_gemm  # noqa: F401
    except (ImportError, OSError) as err:
        return f"import fails: {str(err)[:80]}"
    return "importable"


def explain_kernels(model, input_ids, weights: str = "bf16") -> tuple[str, float]:
    """moe_fx.explain()'s summary for ``model`` (matched regions and the kernels they run) and the seconds its
    passes took (explain traces with Dynamo and runs the passes, no Inductor)."""
    import moe_fx

    config = moe_fx.MoEConfig(quantize="fp8") if weights == "quantize_fp8" else None
    report = moe_fx.explain(model, input_ids=input_ids, config=config, use_cache=False, logits_to_keep=1)
    kernels = sorted({str(r.kernel) for r in report.matched})
    reasons = sorted({f"{k}: {v}" for r in report.matched for k, v in r.kernel_reasons.items()})
    fp8 = sum(bool(r.fp8) for r in report.matched)
    text = f"{len(report.matched)}/{len(report.regions)} regions rewritten ({fp8} with fp8 weights), kernel(s) {kernels}" + (
        f"; not taken: {reasons[:3]}" if reasons else ""
    )
    return text, report.pass_ms / 1e3


def fp8_checkpoint_of(base, share: bool):
    """A copy of ``base`` whose experts are transformers' fine-grained FP8 experts, quantised from ``base``'s
    bf16 experts (:func:`moe_fx.testing.fp8.fp8_experts_like`); ``base``'s experts then get the dequantised
    weights, so that eager ``base`` is what the FP8 model means. ``share``: the copy shares every other
    tensor with ``base`` (no second copy of a full-depth model)."""
    import torch

    from moe_fx.ops import dequantize_blockwise
    from moe_fx.testing.fp8 import fp8_experts_like

    fp8 = tensor_copy(base, share)
    cfg = base.config.get_text_config()
    names = [n for n, m in fp8.named_modules() if n.endswith(".experts") and hasattr(m, "gate_up_proj")]
    for name in names:
        module = fp8.get_submodule(name)
        if getattr(module, "gate_up_proj_bias", None) is not None:
            raise SystemExit(f"--weights fp8_checkpoint: {name} has expert biases, which FP8Experts does not hold")
        quantized = fp8_experts_like(module, cfg)
        fp8.set_submodule(name, quantized)
        with torch.no_grad():
            for proj in ("gate_up_proj", "down_proj"):
                w = getattr(base.get_submodule(name), proj)
                w.copy_(dequantize_blockwise(getattr(quantized, proj), getattr(quantized, f"{proj}_scale_inv")).to(w.dtype))
    if not names:
        raise SystemExit("--weights fp8_checkpoint: the model has no fused experts module")
    return fp8


def tensor_copy(model, share: bool):
    """A new module tree of ``model`` (own forward attributes, so captures stay on one side) that shares
    ``model``'s tensors when ``share``, else a deep copy."""
    import itertools

    memo = {id(t): t for t in itertools.chain(model.parameters(), model.buffers())} if share else {}
    return copy.deepcopy(model, memo)


def side_models(base, s: Settings, input_ids) -> tuple[Any, Any, str]:
    """``(plain source, moe_fx source, what plain runs)`` for ``--weights``; eager ``base`` is the oracle.

    fp8_checkpoint: plain compiles the FP8 model itself where plain torch.compile runs it (transformers'
    FP8 kernels come from the Hub's ``kernels`` package: absent offline), else the dequantised bf16 model.
    """
    import torch

    if s.weights != "fp8_checkpoint":
        return base, base, "the bf16 model"
    fp8 = fp8_checkpoint_of(base, s.share_weights)
    trial = tensor_copy(fp8, share=True)
    try:
        with torch.no_grad():
            torch.compile(trial, dynamic=s.dynamic)(input_ids=input_ids, use_cache=False, logits_to_keep=1)
    except Exception as err:  # noqa: BLE001 - any failure of plain on the FP8 model is the finding itself
        torch._dynamo.reset()
        return base, fp8, f"the dequantised bf16 model (plain torch.compile of the FP8 model: {error_text(err)})"
    return trial, fp8, "the FP8 model"


def weights_fingerprint(model) -> dict[str, tuple]:
    """Storage, version counter, shape and dtype of every parameter and buffer: what a shared model must keep."""
    return {name: (t.data_ptr(), t._version, tuple(t.shape), t.dtype)
            for name, t in [*model.named_parameters(), *model.named_buffers()]}


class Budget:
    """Wall-clock budget of one run: cells that would start after it are recorded as skipped."""

    def __init__(self, seconds: float) -> None:
        self.start = time.time()
        self.seconds = seconds

    def exceeded(self) -> bool:
        return time.time() - self.start > self.seconds

    def elapsed(self) -> float:
        return time.time() - self.start


def cell_errors() -> tuple[type[BaseException], ...]:
    """The errors one cell may raise and the run survives (recorded in the row): torch's, Inductor's, Triton's."""
    errors: list[type[BaseException]] = [RuntimeError, ValueError, TypeError, AssertionError, NotImplementedError]
    try:
        from triton.compiler.errors import CompilationError
        from triton.runtime.errors import OutOfResources

        errors += [CompilationError, OutOfResources]
    except ImportError:
        pass
    return tuple(errors)


def error_text(err: BaseException) -> str:
    """One line for a results row: the exception's type, its first line and its notes (where it happened)."""
    first = str(err).strip().splitlines()[0][:200] if str(err).strip() else ""
    notes = "; ".join(getattr(err, "__notes__", ()))
    return f"{type(err).__name__}: {first}" + (f" ({notes})" if notes else "")


def run_benchmark(args: argparse.Namespace) -> None:
    """Measure every cell of the chosen models, tokens and modes; save after each."""
    import torch
    from tqdm import tqdm

    import moe_fx  # noqa: F401  (registers backend="moe_fx" in a source checkout; after MOE_FX_DISABLE_DEEPGEMM)

    budget = Budget(args.budget_s)
    settings = make_settings(args)
    specs = SMOKE_MODELS if args.smoke else MODELS
    if args.smoke and args.weights != "bf16":  # FP8Experts holds whole 128x128 blocks: 128-multiple sizes
        specs = {n: dataclasses.replace(m, hidden=128, intermediate=128, head_dim=32) for n, m in specs.items()}
    models = args.models.split(",")
    for name in models:
        if name not in specs:
            raise SystemExit(f"unknown model {name!r}; known: {', '.join(specs)}")
    tokens = [int(t) for t in args.tokens.split(",")]
    modes = args.modes.split(",")
    for mode in modes:
        if mode not in ("default", "reduce-overhead"):
            raise SystemExit(f"unknown mode {mode!r}: default or reduce-overhead")
    if args.specialize_float:  # floats become constants: no restart of the whole compile (see the docstring)
        torch._dynamo.config.specialize_float = True
    allow_many_compiles()
    dg = deepgemm_state(args.no_deepgemm)
    # moe_fx constants (--set; --static-launch is one): moe_fx's side only, plain's graphs hold no moe_fx op or
    # user-defined Triton kernel
    settings_set = apply_settings(args.set + (["moe_fx.backend.STATIC_LAUNCH_KERNELS=True"] if args.static_launch else []))
    if args.ab_set:  # a typo or a malformed pair fails now, not after the first compiles
        with settings_applied(args.ab_set):
            pass
    meta = {
        **machine_meta(),
        "smoke": args.smoke,
        "device": settings.device,
        "dtype": str(settings.dtype).replace("torch.", ""),
        "layers": "full" if settings.layers is None else settings.layers,
        "vocab": settings.vocab,
        "dynamic": settings.dynamic,
        "specialize_float": bool(args.specialize_float),
        "static_launch": bool(args.static_launch),
        "settings": settings_set,
        "ab_set": list(args.ab_set),
        "deepgemm": dg,
        # copy and matmul rates, for the MoE floor of each forward row (a few seconds, CUDA only)
        "limits": measure_limits() if settings.device == "cuda" else None,
        "timing": (
            f"{settings.rounds} rounds x {settings.per_round} calls per backend, alternating; "
            f"{settings.warmup} warm-up calls; profiler over {settings.prof_iters} calls"
        ),
        "models": {n: dataclasses.asdict(specs[n]) for n in models},
        "weights": settings.weights,
        "weights_meaning": WEIGHTS[settings.weights],
        "share_weights": settings.share_weights,
        "plain_model": {},
        "explain": {},
        "explain_s": {},
        **({"shared_weights_changed": {}} if settings.share_weights else {}),
    }
    log("meta", json.dumps({k: v for k, v in meta.items() if k != "models"}))
    rows: list[dict] = []
    os.makedirs(args.out, exist_ok=True)
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
    base = os.path.join(args.out, f"e2e_model_{stamp}{'_' + args.tag if args.tag else ''}")
    errors = cell_errors()

    def finish(row: dict) -> None:
        rows.append(row)
        log(summary_line(row))
        bar.update()
        write_results(base, meta, rows, plot_it=False)

    forward_modes = [] if args.no_forward else modes
    cells = len(models) * (len(forward_modes) * len(tokens) + (0 if args.no_layer_host else 1)
                           + (0 if args.no_generate else 1))
    bar = tqdm(total=cells, desc="e2e cells", file=sys.stderr, mininterval=10)
    for model_name in models:
        if budget.exceeded():  # not even built: its rows are absent, the meta says why
            meta.setdefault("models_skipped_for_time", []).append(model_name)
            log(f"{model_name}: skipped, time budget spent")
            continue
        spec = specs[model_name]
        layers = settings.layers_of(spec)
        refusal = memory_refusal(spec, layers, settings)
        if refusal:  # its rows are absent, the meta says why
            meta.setdefault("models_skipped_for_memory", {})[model_name] = refusal
            log(f"{model_name}: {refusal}")
            continue
        tag = {"model": model_name, "deepgemm": dg, "weights": settings.weights}
        base_model = build_model(spec, layers, settings.vocab, settings.device, settings.dtype)
        meta.setdefault("experts_implementation", experts_implementation(base_model))
        ids = {t: torch.randint(3, settings.vocab, (1, t), device=settings.device) for t in tokens}
        plain_src, moe_src, meta["plain_model"][model_name] = side_models(base_model, settings, ids[tokens[0]])

        def side(model):  # one compiled side's own module tree; with --share-weights, on the model's tensors
            return tensor_copy(model, settings.share_weights)

        before = weights_fingerprint(base_model)
        progress(f"explain {model_name}: Dynamo trace + moe_fx passes (no Inductor)")
        start = time.perf_counter()
        try:
            meta["explain"][model_name], passes_s = explain_kernels(side(moe_src), ids[tokens[-1]], settings.weights)
            meta["explain_s"][model_name] = {"wall_s": time.perf_counter() - start, "passes_s": passes_s}
            progress(f"explain {model_name}: {meta['explain_s'][model_name]['wall_s']:.1f} s "
                     f"(passes {passes_s:.1f} s): {meta['explain'][model_name]}")
        except errors as err:
            meta["explain"][model_name] = error_text(err)
            progress(f"explain {model_name}: {meta['explain'][model_name]}")
        compiled: dict[tuple[str, str], Callable] = {}
        for mode in forward_modes:
            for b in BACKENDS:
                src = plain_src if b == "plain" else moe_src
                compiled[(b, mode)] = compile_forward(side(src), b, mode, settings.dynamic, settings.weights)
            for t in tokens:
                bar.set_postfix_str(f"{model_name} {mode} T={t} ({budget.elapsed():.0f}s)")
                calls = {b: forward_call(compiled[(b, mode)], ids[t], mode) for b in BACKENDS}
                eager = forward_call(base_model, ids[t], "default")
                finish(run_cell(
                    {"kind": "forward", **tag, "mode": mode, "T": t, "layers": layers},
                    lambda: forward_row(calls, mode, t, settings, eager, f"{model_name} {mode} T={t}", spec, layers,
                                        base_model, meta["limits"]), budget, errors,
                    skip="needs CUDA" if mode == "reduce-overhead" and settings.device != "cuda" else None,
                ))
        if not args.no_layer_host:
            t = args.layer_host_tokens
            finish(run_cell(
                {"kind": "layer_host", **tag, "T": t, "mode": "default", "layers": layers},
                lambda: layer_host_cell(model_name, spec, base_model, compiled, t, settings), budget, errors,
                skip="--share-weights: the one-layer host cell builds a model of twice the depth"
                if settings.share_weights else (
                    "bf16 weights only" if settings.weights != "bf16" else None),
            ))
        if not args.no_generate:
            finish(run_cell(
                {"kind": "generate", **tag, "mode": "default", "layers": layers},
                lambda: generate_row(model_name, {"eager": base_model, "plain": side(plain_src),
                                                  "moe_fx": side(moe_src),
                                                  **({AB_SIDE: side(moe_src)} if settings.ab_set else {})},
                                     settings),
                budget, errors,
            ))
        if settings.share_weights:
            changed = sorted(k for k, v in weights_fingerprint(base_model).items() if before.get(k) != v)
            meta["shared_weights_changed"][model_name] = changed[:10]
            if changed:
                log(f"{model_name}: the shared model's tensors changed during the run: {changed[:10]}")
        base_model = plain_src = moe_src = compiled = None  # free this model's copies before the next one
        torch._dynamo.reset()
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    bar.close()
    meta["run_s"] = round(budget.elapsed(), 1)
    write_results(base, meta, rows, plot_it=not args.no_plot)
    log(f"done in {budget.elapsed():.0f}s -> {base}.md")


def make_settings(args: argparse.Namespace) -> Settings:
    """Sizes and iteration counts: the full run's on CUDA, tiny ones with ``--smoke``."""
    import torch

    cuda = torch.cuda.is_available() and not args.cpu
    if not cuda and not args.smoke:
        raise SystemExit("bench/e2e_model.py needs a CUDA GPU (or --smoke for a tiny run on CPU)")
    smoke = args.smoke
    return Settings(
        device="cuda" if cuda else "cpu",
        dtype=torch.bfloat16 if cuda else torch.float32,
        vocab=args.vocab if args.vocab else (128 if smoke else 32000),
        layers=None if args.layers == "full" else int(args.layers),
        dynamic=args.dynamic == "true",
        rounds=args.rounds or (2 if smoke else 10),
        per_round=args.per_round or (2 if smoke else 5),
        warmup=3,
        prof_iters=2 if smoke else 5,
        gen_batch=2 if smoke else args.gen_batch,
        gen_prompt=4 if smoke else args.gen_prompt,
        gen_new=3 if smoke else args.gen_new,
        gen_rounds=args.gen_rounds or (1 if smoke else 3),
        weights=args.weights,
        share_weights=args.share_weights or args.layers == "full",
        ab_set=tuple(args.ab_set),
    )


# ---------------------------------------------------------------------------------------------- output


def fmt(x: Any, digits: int = 1) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:.{digits}f}"
    return str(x)


def sci(x: float | None) -> str:
    return "-" if x is None else f"{x:.1e}"


def verdict(row: dict) -> str:
    ok = row.get("ok")
    return "-" if ok is None else ("PASS" if ok else "miss")


def summary_line(row: dict) -> str:
    """One line per row for the log."""
    head = f"{row['kind']:10s} {row['model']:8s} {row.get('mode', ''):15s} T={row.get('T', '-')!s:5s} dg={row['deepgemm']}"
    if "error" in row:
        return f"{head}  {row['error']}"
    if row["kind"] == "forward":
        p, m = row["plain"], row["moe_fx"]
        return (f"{head}  wall {p['wall_us']:.0f} / {m['wall_us']:.0f} µs  x{row['speedup']:.2f} "
                f"(target {fmt(row['target'], 2)}: {verdict(row)})  gpu {fmt(p['gpu_us'], 0)} / {fmt(m['gpu_us'], 0)}  "
                f"ceiling {fmt(row.get('gpu_ceiling'), 2)}  "
                f"host {p['host_us']:.0f} / {m['host_us']:.0f}  first call {fmt(p.get('first_call_s'))} / {fmt(m.get('first_call_s'))} s")
    if row["kind"] == "layer_host":
        return (f"{head}  host/layer plain {row['plain']['host_per_layer_us']:.1f} moe_fx "
                f"{row['moe_fx']['host_per_layer_us']:.1f}  delta {row['delta_host_us']:+.1f} µs ({verdict(row)})")
    return (f"{head}  decode tok/s eager {fmt(row['eager']['decode_tok_s'], 0)} plain {fmt(row['plain']['decode_tok_s'], 0)} "
            f"moe_fx {fmt(row['moe_fx']['decode_tok_s'], 0)}  x{fmt(row['speedup'], 2)} ({verdict(row)})  step wall / GPU µs "
            f"plain {fmt(row['plain'].get('step_wall_us'), 0)} / {fmt(row['plain'].get('step_gpu_us'), 0)} moe_fx "
            f"{fmt(row['moe_fx'].get('step_wall_us'), 0)} / {fmt(row['moe_fx'].get('step_gpu_us'), 0)}"
            + (f"  A/B {fmt(row[AB_SIDE]['decode_tok_s'], 0)} tok/s, x{fmt(row.get('ab_speedup'), 3)} of moe_fx"
               if AB_SIDE in row else ""))


def write_results(base: str, meta: dict, rows: list[dict], plot_it: bool) -> None:
    """``base``.json (meta + rows), ``base``.md (tables), ``base``.png (when ``plot_it`` and matplotlib is there)."""
    with open(base + ".json", "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    with open(base + ".md", "w") as f:
        f.write(markdown(meta, rows))
    if plot_it:
        try:
            plot(base + ".png", meta, rows)
        except ImportError as err:
            log("no plot:", err)


def markdown(meta: dict, rows: list[dict]) -> str:
    """The results as markdown: header, forward, layer-host and generate tables, each with the targets."""
    fw = [r for r in rows if r["kind"] == "forward"]
    lh = [r for r in rows if r["kind"] == "layer_host"]
    gen = [r for r in rows if r["kind"] == "generate"]
    runs = meta.get("merged_from")
    skipped = meta.get("models_skipped_for_time")
    lines = [
        "# Whole models: torch.compile(backend=\"moe_fx\") vs plain torch.compile" + (" (SMOKE: tiny CPU run)" if meta.get("smoke") else ""),
        "",
        f"{meta['date']} · {meta['gpu']} · host {meta.get('host', '?')} ({meta.get('cpus', '?')} CPUs) · torch {meta['torch']} · "
        f"triton {meta['triton']} · transformers {meta['transformers']} · python {meta.get('python', '?')}",
        "",
        f"Command: `{meta.get('command', '?')}`" + (f" (merged: {', '.join(runs)}; commands per run in the JSON)" if runs else ""),
        "",
        f"{meta.get('layers')} decoder layers, {meta.get('dtype')}, random weights, vocabulary reduced to {meta.get('vocab')}, "
        f"experts implementation `{meta.get('experts_implementation')}`, sdpa attention, dynamic={meta.get('dynamic')}"
        f"{', specialize_float' if meta.get('specialize_float') else ''}"
        f"{'; moe_fx launches its Triton kernels statically (--static-launch)' if meta.get('static_launch') else ''}"
        + "".join(f"; `{qualified_setting(n)}` = {v!r}" for n, v in (meta.get("settings") or {}).items()) + "; "
        f"timing: {meta.get('timing')}. DeepGEMM: {meta.get('deepgemm')}.",
        "",
        "wall = one forward from an idle synchronised GPU to the sync after it; host = the same call until it returns "
        "(enqueue time); GPU = profiler sum of GPU activity per forward; kernels = GPU activities per forward; "
        "MoE kernels = the part of moe_fx's GPU time in its MoE kernels (moe_fx's Triton kernels, DeepGEMM's GEMMs); "
        "MoE floor = the routed experts' roofline per forward (the experts each layer's router reached in an eager "
        "forward of the same tokens, their mean per layer in the next column; uniform routing where no router was "
        "seen, '-'; copy and matmul rates measured in the run); GPU ceiling = plain GPU / (moe_fx GPU - MoE kernels + MoE floor), the most moe_fx could gain in "
        "GPU time with its MoE layers at the floor. "
        "Speed-up = plain wall / moe_fx wall. Targets (issues 10 and 16): default >= 1.0x, >= 1.3x at T >= 1024; "
        "reduce-overhead >= 1.5x at T >= 1024.",
        "",
    ]
    no_room = meta.get("models_skipped_for_memory") or {}
    lines.append("Targets met: " + target_summary(rows) + "." + (
        f" Not measured (time budget): {', '.join(skipped)}." if skipped else "") + "".join(
        f" Not measured ({name}): {why}." for name, why in no_room.items()))
    lines.append("")
    lines.append(f"Weights: {meta.get('weights', 'bf16')}: {meta.get('weights_meaning', WEIGHTS['bf16'])}." + (
        " Weights shared: plain and moe_fx run module trees of their own on one model's tensors." if meta.get("share_weights") else ""))
    lines.append("")
    for name, text in meta.get("plain_model", {}).items():
        lines.append(f"- plain runs, {name}: {text}")
    for name, changed in meta.get("shared_weights_changed", {}).items():
        lines.append(f"- shared tensors changed during the run, {name}: {changed or 'none'}")
    for name, text in meta.get("explain", {}).items():
        took = meta.get("explain_s", {}).get(name)
        lines.append(f"- moe_fx.explain, {name}: {text}" + (
            f" (explain took {took['wall_s']:.1f} s, its passes {took['passes_s']:.1f} s)" if took else ""))
    lines += md_table(
        "Forward", "",
        ["model", "weights", "layers", "mode", "DeepGEMM", "T", "plain wall µs", "moe_fx wall µs", "speed-up", "target",
         "", "plain GPU µs", "moe_fx GPU µs", "moe_fx MoE kernels µs", "MoE floor µs", "experts hit / layer", "GPU ceiling",
         "plain host µs", "moe_fx host µs", "kernels plain / moe_fx", "logit err plain / moe_fx"],
        fw, lambda r: [r["model"], r.get("weights", "bf16"), str(r.get("layers", "?")), r["mode"], r["deepgemm"], str(r["T"])],
        lambda r: [
            f"{r['plain']['wall_us']:.0f} ± {r['plain']['wall_spread_us']:.0f}",
            f"{r['moe_fx']['wall_us']:.0f} ± {r['moe_fx']['wall_spread_us']:.0f}",
            f"{r['speedup']:.2f}x", fmt(r["target"], 1), verdict(r),
            fmt(r["plain"]["gpu_us"], 0), fmt(r["moe_fx"]["gpu_us"], 0), fmt(r["moe_fx"].get("moe_us"), 0),
            fmt(r.get("moe_floor_us"), 0), mean_text(r.get("experts_hit")), "-" if r.get("gpu_ceiling") is None else f"{r['gpu_ceiling']:.2f}x",
            f"{r['plain']['host_us']:.0f}", f"{r['moe_fx']['host_us']:.0f}",
            f"{fmt(r['plain']['kernels'], 0)} / {fmt(r['moe_fx']['kernels'], 0)}",
            f"{sci(r['plain'].get('logits_err'))} / {sci(r['moe_fx'].get('logits_err'))}",
        ],
        sort_key=lambda r: (r["model"], r.get("weights", "bf16"), r["mode"], r["deepgemm"], r["T"]),
    )
    lines += kernel_table(fw)
    lines += compile_table(fw, gen)
    lines += md_table(
        "Host time of one MoE decoder layer (default mode)",
        "Per layer = (time of a model with 2L layers - time with L layers) / L, timed alternately; delta = moe_fx - "
        "plain (attention is Inductor's in both). Target: delta <= 40 µs.",
        ["model", "DeepGEMM", "T", "plain host/layer µs", "moe_fx host/layer µs", "delta µs", "target", "",
         "plain wall/layer µs", "moe_fx wall/layer µs"],
        lh, lambda r: [r["model"], r["deepgemm"], str(r["T"])],
        lambda r: [
            f"{r['plain']['host_per_layer_us']:.1f}", f"{r['moe_fx']['host_per_layer_us']:.1f}",
            f"{r['delta_host_us']:+.1f}", "<= 40", verdict(r),
            f"{r['plain']['wall_per_layer_us']:.1f}", f"{r['moe_fx']['wall_per_layer_us']:.1f}",
        ],
        sort_key=lambda r: (r["model"], r["deepgemm"], r["T"]),
    )
    lines += md_table(
        "generate() decode (greedy, static cache, compiled forward, default mode)",
        "decode tok/s = batch * (N - 1) / (t(N new tokens) - t(1 new token)); new tok/s = batch * N / t(N). "
        "Speed-up = moe_fx decode / plain decode; target >= 1.2x. same = fraction of greedy tokens equal to eager's. "
        "step = one decode step: wall µs (from the decode rate) / GPU busy µs / GPU activities (profiler, one "
        "generate(N) call less one generate(1) call); a GPU busy far less than the wall is a host-bound step.",
        ["model", "weights", "layers", "DeepGEMM", "batch x prompt + new", "eager decode tok/s", "plain decode tok/s",
         "moe_fx decode tok/s", "speed-up", "target", "", "new tok/s eager / plain / moe_fx", "same plain / moe_fx",
         "step plain", "step moe_fx"],
        gen, lambda r: [r["model"], r.get("weights", "bf16"), str(r.get("layers", "?")), r["deepgemm"]],
        lambda r: [
            f"{r['batch']} x {r['prompt']} + {r['new']}",
            *(fmt(r[n]["decode_tok_s"], 0) for n in ("eager", "plain", "moe_fx")),
            f"{fmt(r['speedup'], 2)}x", "1.2", verdict(r),
            " / ".join(f"{r[n]['new_tok_s']:.0f}" for n in ("eager", "plain", "moe_fx")),
            f"{r['plain']['same_tokens_as_eager']:.2f} / {r['moe_fx']['same_tokens_as_eager']:.2f}",
            *(" / ".join(fmt(r[n].get(k), 0) for k in ("step_wall_us", "step_gpu_us", "step_kernels"))
              for n in ("plain", "moe_fx")),
        ],
        sort_key=lambda r: (r["model"], r.get("weights", "bf16"), r["deepgemm"]),
    )
    lines += ab_table([r for r in gen if AB_SIDE in r])
    return "\n".join(lines) + "\n"


def ab_table(ab: list[dict]) -> list[str]:
    """The markdown section of generate() rows with an A/B side (``--ab-set``): moe_fx with and without the
    constants, timed in the same rounds."""
    if not ab:
        return []
    return md_table(
        "generate() A/B: moe_fx with --ab-set's constants, in the same alternating rounds",
        "A/B = moe_fx compiled and run with the constants named (each call sets them, then puts them back); "
        "A/B / moe_fx = its decode tok/s over moe_fx's (> 1: the constants are faster). step = wall µs / GPU busy "
        "µs / GPU activities per decode step. compiles = the A/B side's backend calls, each of which saw the "
        "constants (recorded by its backend).",
        ["model", "layers", "DeepGEMM", "batch x prompt + new", "constants", "plain decode tok/s",
         "moe_fx decode tok/s", "A/B decode tok/s", "A/B / moe_fx", "A/B / plain", "step moe_fx", "step A/B",
         "warm-up s moe_fx / A/B", "compiles"],
        ab, lambda r: [r["model"], str(r.get("layers", "?")), r["deepgemm"]],
        lambda r: [
            f"{r['batch']} x {r['prompt']} + {r['new']}", ", ".join(f"`{c}`" for c in r["ab_set"]),
            *(fmt(r[n]["decode_tok_s"], 0) for n in ("plain", "moe_fx", AB_SIDE)),
            f"{fmt(r.get('ab_speedup'), 3)}x",
            f"{fmt(_ratio(r[AB_SIDE]['decode_tok_s'], r['plain']['decode_tok_s']), 2)}x",
            *(" / ".join(fmt(r[n].get(k), 0) for k in ("step_wall_us", "step_gpu_us", "step_kernels"))
              for n in ("moe_fx", AB_SIDE)),
            f"{fmt(r['moe_fx'].get('warmup_s'))} / {fmt(r[AB_SIDE].get('warmup_s'))}",
            str(len(r.get("ab_compiles", []))),
        ],
        sort_key=lambda r: (r["model"], r["deepgemm"]),
    )


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


KERNELS_SHOWN = 5  # of a row's top_kernels, the ones the markdown lists


def kernel_table(fw: list[dict]) -> list[str]:
    """The markdown section of where each forward row's GPU time goes: per side, the kernels with the most
    GPU time per forward (rows recorded without ``top_kernels``, such as CPU runs, are left out)."""
    rows = [dict(r, side=b) for r in fw if "error" not in r for b in BACKENDS if r[b].get("top_kernels")]
    if not rows:
        return []
    return md_table(
        "Where the GPU time goes",
        f"Per forward, the {KERNELS_SHOWN} GPU activities with the most time on each side (profiler, the forward "
        "table's calls): name (cut at 60 characters) µs x launches per forward. It shows where the two sides "
        "differ outside the experts (attention, norms, the LM head), which the ceiling assumes equal.",
        ["model", "weights", "layers", "mode", "DeepGEMM", "T", "side", "GPU µs", "top kernels"],
        rows, lambda r: [r["model"], r.get("weights", "bf16"), str(r.get("layers", "?")), r["mode"], r["deepgemm"],
                         str(r["T"]), r["side"]],
        lambda r: [fmt(r[r["side"]]["gpu_us"], 0), "; ".join(
            f"`{name[:60]}` {us:.0f} x {n:g}" for name, us, n in r[r["side"]]["top_kernels"][:KERNELS_SHOWN])],
        sort_key=lambda r: (r["model"], r.get("weights", "bf16"), r["mode"], r["deepgemm"], r["T"], r["side"]),
    )


def compile_table(fw: list[dict], gen: list[dict]) -> list[str]:
    """The markdown section of compile times: the forward rows whose first call compiled on either side, and
    the generate rows' warm-ups (rows of runs before these fields were recorded are left out)."""
    timed = [r for r in fw if "error" not in r and "compile" in r["plain"] and
             (r["plain"]["compile"]["backend_calls"] or r["moe_fx"]["compile"]["backend_calls"])]
    timed += [r for r in gen if "error" not in r and "compile" in r["plain"]]
    if not timed:
        return []

    def first(r: dict, b: str) -> float:
        return r[b]["first_call_s"] if r["kind"] == "forward" else r[b]["warmup_s"]

    def ratio(r: dict) -> str:
        # a side that compiled nothing for the row (its dynamic graph ran the new T) has no compile time to divide by
        if not r["plain"]["compile"]["backend_calls"]:
            return "plain compiled nothing"
        return f"{first(r, 'moe_fx') / first(r, 'plain'):.2f}x"

    return md_table(
        "Compile time",
        "first call = the wall seconds of the row's first call (forward) or of its warm-up generate() calls: "
        "Dynamo tracing + the backend + one run; split from `torch._dynamo.utils.compile_times()`: tracing = "
        "Dynamo minus the backend, passes = the moe_fx passes (`moe_fx_passes`), Inductor = the backend minus "
        "the passes; a restart = Dynamo traced the frame again and handed its graph to the backend again. Only "
        "rows where something compiled (a new graph or shape); under dynamic=True moe_fx compiles one graph per "
        "row regime (docs/lowering.md), where plain's first graph may run the new T. Plain compiles first in the "
        "process and pays its one-time costs (Inductor's imports, cache keys, compiler checks: seconds), so a small model's "
        "ratio favours moe_fx; at depth the per-layer work dominates.",
        ["model", "weights", "layers", "mode", "DeepGEMM", "T", "plain first call s", "moe_fx first call s",
         "moe_fx / plain", "plain tracing / Inductor s", "moe_fx tracing / passes / Inductor s",
         "backend calls (restarts) plain / moe_fx"],
        timed, lambda r: [r["model"], r.get("weights", "bf16"), str(r.get("layers", "?")), r["mode"], r["deepgemm"],
                          str(r["T"]) if r["kind"] == "forward" else "generate"],
        lambda r: [
            f"{first(r, 'plain'):.1f}", f"{first(r, 'moe_fx'):.1f}", ratio(r),
            f"{r['plain']['compile']['tracing_s']:.1f} / {r['plain']['compile']['inductor_s']:.1f}",
            " / ".join(f"{r['moe_fx']['compile'][k]:.1f}" for k in ("tracing_s", "passes_s", "inductor_s")),
            " / ".join(f"{r[b]['compile']['backend_calls']} ({r[b]['compile']['restarts']})" for b in BACKENDS),
        ],
        sort_key=lambda r: (r["model"], r.get("weights", "bf16"), r["mode"], r["deepgemm"], r["kind"], r.get("T", 0)),
    )


def target_summary(rows: list[dict]) -> str:
    """How many measured rows with a target meet it, per kind of row (and mode for forwards)."""
    groups: dict[str, list[bool]] = {}
    for r in rows:
        if r.get("ok") is not None:
            groups.setdefault(f"{r['kind']} {r['mode']}" if r["kind"] == "forward" else r["kind"], []).append(r["ok"])
    return "; ".join(f"{name} {sum(oks)}/{len(oks)}" for name, oks in groups.items()) or "no measured row has a target"


def md_table(title: str, note: str, header: list[str], rows: list[dict], head: Callable[[dict], list[str]],
             body: Callable[[dict], list[str]], sort_key: Callable[[dict], Any]) -> list[str]:
    """A markdown section: ``## title``, ``note``, then one table line per row (``head(row) + body(row)``,
    or ``head(row)`` and the row's error where it has no numbers)."""
    lines = ["", f"## {title}", ""] + ([note, ""] if note else [])
    lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r in sorted(rows, key=sort_key):
        cells = head(r)
        cells += [r["error"]] + [""] * (len(header) - len(cells) - 1) if "error" in r else body(r)
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def plot(path: str, meta: dict, rows: list[dict]) -> None:
    """Speed-up against T per model (top; one line per mode and DeepGEMM state, targets dashed), and the
    default mode's wall and GPU times of both backends (bottom)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fw = [r for r in rows if r["kind"] == "forward" and "error" not in r]
    models = list(dict.fromkeys(r["model"] for r in fw))
    if not models:
        return
    fig, axes = plt.subplots(2, len(models), figsize=(max(8.0, 5.5 * len(models)), 8), squeeze=False)
    for col, model in enumerate(models):
        ax = axes[0][col]
        for (mode, dg) in dict.fromkeys((r["mode"], r["deepgemm"]) for r in fw if r["model"] == model):
            pts = sorted((r["T"], r["speedup"]) for r in fw if (r["model"], r["mode"], r["deepgemm"]) == (model, mode, dg))
            ax.plot(*zip(*pts), marker="o", ms=3, label=f"{mode}, DeepGEMM {dg}")
        ax.axhline(1.0, color="k", lw=0.8)
        ax.plot([LARGE_T, max(LARGE_T, max(r["T"] for r in fw))], [TARGET_DEFAULT_LARGE] * 2, "k--", lw=0.8,
                 label="target default (T>=1024)")
        ax.plot([LARGE_T, max(LARGE_T, max(r["T"] for r in fw))], [TARGET_GRAPHS_LARGE] * 2, "k:", lw=0.8,
                 label="target reduce-overhead (T>=1024)")
        ax.set_xscale("log", base=2)
        ax.set_title(f"{model}: moe_fx speed-up over plain torch.compile")
        ax.set_xlabel("tokens T")
        ax.set_ylabel("plain wall / moe_fx wall")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        ax = axes[1][col]
        for dg in dict.fromkeys(r["deepgemm"] for r in fw if r["model"] == model):
            sel = sorted((r for r in fw if r["model"] == model and r["mode"] == "default" and r["deepgemm"] == dg),
                         key=lambda r: r["T"])
            if not sel:
                continue
            ts = [r["T"] for r in sel]
            for b, style in (("plain", "--"), ("moe_fx", "-")):
                ax.plot(ts, [r[b]["wall_us"] for r in sel], style, marker="o", ms=3, label=f"{b} wall (DG {dg})")
                if all(r[b]["gpu_us"] is not None for r in sel):
                    ax.plot(ts, [r[b]["gpu_us"] for r in sel], style, marker="x", ms=4, alpha=0.6,
                            label=f"{b} GPU (DG {dg})")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(f"{model}: default mode, wall and GPU time per forward")
        ax.set_xlabel("tokens T")
        ax.set_ylabel("µs")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"{meta.get('layers')}-layer models, {meta['gpu']}, torch {meta['torch']}, "
                 f"transformers {meta['transformers']} ({meta['date'][:10]})", fontsize=10)
    fig.tight_layout(rect=(0, 0, 1, 0.96))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def row_key(row: dict) -> tuple:
    """What identifies a measurement across runs (a later run's row replaces an earlier one's)."""
    return (row["kind"], row["model"], row.get("mode"), row.get("T"), row["deepgemm"], row.get("weights", "bf16"))


def load_runs(paths: list[str], key: Callable[[dict], Any], same: tuple[str, ...]) -> tuple[list[dict], dict]:
    """The metas and the rows (by ``key(row)``, a later file's row replacing an earlier one's) of results JSON
    files; SystemExit if the runs differ in any meta field of ``same``."""
    metas, by_key = [], {}
    for path in paths:
        with open(path) as f:
            data = json.load(f)
        metas.append(data["meta"])
        for row in data["rows"]:
            by_key[key(row)] = {**row, "run": os.path.basename(path)}
    for field in same:
        values = {json.dumps(m.get(field)) for m in metas}
        if len(values) != 1:
            raise SystemExit(f"--merge: runs differ in {field}: {sorted(values)}")
    return metas, by_key


def merge_runs(paths: list[str], out_dir: str, tag: str, plot_it: bool) -> str:
    """Join the rows of several runs of this script (same GPU and versions) into one md/json/png."""
    metas, by_key = load_runs(paths, row_key, ("gpu", "torch", "triton", "transformers", "layers", "vocab", "dynamic"))
    meta = dict(metas[0])
    meta["merged_from"] = [os.path.basename(p) for p in paths]
    meta["commands"] = [m.get("command") for m in metas]
    meta["deepgemm"] = ", ".join(sorted({m.get("deepgemm", "?") for m in metas}))
    meta["explain"] = {f"{n} (DeepGEMM {m.get('deepgemm')})": v for m in metas for n, v in m.get("explain", {}).items()}
    meta["models"] = {n: s for m in metas for n, s in m.get("models", {}).items()}
    os.makedirs(out_dir, exist_ok=True)
    base = os.path.join(out_dir, f"e2e_model_{meta['date'][:10]}{'_' + tag if tag else ''}")
    write_results(base, meta, list(by_key.values()), plot_it=plot_it)
    log(f"merged {len(by_key)} rows -> {base}.md")
    return base


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default=None, help=f"comma list of {', '.join(MODELS)} (default: all)")
    ap.add_argument("--tokens", default=None, help="comma list of T (default 1,16,256,1024,4096; smoke 1,8)")
    ap.add_argument("--modes", default=None, help="default,reduce-overhead (default: both; smoke: default)")
    ap.add_argument("--no-deepgemm", action="store_true", help="set MOE_FX_DISABLE_DEEPGEMM=1 (moe_fx runs Triton)")
    ap.add_argument("--dynamic", choices=["true", "false"], default="true",
                    help="torch.compile(dynamic=...) for both backends (default true: one compile for all T >= 2)")
    ap.add_argument("--specialize-float", action="store_true",
                    help="torch._dynamo.config.specialize_float = True for both sides (no restart of a dynamic compile)")
    ap.add_argument("--layers", default="2",
                    help="decoder layers per model, or 'full' for the released depth (implies --share-weights)")
    ap.add_argument("--weights", choices=sorted(WEIGHTS), default="bf16",
                    help="expert weights: " + "; ".join(f"{k}: {v}" for k, v in WEIGHTS.items()))
    ap.add_argument("--share-weights", action="store_true",
                    help="plain and moe_fx run module trees of their own on the one model's tensors (no copy of "
                         "the weights; checked unchanged at the end); skips the layer-host cell")
    ap.add_argument("--vocab", type=int, default=0, help="vocabulary size (default 32000; smoke 128)")
    ap.add_argument("--rounds", type=int, default=0, help="alternating rounds per cell (default 10; smoke 2)")
    ap.add_argument("--per-round", type=int, default=0, help="calls per backend per round (default 5; smoke 2)")
    ap.add_argument("--layer-host-tokens", type=int, default=16, help="T of the one-layer host-time cell")
    ap.add_argument("--no-layer-host", action="store_true", help="skip the one-layer host-time cell")
    ap.add_argument("--no-generate", action="store_true", help="skip the generate() cell")
    ap.add_argument("--static-launch", action="store_true",
                    help="moe_fx.backend.STATIC_LAUNCH_KERNELS = True: Inductor's static launcher for moe_fx's Triton "
                         "kernels (less host time per launch; compare a run without it)")
    ap.add_argument("--set", action="append", default=[], metavar="MODULE.ATTR=VALUE",
                    help="a moe_fx constant for the whole run (moe_fx's side): a module under moe_fx.lowering, e.g. "
                         "masked_experts.pipeline.SLOT_ROWS_MAX_TOKENS=4, or a full moe_fx module name, e.g. "
                         "moe_fx.backend.STATIC_LAUNCH_KERNELS=True (repeatable)")
    ap.add_argument("--ab-set", action="append", default=[], metavar="MODULE.ATTR=VALUE",
                    help="generate() gets a third compiled side, moe_fx with this constant (--set's names; "
                         "repeatable: all of them on that side), timed in the same alternating rounds as plain and "
                         "moe_fx: an A/B of a lowering switch without the drift between runs (bf16 weights)")
    ap.add_argument("--no-forward", action="store_true",
                    help="skip the forward cells (--tokens then only feeds explain: a generate()-only run, such as "
                         "a full-depth model whose four compiles would not fit one call otherwise)")
    ap.add_argument("--gen-batch", type=int, default=4)
    ap.add_argument("--gen-prompt", type=int, default=32)
    ap.add_argument("--gen-new", type=int, default=64)
    ap.add_argument("--gen-rounds", type=int, default=0, help="generate() calls of each size per side (default 3; smoke 1)")
    ap.add_argument("--budget-s", type=float, default=1e9, help="start no new cell after this many seconds")
    ap.add_argument("--out", default=None, help="results folder (default bench/results; smoke: a temp folder)")
    ap.add_argument("--tag", default="", help="suffix of the output file names")
    ap.add_argument("--no-plot", action="store_true")
    ap.add_argument("--smoke", action="store_true", help="tiny models (H=64, E=8), T=1,8, few iterations; runs on CPU")
    ap.add_argument("--cpu", action="store_true", help="with --smoke: stay on CPU even if CUDA is there")
    ap.add_argument("--merge", nargs="+", metavar="JSON", help="join earlier runs' JSON files into one md/json/png")
    args = ap.parse_args(argv)
    args.out = args.out or (os.path.join(tempfile.gettempdir(), "moe_fx_smoke") if args.smoke else os.path.join(HERE, "results"))
    args.models = args.models or ("qwen3" if args.smoke else ",".join(MODELS))
    args.tokens = args.tokens or ("1,8" if args.smoke else "1,16,256,1024,4096")
    args.modes = args.modes or ("default" if args.smoke else "default,reduce-overhead")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.merge:
        merge_runs(args.merge, args.out, args.tag, plot_it=not args.no_plot)
        return
    if args.no_deepgemm:  # read by moe_fx when it first probes the kernels: set it before anything compiles
        os.environ["MOE_FX_DISABLE_DEEPGEMM"] = "1"
    run_benchmark(args)


if __name__ == "__main__":
    main()
