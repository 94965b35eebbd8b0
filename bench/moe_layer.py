"""One MoE layer on one GPU: transformers' experts implementations vs moe_fx's Triton kernels (bf16, fp8).

For each shape (Mixtral-8x7B, Qwen3-30B-A3B, a DeepSeek-V3 EP-8 shard) and token count T, times:

* ``hf_eager``, ``hf_grouped_mm``, ``hf_batched_mm``: transformers' experts module of that model
  (``config._experts_implementation`` set), random bf16 weights at real size, under plain
  ``torch.compile`` (``--no-compile-hf`` times them uncompiled);
* ``moe_fx_bf16``, ``moe_fx_fp8``: ``torch.ops.moe_fx.experts(kernel_choice="triton")`` under ``torch.compile``
  (as in a rewritten model: Inductor's generated code launches the kernels) with the bf16 weights,
  and with the same weights quantised once to fp8 128x128 blocks;
* with ``--deepgemm`` and ``deep_gemm`` importable: the same with ``kernel_choice="deepgemm"``.

Decode rows (T <= 256) are timed as plain calls and as CUDA-graph replays (``*_graph`` columns;
an implementation that cannot be captured, e.g. one that synchronises with the host, gets none). Rows with
T <= 16 are also timed in ``chain`` mode: one CUDA graph of ``--chain-layers`` calls on as many routing sets, the
way consecutive MoE layers sit in a model's graph, reported per call; a one-call graph's replay also pays the
graph's launch, which a model pays once for all its layers.
Inputs rotate over several routing/activation sets so caches do not flatter small cases. Times are
medians (``triton.testing.do_bench``). The same run measures the H200 limits: a large device copy
(TB/s, read + write), an 8192^3 bf16 matmul and an 8192^3 fp8 ``torch._scaled_mm`` (TFLOP/s).

Per row: time (µs), achieved TB/s (experts hit, hidden in and out, each moved once), TFLOP/s, the
floor ``max(bytes / copy rate, flops / matmul rate)`` and the fraction of it reached.

    python bench/moe_layer.py [--shapes mixtral,qwen3,dsv3] [--tokens 1,8,...] [--out DIR] [--deepgemm]

Writes ``moe_layer_<date>.{md,json,png}`` to ``--out`` (default bench/results), incrementally.
A failure in one cell is printed and recorded, and the run carries on.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import json
import math
import os
import platform
import sys
import time
import traceback
import types
from collections.abc import Iterator

import torch

SHAPES = {  # name: (transformers family, E, K, H, I)
    "mixtral": ("mixtral", 8, 2, 4096, 14336),
    "qwen3": ("qwen3_moe", 128, 8, 2048, 768),
    "dsv3": ("deepseek_v3", 32, 8, 7168, 2048),
    # GPT-OSS-sized (E=32, K=4, H=2880, I=2880): biases, interleaved gate/up, clamped SwiGLU with alpha
    # and up + 1 (timed against transformers' eager loop only: its grouped_mm path transposes the
    # weights inside the model's experts module, compared whole in bench/e2e_model.py)
    "gpt_oss": ("gpt_oss", 32, 4, 2880, 2880),
    # OLMoE-1B-7B: its experts have Qwen3-MoE's form (SwiGLU, gate and up halves, no biases)
    "olmoe": ("qwen3_moe", 64, 8, 2048, 1024),
}
#: Per family, the op's extra arguments (activation spec; biases are made per shape) and the transformers
#: experts implementations that exist for it.
GPT_OSS_ACT = {"gate_up_layout": "interleaved", "alpha": 1.702, "limit": 7.0, "up_offset": 1.0}
FAMILY_IMPLS = {"gpt_oss": ("eager",)}
TOKENS = (1, 8, 64, 256, 1024, 4096, 16384)
HF_IMPLS = ("eager", "grouped_mm", "batched_mm")
ROTATE = 4
#: Calls in a chain-mode graph (one routing set each), and the seed offset that keeps their sets apart from the
#: rotating ones of the same T.
CHAIN_LAYERS = 8
CHAIN_SEED = 7919
CELL_ERRORS: tuple = (RuntimeError,)


def log(*a) -> None:
    print(*a, flush=True)


def machine_meta() -> dict:
    """Date, host, GPU, library versions and the command line of this run (the header of every results file)."""
    import transformers

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = "not installed"
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "none (CPU)",
        "torch": torch.__version__,
        "triton": triton_version,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "command": " ".join(["python"] + sys.argv),
    }


def bench_meta(device: str = "cuda", smoke: bool = False) -> dict:
    """:func:`machine_meta` with the copy and matmul limits measured now (``None`` off CUDA) and the smoke flag:
    the header of a one-layer benchmark's results."""
    meta = machine_meta()
    meta["limits"] = measure_limits() if device == "cuda" else None
    meta["smoke"] = smoke
    return meta


