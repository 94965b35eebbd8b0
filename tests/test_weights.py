"""Expert weights stay the model's (issue 11, point 2): every compiled graph sees recompiles,
``load_state_dict`` (in place and ``assign=True``), ``.to()`` and in-place edits, for every form."""

from __future__ import annotations

import io
import pickle

import pytest
import torch
from helpers import capture_backend, experts_in_one_copy, logits, rel_err

import moe_fx
from moe_fx.backend import enable_capture
from moe_fx.config import MoEConfig
from moe_fx.testing.models import DenseBmmMoE, LoopMoE, TitanGroupedMoE, tiny_hf_model

OP = "torch.ops.moe_fx.experts.default("
FORMS = ("hf_grouped_mm", "titan", "dense", "loop", "fp8", "fp8_loop")
SCENARIOS = ("recompile_then_load", "load", "load_assign", "inplace", "to_and_back", "data_edit", "data_copy")


def _make(form: str, seed: int):
    """(model, input of T=5, input of T=7, dtype, config) for ``form``; ``seed`` picks the weights."""
    torch.manual_seed(seed)
    if form in ("hf_grouped_mm", "fp8"):
        kw = dict(hidden=128, intermediate=128, dtype=torch.bfloat16) if form == "fp8" else {}
        model = tiny_hf_model("qwen3_moe" if form == "fp8" else "mixtral", num_layers=1, seed=seed, **kw)
        t5, t7 = (torch.randint(0, 128, (1, t), generator=torch.Generator().manual_seed(t)) for t in (5, 7))
        config = MoEConfig(quantize="fp8") if form == "fp8" else MoEConfig()
        return model, t5, t7, kw.get("dtype", torch.float32), config
    if form == "fp8_loop":  # ModuleList experts, stacked then quantised
        model = LoopMoE(hidden=128, inter=128, num_experts=4).to(torch.bfloat16)
        t5, t7 = (torch.randn(t, 128, generator=torch.Generator().manual_seed(t)).bfloat16() for t in (5, 7))
        return model, t5, t7, torch.bfloat16, MoEConfig(quantize="fp8")
    dtype = torch.bfloat16 if form == "titan" else torch.float32
    model = {"titan": TitanGroupedMoE, "dense": DenseBmmMoE, "loop": LoopMoE}[form]().to(dtype)
    t5, t7 = (torch.randn(t, 32, generator=torch.Generator().manual_seed(t)).to(dtype) for t in (5, 7))
    return model, t5, t7, dtype, MoEConfig()


def _expert_params(model) -> list[torch.nn.Parameter]:
    return [p for n, p in model.named_parameters() if "expert" in n or n in ("w13", "w2", "gate_up", "down")]


def _change(model, scenario: str, other_state: dict, dtype: torch.dtype, compiled, t7) -> None:
    """Change the model's expert weights the way ``scenario`` says (after a first compiled call)."""
    with torch.no_grad():
        if scenario == "recompile_then_load":
            compiled(t7)  # a second graph (new shape), then an in-place load
            model.load_state_dict(other_state)
        elif scenario == "load":
            model.load_state_dict(other_state)
        elif scenario == "load_assign":
            model.load_state_dict(other_state, assign=True)
        elif scenario == "inplace":
            for p in _expert_params(model):
                p.mul_(-0.5)
        elif scenario == "to_and_back":
            model.to(torch.float64)
            model.to(dtype)  # fresh tensors with the same values: then edited in place
            for p in _expert_params(model):
                p.mul_(-0.5)
        elif scenario == "data_edit":  # a .data alias has its own version counter: the parameter's does not move
            for p in _expert_params(model):
                p.data.mul_(2)
        elif scenario == "data_copy":  # new weights copied in through .data (how RL weight syncs write)
            for p, new in zip(_expert_params(model), _expert_params(_make_like(model, other_state)), strict=True):
                p.data.copy_(new)
        else:
            raise ValueError(scenario)


def _make_like(model, state: dict):
    """A copy of ``model`` holding ``state``."""
    import copy

    other = copy.deepcopy(model)
    other.load_state_dict(state)
    return other


def _compile(model, config):
    torch._dynamo.reset()
    enable_capture()
    backend, cap = capture_backend(config)
    return torch.compile(model, backend=backend, dynamic=False), cap


@pytest.mark.parametrize("scenario", SCENARIOS)
@pytest.mark.parametrize("form", FORMS)
def test_compiled_graph_sees_weight_changes(form, scenario):
    model, t5, t7, dtype, config = _make(form, seed=0)
    other_state = _make(form, seed=1)[0].state_dict()
    compiled, cap = _compile(model, config)
    with torch.no_grad():
        compiled(t5)
        _change(model, scenario, other_state, dtype, compiled, t7)
        got = logits(compiled(t5))
        if form.startswith("fp8"):
            # fp8 weights are not eager's: a fresh compile of the changed model is the reference.
            want = logits(_compile(model, config)[0](t5))
        else:
            want = logits(model(t5))
    assert cap.count(OP) >= 1
    tol = 3e-2 if dtype == torch.bfloat16 and not form.startswith("fp8") else 1e-5
    assert rel_err(got, want) < tol, f"{form}/{scenario}: the compiled graph kept stale expert weights"


