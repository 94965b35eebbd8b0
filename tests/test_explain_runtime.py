"""explain is the run time: the kernel and layout explain reports for an op are the ones the lowering runs.

Two levels. On the graph: an FX graph holding ``moe_fx::experts`` on fake CUDA tensors with an assumed H200
(with and without DeepGEMM), once read the way explain reads a traced graph after the passes
(``moe_fx.api._explain_ops``: the op node's fake arguments, bound by the schema, given to the lowering's
planning functions), once lowered by AOTAutograd as Inductor would receive it (the kernels in the graph say
what runs). On a model: ``moe_fx.explain`` on CPU models with ``kernel="triton"``, against the plan the op's
eager kernel makes when the compiled model runs (regions the graph pass rewrites, captured hit loops, fp8
checkpoint experts, ``quantize="fp8"``).
"""

from __future__ import annotations

import pytest
import torch
from torch import fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

import moe_fx
from moe_fx.api import _explain_ops
from moe_fx.passes.report import RegionReport

pytest.importorskip("triton")
from test_lowered_graph import H200, H200_DG, _kernel_name, _launches, _trace


def _args(mode, t, *, h=256, i=256, e=8, k=2, fp8=False, transposed=False, biases=(), gated=True):
    """Fake CUDA inputs of one experts call; ``transposed`` stores the weights ``[E, H, N1]`` / ``[E, I, H]``."""
    n1 = 2 * i if gated else i
    wd = torch.float8_e4m3fn if fp8 else torch.bfloat16
    with mode:
        out = {"hidden": torch.empty(t, h, device="cuda", dtype=torch.bfloat16),
               "ids": torch.empty(t, k, device="cuda", dtype=torch.int64),
               "w": torch.empty(t, k, device="cuda", dtype=torch.float32),
               "w13": torch.empty((e, h, n1) if transposed else (e, n1, h), device="cuda", dtype=wd),
               "w2": torch.empty((e, i, h) if transposed else (e, h, i), device="cuda", dtype=wd)}
        if fp8:
            out["s13"] = torch.empty(e, n1 // 128, h // 128, device="cuda")
            out["s2"] = torch.empty(e, h // 128, i // 128, device="cuda")
        if "w13" in biases:
            out["b13"] = torch.empty(e, n1, device="cuda", dtype=torch.bfloat16)
        if "w2" in biases:
            out["b2"] = torch.empty(e, h, device="cuda", dtype=torch.bfloat16)
    return out


def _fn(names: list[str], transposed: bool, op_kwargs: dict):
    """``f(<names>) -> (experts(...),)`` over the named inputs, as explain and the lowering see it (named
    parameters: symbolic tracing makes one placeholder per parameter)."""

    def body(*xs):
        a = dict(zip(names, xs, strict=True))
        w13, w2 = (a["w13"].transpose(1, 2), a["w2"].transpose(1, 2)) if transposed else (a["w13"], a["w2"])
        extra = {k: a[v] for k, v in (("w13_scale", "s13"), ("w2_scale", "s2"), ("w13_bias", "b13"),
                                      ("w2_bias", "b2")) if v in a}
        return (torch.ops.moe_fx.experts(a["hidden"], a["ids"], a["w"], w13, w2, **extra, **op_kwargs),)

    scope = {"body": body}
    exec(f"def f({', '.join(names)}):\n    return body({', '.join(names)})", scope)  # noqa: S102
    return scope["f"]


def _explained(fn, inputs, caps) -> tuple[str, str]:
    """(kernel, layout) as explain reports them for the op node of ``fn``'s graph."""
    from moe_fx.lowering.problem import assume_capabilities

    gm = fx.symbolic_trace(fn)
    mode = next(t.fake_mode for t in inputs)
    FakeTensorProp(gm, mode).propagate(*inputs)  # meta["val"] of every node: what Dynamo's example values are
    (op,) = [n for n in gm.graph.nodes if "moe_fx.experts" in str(n.target)]
    op.meta["moe_fx"] = {"report_index": 0}
    report = RegionReport(layer="layer", matched=True)
    with assume_capabilities(caps):
        _explain_ops(gm, [report], 0)
    return report.kernel, report.layout


def _lowered(fn, inputs, caps) -> tuple[str, str]:
    """(kernel, layout) the lowering runs: read from the graph AOTAutograd hands Inductor."""
    gm = _trace(fn, inputs, caps)
    if "moe_fx.experts" in gm.code:
        return "reference", "reference"
    names = [_kernel_name(n) for n in _launches(gm)]
    kernel = "deepgemm" if "deepgemm_masked_gemm" in gm.code else "triton"
    assert kernel == "deepgemm" or any(n.startswith("masked_gemm") for n in names), names
    layout = "sorted" if any(n.startswith("sort_") for n in names) else "masked"
    assert layout == "sorted" or "permute_kernel" in names, names
    return kernel, layout


VARIANTS = {
    "plain": {},
    "w13_bias": {"biases": ("w13",)},
    "w2_bias": {"biases": ("w2",)},
    "both_biases": {"biases": ("w13", "w2")},
    "transposed": {"transposed": True},
    "fp8": {"fp8": True},
    "gelu": {"op": {"activation": "gelu"}},
    "relu2_not_gated": {"gated": False, "op": {"activation": "relu2", "gated": False}},
    "gpt_oss": {"biases": ("w13", "w2"), "op": {"gate_up_layout": "interleaved", "alpha": 1.702, "limit": 7.0,
                                                 "up_offset": 1.0}},
    "triton_requested": {"op": {"kernel_choice": "triton"}},
    "reference_requested": {"op": {"kernel_choice": "reference"}},
}


#: (variant, caps) pairs whose lowering this CPU machine cannot trace: DeepGEMM's fp8 masked layout allocates its
#: MN-major scales with a CUDA factory call inside the traced rule, which a CPU-only torch build refuses (the GPU
#: suite compiles it: tests/test_compiled_gpu.py, tests/test_deepgemm_gpu.py).
_CPU_UNTRACEABLE = {("fp8", "h200_deepgemm")}
CASES = [(v, c) for v in sorted(VARIANTS) for c in ("h200", "h200_deepgemm") if (v, c) not in _CPU_UNTRACEABLE]


@pytest.mark.parametrize("t", [2, 512], ids=["decode", "prefill"])
@pytest.mark.parametrize("variant, caps_name", CASES)
def test_explain_names_the_kernel_and_layout_the_lowering_runs(sm90, monkeypatch, variant, caps_name, t):
    from moe_fx.lowering.masked_experts import deepgemm

    caps = {"h200": H200, "h200_deepgemm": H200_DG}[caps_name]
    # DeepGEMM above 64 rows per expert for bf16 weights too (the shipped rule keeps bf16 on Triton), so the
    # variants reach its layout
    monkeypatch.setattr(deepgemm, "LOCAL_FROM_REGIME", {False: 3, True: 3})
    v = dict(VARIANTS[variant])
    op_kwargs = v.pop("op", {})
    inputs = _args(FakeTensorMode(), t, **v)
    fn = _fn(list(inputs), v.get("transposed", False), op_kwargs)
    explained = _explained(fn, list(inputs.values()), caps)
    assert explained == _lowered(fn, list(inputs.values()), caps)
    # not a vacuous agreement: the variants reach every kernel and layout
    if variant == "plain" and caps is H200_DG:
        assert explained == (("triton", "sorted") if t == 2 else ("deepgemm", "masked"))
    if variant in ("w2_bias", "transposed") and caps is H200_DG and t == 512:
        assert explained == ("triton", "sorted")  # what a default explain_kernel (no bias, K-major) got wrong
    if variant == "reference_requested":
        assert explained == ("reference", "reference")


def test_explain_of_fp8_weights_with_deepgemm(sm90):
    """The pair the CPU machine cannot lower (see ``_CPU_UNTRACEABLE``): explain says what the rule decides."""
    for t, want in ((2, ("triton", "sorted")), (256, ("triton", "sorted")), (512, ("deepgemm", "masked"))):
        inputs = _args(FakeTensorMode(), t, fp8=True)
        assert _explained(_fn(list(inputs), False, {}), list(inputs.values()), H200_DG) == want


def test_explain_reads_a_symbolic_token_count_at_its_hint_without_guards(sm90):
    from torch._dynamo.source import ConstantSource
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv

    shape_env = ShapeEnv()
    mode = FakeTensorMode(shape_env=shape_env)
    inputs = _args(mode, 256)
    t = shape_env.create_symintnode(shape_env.create_symbol(2, ConstantSource("T"), dynamic_dim=DimDynamic.DYNAMIC),
                                    hint=2)
    with mode:
        inputs.update(hidden=torch.empty(t, 256, dtype=torch.bfloat16, device="cuda"),
                      ids=torch.empty(t, 2, dtype=torch.int64, device="cuda"), w=torch.empty(t, 2, device="cuda"))
    fn = _fn(list(inputs), False, {})
    assert _explained(fn, list(inputs.values()), H200_DG) == ("triton", "sorted")  # the hint's regime: decode
    assert not shape_env.guards  # explain adds no guard to the graph it reads


# ------------------------------------------------------------------------------------------------
# On models (CPU, kernel="triton": Triton's interpreter on tiny shapes)


class _PlanSpy:
    """Records (kernel, layout) of every plan the op's eager kernel makes (``plan_experts``)."""

    def __init__(self, monkeypatch):
        from moe_fx.lowering import experts

        self.plans: list[tuple[str, str]] = []
        original = experts.ExpertsPlan.raise_if_unrunnable

        def spy(plan, what):
            self.plans.append((plan.experts.kernel, plan.layout))
            return original(plan, what)

        monkeypatch.setattr(experts.ExpertsPlan, "raise_if_unrunnable", spy)


def _models():
    from moe_fx.testing.families import HitLoopMoE
    from moe_fx.testing.models import tiny_hf_model

    torch.manual_seed(0)
    return {
        "graph_pass": (lambda: tiny_hf_model("qwen3_moe", num_layers=1), lambda: torch.randint(0, 100, (1, 5)), {}),
        "hit_loop": (lambda: HitLoopMoE(bias=True).eval(), lambda: torch.randn(5, 32), {}),
        "quantize_fp8": (lambda: tiny_hf_model("qwen3_moe", num_layers=1, hidden=128, intermediate=128,
                                               dtype=torch.bfloat16),
                         lambda: torch.randint(0, 100, (1, 5)), {"quantize": "fp8"}),
    }


@pytest.mark.parametrize("name", ["graph_pass", "hit_loop", "quantize_fp8"])
def test_explain_on_a_model_is_what_its_compiled_call_runs(name, monkeypatch):
    build, inputs, extra = _models()[name]
    config = moe_fx.MoEConfig(kernel="triton", **extra)
    x = inputs()
    report = moe_fx.explain(build(), x, config=config)
    explained = [(r.kernel, r.layout) for r in report.matched]
    assert explained and all(k == "triton (interpreted on CPU)" for k, _ in explained), str(report)
    spy = _PlanSpy(monkeypatch)
    torch._dynamo.reset()
    from moe_fx.backend import make_backend

    model = build()
    if name == "hit_loop":
        from moe_fx.capture.steps import capture_modules

        capture_modules(model, config)
    with torch.no_grad():
        torch.compile(model, backend=make_backend(config, inductor=False))(x)
    assert spy.plans and [("triton", layout) for _, layout in explained] == spy.plans[: len(explained)]


def test_explain_on_an_fp8_checkpoint_is_what_its_compiled_call_runs(monkeypatch):
    from moe_fx.testing import fp8
    config = moe_fx.MoEConfig(kernel="triton")
    ids = torch.randint(0, 100, (1, 5))
    report = moe_fx.explain(fp8.tiny_fp8_hf_model(num_layers=1), ids, config=config)
    explained = [(r.kernel, r.layout) for r in report.matched]
    assert explained and {r.form for r in report.matched} == {"fp8_experts"}, str(report)
    spy = _PlanSpy(monkeypatch)
    torch._dynamo.reset()
    model = fp8.tiny_fp8_hf_model(num_layers=1)
    from moe_fx.backend import make_backend
    from moe_fx.capture.steps import capture_modules

    capture_modules(model, config)
    with torch.no_grad():
        torch.compile(model, backend=make_backend(config, inductor=False))(ids)
    assert [("triton", layout) for _, layout in explained] == spy.plans[: len(explained)]