def results_stem(name: str, tag: str = "") -> str:
    """``<name>_<date>[_<tag>]``: the file name (without suffix) of a benchmark's results."""
    return f"{name}_{datetime.date.today().isoformat()}" + (f"_{tag}" if tag else "")


def qualified_setting(name: str) -> str:
    """A ``--set`` name (a module, or ``module.ATTR``) with its module in full: a name that starts with ``moe_fx.``
    as given (``moe_fx.backend.STATIC_LAUNCH_KERNELS``), any other under ``moe_fx.lowering``
    (``masked_experts.pipeline.SLOT_ROWS_MAX_TOKENS`` -> ``moe_fx.lowering.masked_experts.pipeline....``)."""
    return name if name == "moe_fx" or name.startswith("moe_fx.") else f"moe_fx.lowering.{name}"


def setting_target(name: str) -> tuple[types.ModuleType, str]:
    """``(module, attr)`` of a ``--set`` name ``module.ATTR`` (:func:`qualified_setting`); raises ``ValueError``
    for a name without a module and ``AttributeError`` for a constant the module does not have (a typo must not
    run the defaults under another name)."""
    import importlib

    if "." not in name:
        raise ValueError(f"--set wants module.ATTR=value (module under moe_fx.lowering or moe_fx...), got {name!r}")
    path, attr = name.strip().rsplit(".", 1)
    module_name = qualified_setting(path)
    module = importlib.import_module(module_name)
    if not hasattr(module, attr):
        raise AttributeError(f"--set: {module_name} has no {attr}")
    return module, attr


def apply_settings(pairs: list[str]) -> dict[str, object]:
    """Set ``module.ATTR=value`` (a module under ``moe_fx.lowering``, or a full ``moe_fx...`` module name:
    :func:`qualified_setting`; a Python literal) for each of ``pairs``; returns ``{name: value}`` as set, each name
    as given. Raises ``ValueError`` for a malformed pair and ``AttributeError`` for a
    constant the module does not have (a typo must not run the defaults under another name)."""
    import ast

    settings = {}
    for pair in pairs:
        name, sep, text = pair.partition("=")
        if not sep:
            raise ValueError(f"--set wants module.ATTR=value (module under moe_fx.lowering or moe_fx...), got {pair!r}")
        module, attr = setting_target(name)
        value = ast.literal_eval(text.strip())
        setattr(module, attr, value)
        settings[name.strip()] = value
    return settings


def current_settings(pairs: list[str]) -> dict[str, object]:
    """The values the constants named by ``pairs`` (``module.ATTR=value`` or just ``module.ATTR``) have now,
    ``{name: value}`` with each name as given."""
    out = {}
    for pair in pairs:
        name = pair.partition("=")[0].strip()
        module, attr = setting_target(name)
        out[name] = getattr(module, attr)
    return out


@contextlib.contextmanager
def settings_applied(pairs: list[str]) -> Iterator[dict[str, object]]:
    """:func:`apply_settings` for the body of a ``with``, then every named constant back to the value it had
    (also when the body raises): one side of an in-process A/B runs with a switch while the others keep theirs."""
    before = current_settings(pairs)  # validates every name before anything changes
    try:
        yield apply_settings(pairs)
    finally:
        for name, value in before.items():
            setattr(*setting_target(name), value)


def bench_us(fn, warmup: int = 3, rep_ms: float = 30.0) -> float:
    from triton.testing import do_bench

    return do_bench(fn, warmup=warmup, rep=rep_ms, return_mode="median") * 1e3