def test_per_expert_stack_is_reused_by_recompiles():
    """A second compile (new shape) reuses the stacks the first made: one copy of the experts,
    which both graphs read (an in-place edit reaches both)."""
    torch.manual_seed(0)
    model = LoopMoE()
    compiled, cap = _compile(model, MoEConfig())
    x5, x7 = torch.randn(5, 32), torch.randn(7, 32)
    with torch.no_grad():
        compiled(x5)
        compiled(x7)
        assert cap.compiles == 2
        assert experts_in_one_copy(model.experts), "gate/up in one stack, down in another"
        model.experts[3].up_proj.weight.mul_(3.0)
        for x in (x5, x7):
            assert rel_err(compiled(x), model(x)) < 1e-5


def test_per_expert_weights_through_inductor():
    """The whole backend (Inductor): assign=True loads and ``.to()`` round trips are seen."""
    torch.manual_seed(0)
    model, other = LoopMoE(), LoopMoE()
    torch._dynamo.reset()
    compiled = moe_fx.compile(model, dynamic=False)
    x = torch.randn(6, 32)
    with torch.no_grad():
        assert rel_err(compiled(x), model(x)) < 1e-5
        model.load_state_dict(other.state_dict(), assign=True)
        assert rel_err(compiled(x), model(x)) < 1e-5
        model.to(torch.float64)
        model.to(torch.float32)
        model.experts[0].gate_proj.weight.mul_(2.0)
        assert rel_err(compiled(x), model(x)) < 1e-5
    # Still one copy: the parameters view the stacks again after the call.
    assert experts_in_one_copy(model.experts)


def _saved_bytes(obj) -> int:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.tell()


def _reloaded(obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf)


def test_pickled_and_saved_sizes_unchanged_after_compiling_module_list_experts():
    """One copy of the experts in memory, and each parameter still serialises as its own elements (before:
    ``pickle.dumps(model)`` 10.7x, ``torch.save(expert.state_dict())`` 6.2x, each view carrying the stack)."""
    torch.manual_seed(0)
    model, x = LoopMoE().eval(), torch.randn(6, 32)
    sizes = lambda m: (len(pickle.dumps(m)), _saved_bytes(m.experts[2].state_dict()), _saved_bytes(m.state_dict()))  # noqa: E731
    before = sizes(model)
    compiled, cap = _compile(model, MoEConfig())
    with torch.no_grad():
        compiled(x)
    assert cap.count(OP) == 1 and experts_in_one_copy(model.experts)
    after = sizes(model)
    assert all(abs(a / b - 1) < 0.03 for a, b in zip(after, before, strict=True)), (after, before)
    with torch.no_grad():
        # The compiled graph still reads the model's parameters (a .data edit reaches it).
        model.experts[2].gate_proj.weight.data.mul_(2)
        want = model(x)
        assert rel_err(compiled(x), want) < 1e-5 and cap.compiles == 1
        # What was written loads back equal, and compiles.
        loaded = pickle.loads(pickle.dumps(model))
        assert all(torch.equal(p, q) for p, q in zip(loaded.parameters(), model.parameters(), strict=True))
        fresh = LoopMoE().eval()
        fresh.load_state_dict(_reloaded(model.state_dict()))
        fresh.experts[2].load_state_dict(_reloaded(model.experts[2].state_dict()))
        assert all(torch.equal(p, q) for p, q in zip(fresh.parameters(), model.parameters(), strict=True))
        torch.testing.assert_close(_compile(loaded, MoEConfig())[0](x), want, rtol=1e-5, atol=1e-5)


def test_source_watch_rebuilds_only_when_the_weights_changed():
    """The fp8 check: nothing changed, nothing rebuilt; a write through ``.data`` of one expert, or one that
    bumps the version counter, or a replaced tensor: rebuilt once. What it cannot see is said in its
    docstring: a write of elements off the sampled grid, through ``.data``."""
    from moe_fx.passes.expert_storage import SAMPLE_GRID, SourceWatch, WeightSources, sample_view

    w13, w2 = torch.randn(4, 32, 16), torch.randn(4, 16, 16)
    built: list[int] = []
    watch = SourceWatch()
    watch.add(WeightSources([0, 1], lambda ts: (ts[0], ts[1]), [0, 1]), lambda ts: built.append(len(ts)))
    args = [w13, w2]
    watch.record(args)
    for _ in range(3):
        watch(args)
    assert built == [] and sample_view(w13).shape == (4, SAMPLE_GRID, SAMPLE_GRID)
    w13.data[2].mul_(2)  # one expert, through .data: the version counter of w13 does not move
    watch(args)
    watch(args)
    assert built == [2]
    w2.mul_(-1)  # in place: version counter
    watch(args)
    assert built == [2, 2]
    args = [w13, w2.clone()]  # same values, another tensor (pointer)
    watch(args)
    watch(args)
    assert built == [2, 2, 2]
    w13.data[0, 0, 0] += 1.0  # off the grid (it starts half a step from the edges): not seen
    watch(args)
    assert built == [2, 2, 2]