def measure_limits() -> dict:
    n = 1 << 30  # 1 GiB copy
    src = torch.empty(n, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    us = bench_us(lambda: dst.copy_(src), warmup=5, rep_ms=100)
    copy_tbs = 2 * n / us / 1e6
    m = 8192
    a = torch.randn(m, m, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(m, m, device="cuda", dtype=torch.bfloat16)
    bf16 = 2 * m**3 / bench_us(lambda: a @ b, warmup=5, rep_ms=200) / 1e6
    a8 = a.to(torch.float8_e4m3fn)
    b8 = b.to(torch.float8_e4m3fn).t().contiguous().t()
    one = torch.ones((), device="cuda")
    fp8 = 2 * m**3 / bench_us(lambda: torch._scaled_mm(a8, b8, one, one, out_dtype=torch.bfloat16), 5, 200) / 1e6
    return {"copy_tbs": copy_tbs, "bf16_tflops": bf16, "fp8_tflops": fp8}


def hf_experts_module(family: str, e: int, k: int, h: int, i: int, impl: str, weights):
    """transformers' experts module of ``family`` at real size, sharing ``weights`` (gate_up, down)."""
    import transformers

    if family == "mixtral":
        cfg = transformers.MixtralConfig(
            hidden_size=h, intermediate_size=i, num_local_experts=e, num_experts_per_tok=k, num_hidden_layers=1
        )
        from transformers.models.mixtral.modeling_mixtral import MixtralExperts as cls
    elif family == "qwen3_moe":
        cfg = transformers.Qwen3MoeConfig(
            hidden_size=h, moe_intermediate_size=i, num_experts=e, num_experts_per_tok=k, num_hidden_layers=1
        )
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts as cls
    elif family == "gpt_oss":
        cfg = transformers.GptOssConfig(
            hidden_size=h, intermediate_size=i, num_local_experts=e, num_experts_per_tok=k, num_hidden_layers=1
        )
        from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts as cls
    else:
        cfg = transformers.DeepseekV3Config(
            hidden_size=h, moe_intermediate_size=i, n_routed_experts=e, num_experts_per_tok=k, num_hidden_layers=1
        )
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Experts as cls
    cfg._experts_implementation = impl
    with torch.device("meta"):
        mod = cls(cfg)
    if family == "gpt_oss":  # [E, H, 2I] / [E, I, H] stored for x @ w; views of the op's weights, no copy
        mod.gate_up_proj = torch.nn.Parameter(weights[0].transpose(1, 2), requires_grad=False)
        mod.down_proj = torch.nn.Parameter(weights[1].transpose(1, 2), requires_grad=False)
        mod.gate_up_proj_bias = torch.nn.Parameter(weights[2], requires_grad=False)
        mod.down_proj_bias = torch.nn.Parameter(weights[3], requires_grad=False)
        return mod.eval()
    mod.gate_up_proj = torch.nn.Parameter(weights[0], requires_grad=False)
    mod.down_proj = torch.nn.Parameter(weights[1], requires_grad=False)
    return mod.eval()


def routing_sets(t: int, e: int, k: int, h: int, n: int, seed: int = 0, device: str = "cuda"):
    """``n`` independent (hidden, ids, weights) sets; uniform top-k of random scores, softmax weights."""
    g = torch.Generator(device=device).manual_seed(seed)
    out = []
    for _ in range(n):
        hidden = torch.randn(t, h, device=device, generator=g, dtype=torch.bfloat16)
        scores = torch.randn(t, e, device=device, generator=g)
        w, ids = scores.softmax(-1).topk(k, dim=-1)
        out.append((hidden, ids, (w / w.sum(-1, keepdim=True)).to(torch.bfloat16)))
    return out


def time_rotating(fn, sets) -> float:
    """Median µs of fn(*set) over rotating input sets (one do_bench call cycles through them)."""
    state = {"i": 0}

    def step():
        s = sets[state["i"] % len(sets)]
        state["i"] += 1
        fn(*s)

    return bench_us(step)


def warm_up(fn, sets) -> None:
    """``fn`` once on every set, on a side stream, before a capture: its compiles and first allocations stay out of
    the graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for s in sets:
            fn(*s)
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()


def capture_graphs(fn, sets) -> tuple[list, list]:
    """CUDA graphs of ``fn`` on each input set (warmed up outside the capture, one memory pool) and the
    outputs each graph writes.

    The pool is shared, so a later graph may place its output where an earlier graph keeps temporaries:
    ``outs[s]`` holds set s's result only right after ``graphs[s]`` replays (:func:`replayed_outputs`).
    """
    graphs, outs = [], []
    warm_up(fn, sets)
    pool = torch.cuda.graph_pool_handle()
    for s in sets:
        gr = torch.cuda.CUDAGraph()
        with torch.cuda.graph(gr, pool=pool):
            outs.append(fn(*s))
        graphs.append(gr)
    return graphs, outs


def replayed_outputs(graphs: list, outs: list) -> list:
    """Each graph's output read right after its own replay (copies), for comparisons after timing."""
    got = []
    for gr, out in zip(graphs, outs):
        gr.replay()
        got.append(out.clone())
    return got


def replay_us(graphs: list) -> float:
    """Median µs of one replay, the graphs replayed in rotation."""
    state = {"i": 0}

    def step():
        graphs[state["i"] % len(graphs)].replay()
        state["i"] += 1

    return bench_us(step)


def time_graph(fn, sets) -> float:
    """Median µs of CUDA-graph replays, one graph per input set, replayed in rotation."""
    return replay_us(capture_graphs(fn, sets)[0])


def capture_chain(fn, sets):
    """One CUDA graph of ``fn`` called on every input set in turn (warmed up outside the capture), as a model's
    graph holds its MoE layers one after another; its replay times ``len(sets)`` calls and one graph launch."""
    warm_up(fn, sets)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for s in sets:
            fn(*s)
    return graph


def time_graph_chain(fn, sets) -> float:
    """Median µs per call of a :func:`capture_chain` graph's replays. Every call reads the same weights (a model's
    layers have their own), so an expert two consecutive routing sets share may be read from L2 the second time:
    at T=1, a share of about K / E of the experts, when they fit in L2 at all."""
    return replay_us([capture_chain(fn, sets)]) / len(sets)


def layer_floor(t: int, hit: float, k: int, h: int, i: int, fp8: bool, limits: dict) -> tuple[float, int, float]:
    """(bytes, flops, floor µs) of one gated MoE layer of ``t`` tokens with ``hit`` experts hit: bytes = the hit
    experts' weights (and fp8 128x128 scales) + hidden in and out; floor = max(bytes / copy rate, flops / matmul
    rate of the weights' dtype), both rates measured (:func:`measure_limits`)."""
    wbytes = hit * 3 * h * i * (1 if fp8 else 2)
    if fp8:
        wbytes += hit * 4 * (math.ceil(2 * i / 128) * math.ceil(h / 128) + math.ceil(h / 128) * math.ceil(i / 128))
    nbytes = wbytes + 2 * t * h * 2
    flops = 2 * t * k * 3 * h * i
    rate = limits["fp8_tflops" if fp8 else "bf16_tflops"]
    return nbytes, flops, max(nbytes / limits["copy_tbs"] / 1e6, flops / rate / 1e6)


def row_metrics(us: float, sets, e: int, k: int, h: int, i: int, fp8: bool, limits: dict) -> dict:
    """Bytes (experts hit + hidden in/out), flops, and fractions of the measured limits."""
    hidden, ids, _ = sets[0]
    t = hidden.shape[0]
    hit = torch.unique(ids).numel()
    nbytes, flops, floor_us = layer_floor(t, hit, k, h, i, fp8, limits)
    rate = limits["fp8_tflops" if fp8 else "bf16_tflops"]
    return {
        "us": us,
        "tbs": nbytes / us / 1e6,
        "tflops": flops / us / 1e6,
        "frac_copy": nbytes / us / 1e6 / limits["copy_tbs"],
        "frac_mm": flops / us / 1e6 / rate,
        "floor_us": floor_us,
        "frac_floor": floor_us / us,
        "experts_hit": hit,
    }


def salt_compile_cache() -> None:
    """Give this process's plain ``torch.compile`` of moe_fx's ops the moe_fx backend's cache salt.

    The benches compile ``torch.ops.moe_fx.experts`` with Inductor itself, whose FX graph cache keys a graph by its
    code, not by what moe_fx's lowering plans in it: on a machine whose cache outlived a change of the shipped tile
    table or of a lowering setting, a bench would time the old kernels. The salt (``moe_fx.backend``'s do-nothing
    post-grad pass) puts moe_fx's source, tile table and settings in the key, as ``backend="moe_fx"`` does.
    """
    import torch._inductor.config as inductor_config

    from moe_fx.backend import cache_salt

    if inductor_config.post_grad_custom_post_pass is None:
        inductor_config.post_grad_custom_post_pass = cache_salt()


#: Dynamo's per-code-object limits while a bench compiles its sides (its default is 8 entries).
COMPILE_LIMIT = 256


def allow_many_compiles(limit: int = COMPILE_LIMIT) -> None:
    """Let one bench process compile every side it times, and never time one uncompiled.

    Every compiled moe_fx side is ``torch.compile`` of the same code object (:func:`experts_fn`'s ``fn``) with its own
    weights, and each recompiles per row regime (the guards of ``moe_fx.lowering.problem.row_regime``). Past
    Dynamo's limit (8 entries a code object by default) the later calls run the frame uncompiled: the op's eager
    path, timed as if it were the compiled one. This raises the limits to ``limit`` and makes a hit an error.
    """
    import torch._dynamo.config as dynamo_config

    for knob in ("cache_size_limit", "recompile_limit", "accumulated_cache_size_limit", "accumulated_recompile_limit"):
        if hasattr(dynamo_config, knob):
            setattr(dynamo_config, knob, max(getattr(dynamo_config, knob), limit))
    if hasattr(dynamo_config, "fail_on_recompile_limit_hit"):
        dynamo_config.fail_on_recompile_limit_hit = True


def experts_fn(op, w13, w2, s13=None, s2=None, **kw):
    """``fn(hidden, ids, weights)`` running ``op`` with these expert weights (bound now, not late)."""

    def fn(x, ids, w):
        return op(x, ids, w, w13, w2, w13_scale=s13, w2_scale=s2, **kw)

    return fn


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """``|got - want| / |want|`` (Frobenius norms, fp32)."""
    got, want = got.float(), want.float()
    return ((got - want).norm() / want.norm()).item()


def check_outputs(fns: dict, e: int, k: int, h: int, w13, w2, **op_kwargs) -> dict:
    """Relative error of every implementation against the fp32 reference on one T=64 routing set."""
    from moe_fx.ops import experts_reference

    hidden, ids, w = routing_sets(64, e, k, h, 1, seed=123)[0]
    ref = experts_reference(hidden, ids, w, w13, w2, **op_kwargs).float()
    out = {}
    for name, fn in fns.items():
        try:
            with torch.no_grad():
                out[name] = round(rel_err(fn(hidden, ids, w), ref), 5)
        except CELL_ERRORS as err:
            out[name] = f"{type(err).__name__}: {str(err)[:100]}"
    return out


def hf_fits(impl: str, t: int, e: int, k: int, h: int, i: int) -> bool:
    if impl == "batched_mm":  # gathers a [T*K, 2I, H] weight copy: out of memory for large T
        return t * k * 3 * h * i * 2 < 40e9
    return True


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (``argv``, default ``sys.argv[1:]``) as parsed arguments."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="mixtral,qwen3,dsv3")
    ap.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    ap.add_argument("--impls", default="moe_fx_bf16,moe_fx_fp8,hf_grouped_mm,hf_batched_mm,hf_eager")
    ap.add_argument("--no-compile-hf", action="store_true", help="time transformers' modules uncompiled")
    ap.add_argument(
        "--compile-eager",
        action="store_true",
        help="also compile hf eager (its data-dependent loop breaks the graph per expert; slow to compile)",
    )
    ap.add_argument("--deepgemm", action="store_true", help="add torch.ops.moe_fx.experts(kernel_choice='deepgemm') rows")
    ap.add_argument("--graph-max-t", type=int, default=256)
    ap.add_argument("--chain-max-t", type=int, default=16, help="largest T timed in chain mode (0: none)")
    ap.add_argument("--chain-layers", type=int, default=CHAIN_LAYERS, help="calls (routing sets) in a chain graph")
    ap.add_argument("--tag", default="", help="suffix of the output file names")
    ap.add_argument("--budget-s", type=float, default=1e9, help="stop starting new cells after this many seconds")
    ap.add_argument("--tune", action="store_true", help="tune the Triton tiles of each shape first (cached)")
    ap.add_argument(
        "--merge",
        nargs="+",
        metavar="JSON",
        help="no GPU: join the rows of earlier runs' JSON files (one session split over calls) into one md/png",
    )
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    """Run the benchmark (or merge earlier runs' JSON files) as the command line says."""
    args = parse_args(argv)
    if args.merge:
        merge_runs(args.merge, args.out, args.tag)
        return
    if not torch.cuda.is_available():
        sys.exit("bench/moe_layer.py needs a CUDA GPU")
    from triton.compiler.errors import CompilationError
    from triton.runtime.errors import OutOfResources

    from moe_fx.lowering.problem import rows_per_expert
    from moe_fx.lowering.quant import quantize_fp8_blockwise

    allow_many_compiles()
    salt_compile_cache()
    global CELL_ERRORS
    # torch (and Dynamo / Inductor) errors are RuntimeErrors; triton's compile errors are not.
    CELL_ERRORS = (RuntimeError, ValueError, TypeError, AssertionError, OutOfResources, CompilationError)
    t_start = time.time()
    torch._dynamo.config.cache_size_limit = 64
    os.makedirs(args.out, exist_ok=True)
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
    base = os.path.join(args.out, f"moe_layer_{stamp}{'_' + args.tag if args.tag else ''}")
    meta = {
        **machine_meta(),
        "hf_compiled": "none" if args.no_compile_hf else ("all" if args.compile_eager else "grouped_mm, batched_mm"),
    }
    limits = measure_limits()
    meta["limits"] = limits
    log("limits", json.dumps(limits))
    impls = args.impls.split(",")
    deep_gemm_ok = False
    if args.deepgemm:
        try:
            import deep_gemm  # noqa: F401

            import moe_fx.lowering  # noqa: F401  (registers the CUDA implementation of the op)

            deep_gemm_ok = True
            impls.append("moe_fx_deepgemm_bf16")
            impls.append("moe_fx_deepgemm_fp8")
        except ImportError as err:
            log("deepgemm rows skipped:", err)
    results: list[dict] = []

    def save() -> None:
        with open(base + ".json", "w") as f:
            json.dump({"meta": meta, "rows": results}, f, indent=1)
        write_markdown(base + ".md", meta, results)

    for shape in args.shapes.split(","):
        family, e, k, h, i = SHAPES[shape]
        g = torch.Generator(device="cuda").manual_seed(1)
        w13 = torch.randn(e, 2 * i, h, device="cuda", generator=g, dtype=torch.bfloat16) / h**0.5
        w2 = torch.randn(e, h, i, device="cuda", generator=g, dtype=torch.bfloat16) / i**0.5
        q13, s13 = quantize_fp8_blockwise(w13)
        q2, s2 = quantize_fp8_blockwise(w2)
        if args.tune:
            from moe_fx.lowering.triton.grouped_gemm import tune_masked_gemm

            for t in map(int, args.tokens.split(",")):
                em = rows_per_expert(t, k, e)
                for kind in ("bf16", "fp8"):
                    for n_, k_ in ((2 * i, h), (h, i)):
                        t0 = time.time()
                        cfg = tune_masked_gemm(kind, e, n_, k_, em)
                        log(f"tuned {shape} {kind} N={n_} K={k_} m={em}: {cfg} ({time.time() - t0:.1f}s)")
        fns = {}
        mods = {}
        op_kw = {}
        hf_weights = (w13, w2)
        if family == "gpt_oss":
            b13 = torch.randn(e, 2 * i, device="cuda", generator=g, dtype=torch.bfloat16) * 0.1
            b2 = torch.randn(e, h, device="cuda", generator=g, dtype=torch.bfloat16) * 0.1
            op_kw = {**GPT_OSS_ACT, "w13_bias": b13, "w2_bias": b2}
            hf_weights = (w13, w2, b13, b2)
        for impl in FAMILY_IMPLS.get(family, HF_IMPLS):
            if "hf_" + impl in impls:
                mods[impl] = hf_experts_module(family, e, k, h, i, impl, hf_weights)
                compiled = not args.no_compile_hf and (impl != "eager" or args.compile_eager)
                fns["hf_" + impl] = torch.compile(mods[impl], dynamic=True) if compiled else mods[impl]
        op = torch.ops.moe_fx.experts
        fns["moe_fx_bf16"] = torch.compile(experts_fn(op, w13, w2, kernel_choice="triton", **op_kw))
        fns["moe_fx_fp8"] = torch.compile(experts_fn(op, q13, q2, s13, s2, kernel_choice="triton", **op_kw))
        if deep_gemm_ok and family != "gpt_oss":  # H=2880 is not 128-aligned: no DeepGEMM
            fns["moe_fx_deepgemm_bf16"] = torch.compile(experts_fn(op, w13, w2, kernel_choice="deepgemm"))
            fns["moe_fx_deepgemm_fp8"] = torch.compile(experts_fn(op, q13, q2, s13, s2, kernel_choice="deepgemm"))
        meta.setdefault("check_rel_err_vs_fp32_reference", {})[shape] = check_outputs(fns, e, k, h, w13, w2, **op_kw)
        log("check", shape, json.dumps(meta["check_rel_err_vs_fp32_reference"][shape]))
        for t in map(int, args.tokens.split(",")):
            sets = routing_sets(t, e, k, h, ROTATE, seed=t)
            modes = ["plain"] + (["graph"] if t <= args.graph_max_t else [])
            modes += ["chain"] if t <= args.chain_max_t else []
            chain_sets = routing_sets(t, e, k, h, args.chain_layers, seed=CHAIN_SEED + t) if "chain" in modes else []
            for impl in impls:
                if impl not in fns:
                    continue
                for mode in modes:
                    row = {"shape": shape, "E": e, "K": k, "H": h, "I": i, "T": t, "impl": impl, "mode": mode}
                    if time.time() - t_start > args.budget_s:
                        row["error"] = "skipped: time budget"
                        results.append(row)
                        continue
                    if impl == "hf_eager" and mode in ("graph", "chain"):
                        row["error"] = "not capturable: synchronises with the host (nonzero)"
                        results.append(row)
                        continue
                    if impl.startswith("hf_") and not hf_fits(impl[3:], t, e, k, h, i):
                        row["error"] = "skipped: would not fit in memory"
                        results.append(row)
                        continue
                    fp8 = impl.endswith("fp8")
                    t0 = time.time()
                    try:
                        with torch.no_grad():
                            timer = {"plain": time_rotating, "graph": time_graph, "chain": time_graph_chain}[mode]
                            mode_sets = chain_sets if mode == "chain" else sets
                            us = timer(fns[impl], mode_sets)
                        row.update(row_metrics(us, mode_sets, e, k, h, i, fp8, limits))
                    except CELL_ERRORS as err:  # recorded in the row and printed; the run carries on
                        msg = str(err).splitlines()[0][:160] if str(err) else ""
                        row["error"] = f"{type(err).__name__}: {msg}"
                        if os.environ.get("MOE_FX_BENCH_TRACE"):
                            traceback.print_exc()
                    row["wall_s"] = round(time.time() - t0, 1)
                    results.append(row)
                    log(json.dumps({kk: (round(v, 3) if isinstance(v, float) else v) for kk, v in row.items()}))
                    torch.cuda.synchronize()
                    gc.collect()
                    torch.cuda.empty_cache()
            save()
        del fns, mods, w13, w2, q13, q2
        torch._dynamo.reset()
        gc.collect()
        torch.cuda.empty_cache()
    save()
    try:
        plot(base + ".png", meta, results)
    except ImportError as err:
        log("no plot:", err)
    log(f"done in {time.time() - t_start:.0f}s -> {base}.md")


def merge_runs(paths: list[str], out_dir: str, tag: str) -> None:
    """Join runs of this script (same machine and versions, e.g. shapes split over device calls).

    Where two runs measured the same cell (shape, T, impl, mode), the later file's row is kept.
    """
    metas, by_key = [], {}
    for path in paths:
        with open(path) as f:
            data = json.load(f)
        metas.append(data["meta"])
        for row in data["rows"]:  # a later run's row replaces an earlier one's (same shape, T, impl, mode)
            by_key[(row["shape"], row["T"], row["impl"], row["mode"])] = {**row, "run": os.path.basename(path)}
    rows = list(by_key.values())
    meta = dict(metas[0])
    for key in ("gpu", "torch", "triton", "transformers"):
        if len({m[key] for m in metas}) != 1:
            raise SystemExit(f"--merge: runs differ in {key}: {sorted({m[key] for m in metas})}")
    meta["merged_from"] = [os.path.basename(p) for p in paths]
    # one set of limits per run; the floors of each row used its own run's limits
    meta["limits_per_run"] = [m["limits"] for m in metas]
    os.makedirs(out_dir, exist_ok=True)
    base = os.path.join(out_dir, f"moe_layer_{meta['date'][:10]}{'_' + tag if tag else ''}")
    with open(base + ".json", "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    write_markdown(base + ".md", meta, rows)
    plot(base + ".png", meta, rows)
    log(f"merged {len(rows)} rows -> {base}.md")


def write_markdown(path: str, meta: dict, rows: list[dict]) -> None:
    lim = meta.get("limits", {})
    runs = meta.get("limits_per_run", [lim])
    lines = [
        "# One MoE layer on one GPU: transformers experts vs moe_fx (Triton; DeepGEMM rows where built)",
        "",
        (
            f"{meta['date']} · {meta['gpu']} · torch {meta['torch']} · triton {meta['triton']} · "
            f"transformers {meta['transformers']} · transformers modules compiled: {meta['hf_compiled']}"
        ),
        "",
        "Measured limits"
        + (f" (each of the {len(runs)} merged runs measured its own; rows use their run's)" if len(runs) > 1 else "")
        + ": "
        + "; ".join(
            f"copy {r.get('copy_tbs', 0):.2f} TB/s, bf16 matmul {r.get('bf16_tflops', 0):.0f} TFLOP/s, "
            f"fp8 matmul {r.get('fp8_tflops', 0):.0f} TFLOP/s"
            for r in runs
        )
        + ".",
        "",
        (
            "frac = floor / time, floor = max(bytes / copy rate, flops / matmul rate of the row's dtype); "
            "bytes = experts hit + hidden in and out; %copy and %mm = achieved TB/s and TFLOP/s over the limits. "
            "mode: plain = calls without CUDA graphs; graph = one call per CUDA graph, its launch included; chain = "
            "one CUDA graph of consecutive calls on different routing sets (as a model's graph holds its MoE layers), "
            "µs per call."
        ),
        "",
        "| shape | T | impl | mode | µs | TB/s | %copy | TFLOP/s | %mm | floor µs | frac |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "us" in r:
            lines.append(
                f"| {r['shape']} | {r['T']} | {r['impl']} | {r['mode']} | {r['us']:.1f} | {r['tbs']:.2f} | "
                f"{100 * r['frac_copy']:.0f}% | {r['tflops']:.0f} | {100 * r['frac_mm']:.0f}% | {r['floor_us']:.1f} | "
                f"{100 * r['frac_floor']:.0f}% |"
            )
        else:
            lines.append(f"| {r['shape']} | {r['T']} | {r['impl']} | {r['mode']} | {r.get('error', '')} | | | | | | |")
    # per (shape, T, mode): the best of transformers against each moe_fx implementation
    mine_names = [n for n in dict.fromkeys(r["impl"] for r in rows) if n.startswith("moe_fx")]
    lines += [
        "",
        "## moe_fx against the best of transformers, per row",
        "",
        "Speed-up = best transformers µs / moe_fx µs (same dtype for bf16; fp8 rows move half the weight bytes). "
        "frac = the best moe_fx row's fraction of its own floor.",
        "",
        "| shape | T | mode | best transformers | µs | "
        + " | ".join(f"{n} µs (x)" for n in mine_names)
        + " | best moe_fx frac |",
        "|---|---|---|---|---|" + "---|" * len(mine_names) + "---|",
    ]
    keys = sorted({(r["shape"], r["T"], r["mode"]) for r in rows}, key=lambda x: (x[0], x[1], x[2]))
    for key in keys:
        cell = {r["impl"]: r for r in rows if (r["shape"], r["T"], r["mode"]) == key and "us" in r}
        if not cell:
            continue
        hf = [r for n, r in cell.items() if n.startswith("hf_")]
        best_hf = min(hf, key=lambda r: r["us"]) if hf else None
        parts = [key[0], str(key[1]), key[2], best_hf["impl"] if best_hf else "", f"{best_hf['us']:.1f}" if best_hf else ""]
        for n in mine_names:
            r = cell.get(n)
            if r is None:
                parts.append("")
            else:
                sp = f" ({best_hf['us'] / r['us']:.2f}x)" if best_hf else ""
                parts.append(f"{r['us']:.1f}{sp}")
        mine = [r for n, r in cell.items() if n.startswith("moe_fx")]
        parts.append(f"{100 * min(mine, key=lambda r: r['us'])['frac_floor']:.0f}%" if mine else "")
        lines.append("| " + " | ".join(parts) + " |")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


def plot(path: str, meta: dict, rows: list[dict]) -> None:
    """Time against T, one column per shape; plain calls on top, CUDA-graph replays (T <= 256) below."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shapes = list(dict.fromkeys(r["shape"] for r in rows))
    impls = list(dict.fromkeys(r["impl"] for r in rows))
    colors = {impl: plt.cm.tab10(n % 10) for n, impl in enumerate(impls)}
    fig, axes = plt.subplots(2, len(shapes), figsize=(5.5 * len(shapes), 8), squeeze=False)
    for col, shape in enumerate(shapes):
        for row_i, mode in enumerate(("plain", "graph")):
            ax = axes[row_i][col]
            for impl in impls:
                pts = sorted(
                    (r["T"], r["us"])
                    for r in rows
                    if r["shape"] == shape and r["impl"] == impl and r["mode"] == mode and "us" in r
                )
                if pts:
                    style = "-" if impl.startswith("moe_fx") else "--"
                    ax.plot(*zip(*pts), style, marker="o", ms=3, color=colors[impl], label=impl)
            for dtype, style in (("bf16", "k:"), ("fp8", "k-.")):
                floor = sorted(
                    {
                        (r["T"], r["floor_us"])
                        for r in rows
                        if r["shape"] == shape and r["impl"] == f"moe_fx_{dtype}" and r["mode"] == mode and "us" in r
                    }
                )
                if floor:
                    ax.plot(*zip(*floor), style, lw=1, label=f"{dtype} floor")
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("tokens T")
            ax.set_ylabel("µs")
            ax.set_title(f"{shape}, {'plain calls' if mode == 'plain' else 'CUDA-graph replays'}")
            ax.grid(alpha=0.3)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=min(6, len(labels)), fontsize=8)
    fig.suptitle(f"one MoE layer, {meta['gpu']}, torch {meta['torch']}, triton {meta['triton']} (lower is better)")
    fig.tight_layout(rect=(0, 0.07, 1, 0.97))
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
