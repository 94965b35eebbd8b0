"""What Inductor receives for a moe_fx op on an H200, checked on a CPU machine.

AOTAutograd traces a graph holding ``moe_fx::experts`` (or ``masked_experts``) with fake CUDA tensors
and an assumed H200 (``assume_capabilities``); Triton's driver is pointed at an sm_90 target so that
Inductor's analysis of the user kernels (which buffers each kernel writes) runs as on the GPU. The
graph Inductor would compile must hold the kernel launches themselves, each writing only its own
outputs (no defensive copies), decided with static grids, and no call of the experts op.
The GPU tests (test_compiled_gpu.py) check the code Inductor generates from it and run it.
"""

from __future__ import annotations


import pytest
import torch
import torch.fx as fx
from functorch.compile import make_boxed_func
from torch._functorch.aot_autograd import aot_module_simplified
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import ShapeEnv

import moe_fx  # noqa: F401
from moe_fx.lowering.masked_experts import pipeline
from moe_fx.lowering.problem import Capabilities, assume_capabilities

triton = pytest.importorskip("triton")

H200 = Capabilities("cuda", (9, 0), "deep_gemm is not installed", None, "deep_ep is not installed", 132, "NVIDIA H200")
H200_DG = Capabilities("cuda", (9, 0), None, None, "deep_ep is not installed", 132, "NVIDIA H200")
#: the contiguous (sorted) layout, the default on one GPU: sort, GEMM1 gathering tokens with the activation in
#: its epilogue, GEMM2, combine (fp8 weights keep the activation kernel, which quantises for GEMM2)
KERNELS = ("expert_counts_kernel", "sort_slots_kernel", "masked_gemm_kernel", "masked_gemm_kernel", "unpermute_kernel")
#: decode-sized (<= 4 rows per expert): the one-program sort
DECODE = ("sort_small_kernel",) + KERNELS[2:]
MASKED = ("permute_kernel", "masked_gemm_kernel", "activation_kernel", "masked_gemm_kernel", "unpermute_kernel")


def _trace(fn, inputs, caps=H200) -> fx.GraphModule:
    graphs = []

    def fw(gm, _):
        graphs.append(gm)
        return make_boxed_func(gm.forward)

    with torch.no_grad(), assume_capabilities(caps):
        aot_module_simplified(fx.symbolic_trace(fn), inputs, fw_compiler=fw)
    return graphs[0]


def _inputs(mode, t=16, h=256, i=256, e=8, k=2, dtype=torch.bfloat16, fp8=False):
    with mode:
        hidden = torch.empty(t, h, device="cuda", dtype=dtype)
        ids = torch.empty(t, k, device="cuda", dtype=torch.int64)
        w = torch.empty(t, k, device="cuda", dtype=torch.float32)
        wd = torch.float8_e4m3fn if fp8 else dtype
        w13 = torch.empty(e, 2 * i, h, device="cuda", dtype=wd)
        w2 = torch.empty(e, h, i, device="cuda", dtype=wd)
        scales = [torch.empty(e, 2 * i // 128, h // 128, device="cuda"), torch.empty(e, h // 128, i // 128, device="cuda")]
    return [hidden, ids, w, w13, w2] + (scales if fp8 else [])


def _launches(gm: fx.GraphModule) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if "triton_kernel_wrapper" in str(n.target)]


def _kernel_name(node: fx.Node) -> str:
    from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table

    k = kernel_side_table.get_kernel(node.kwargs["kernel_idx"])
    return getattr(k, "__name__", None) or k.fn.__name__


def _assert_every_parameter_passed(node: fx.Node) -> None:
    """torch 2.11's Inductor fills no defaults of a user kernel in the launch it generates: every launch
    the lowering traces names each parameter of its kernel."""
    from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table

    kernel = kernel_side_table.get_kernel(node.kwargs["kernel_idx"])
    given = set(node.kwargs["kwargs"]) | set(kernel_side_table.get_constant_args(node.kwargs["constant_args_idx"]))
    assert given == set(kernel.arg_names), (_kernel_name(node), set(kernel.arg_names) - given)


def _experts(h, ids, w, w13, w2):
    return (torch.ops.moe_fx.experts(h, ids, w, w13, w2),)


def _experts_fp8(h, ids, w, w13, w2, s13, s2):
    return (torch.ops.moe_fx.experts(h, ids, w, w13, w2, w13_scale=s13, w2_scale=s2),)


@pytest.mark.parametrize("t", [16, 64])
def test_experts_op_becomes_kernel_launches(sm90, t):
    gm = _trace(_experts, _inputs(FakeTensorMode(), t=t))
    code = gm.code
    assert "moe_fx.experts" not in code
    launches = _launches(gm)
    assert [_kernel_name(n) for n in launches] == list(DECODE if t == 16 else KERNELS)
    outputs = {"expert_counts_kernel": {"counts_ptr"}, "sort_slots_kernel": {"counts_ptr", "sorted_ptr", "pos_ptr"},
               "sort_small_kernel": {"counts_ptr", "sorted_ptr", "pos_ptr"},
               "masked_gemm_kernel": {"c_ptr"}, "activation_kernel": {"y_ptr"}, "unpermute_kernel": {"out_ptr"}}
    for node in launches:
        # each kernel writes only its outputs: Inductor inserts no copy of an input (masked_m, the weights)
        assert set(node.kwargs["tensors_to_clone"]) == outputs[_kernel_name(node)], node.kwargs["tensors_to_clone"]
        assert all(isinstance(g, int) for grid in node.kwargs["grid"] for g in grid)
        _assert_every_parameter_passed(node)


def test_fp8_weights_trace_to_fp8_kernels(sm90, monkeypatch):
    from moe_fx.lowering.masked_experts import pipeline

    # tokens quantised 1x128 (at decode sizes by programs of the sort's launch), fp8 MMAs, the activation kernel
    # quantises GEMM2's input (decode and prefill sizes)
    for t, sort in ((16, ["sort_small_kernel"]), (512, ["expert_counts_kernel", "sort_slots_kernel",
                                                         "quantize_rows_kernel"])):
        gm = _trace(_experts_fp8, _inputs(FakeTensorMode(), t=t, fp8=True))
        launches = _launches(gm)
        names = [_kernel_name(n) for n in launches]
        assert names == [*sort, "masked_gemm_fp8_kernel", "activation_kernel", "masked_gemm_fp8_kernel",
                         "unpermute_kernel"]
        assert launches[0].kwargs["kwargs"].get("QUANT", False) == (t == 16)
        if t == 16:  # the sort's launch writes the codes and scales, and clones nothing it reads (the tokens)
            assert set(launches[0].kwargs["tensors_to_clone"]) == {"counts_ptr", "sorted_ptr", "pos_ptr", "q_ptr",
                                                                   "qs_ptr"}
            _assert_every_parameter_passed(launches[0])
        assert "moe_fx.experts" not in gm.code
    # the quantisation's own launch where the switch is off (bench/fused_activation.py --switch sort_quant)
    monkeypatch.setattr(pipeline, "QUANTIZE_TOKENS_IN_SORT", False)
    gm = _trace(_experts_fp8, _inputs(FakeTensorMode(), t=16, fp8=True))
    assert [_kernel_name(n) for n in _launches(gm)][:2] == ["sort_small_kernel", "quantize_rows_kernel"]
    monkeypatch.setattr(pipeline, "QUANTIZE_TOKENS_IN_SORT", True)
    # W8A16 on request (<= 16 rows per expert): bf16 activations x fp8 weights, the bf16 pipeline's four launches
    monkeypatch.setattr(pipeline, "W8A16_MAX_ROWS", 16)
    for t in (16, 64):
        gm = _trace(_experts_fp8, _inputs(FakeTensorMode(), t=t, fp8=True))
        launches = _launches(gm)
        assert [_kernel_name(n) for n in launches] == list(DECODE if t == 16 else KERNELS)
        gemms = [n for n in launches if _kernel_name(n) == "masked_gemm_kernel"]
        for node, act_fused in zip(gemms, (True, False)):
            from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table

            args = {**kernel_side_table.get_constant_args(node.kwargs["constant_args_idx"]), **node.kwargs["kwargs"]}
            assert args["B_FP8"] and args["ACT_FUSED"] == act_fused and "bs_ptr" in node.kwargs["kwargs"]
            assert set(node.kwargs["tensors_to_clone"]) == {"c_ptr"}  # the fp8 weights and scales are only read
            _assert_every_parameter_passed(node)


def test_deepgemm_gemms_are_extern_calls_between_triton_launches(sm90, monkeypatch):
    from moe_fx.lowering.masked_experts import deepgemm

    # the shipped rule: bf16 weights run Triton's sorted layout on one GPU, at 128 rows per expert too
    gm = _trace(_experts, _inputs(FakeTensorMode(), t=512), caps=H200_DG)
    assert "deepgemm_masked_gemm" not in gm.code and [_kernel_name(n) for n in _launches(gm)] == list(KERNELS)
    monkeypatch.setattr(deepgemm, "LOCAL_FROM_REGIME", {False: 3, True: 3})  # DeepGEMM above 64 rows per expert
    gm = _trace(_experts, _inputs(FakeTensorMode(), t=512), caps=H200_DG)  # 128 rows per expert
    code = gm.code
    assert code.count("moe_fx_kernels.deepgemm_masked_gemm") == 2 and "moe_fx.experts" not in code
    assert [_kernel_name(n) for n in _launches(gm)] == ["permute_kernel", "activation_kernel", "unpermute_kernel"]
    # decode-sized (<= 4 rows per expert) and up to 64 rows per expert: Triton's GEMMs instead, under auto
    gm = _trace(_experts, _inputs(FakeTensorMode(), t=2), caps=H200_DG)
    assert "deepgemm_masked_gemm" not in gm.code and [_kernel_name(n) for n in _launches(gm)] == list(DECODE)
    gm = _trace(_experts, _inputs(FakeTensorMode(), t=64), caps=H200_DG)
    assert "deepgemm_masked_gemm" not in gm.code and [_kernel_name(n) for n in _launches(gm)] == list(KERNELS)


def test_dynamic_token_count_specialises_on_the_row_regime_only(sm90):
    from torch._dynamo.source import ConstantSource
    from torch.fx.experimental.symbolic_shapes import DimDynamic

    shape_env = ShapeEnv()
    mode = FakeTensorMode(shape_env=shape_env)
    inputs = _inputs(mode, t=64)
    sym = shape_env.create_symbol(64, ConstantSource("T"), dynamic_dim=DimDynamic.DYNAMIC)
    t = shape_env.create_symintnode(sym, hint=64)
    with mode:
        hidden = torch.empty(t, 256, dtype=torch.bfloat16, device="cuda")
        ids = torch.empty(t, 2, dtype=torch.int64, device="cuda")
        w = torch.empty(t, 2, device="cuda")
    gm = _trace(_experts, [hidden, ids, w, *inputs[3:]])
    assert [_kernel_name(n) for n in _launches(gm)] == list(KERNELS)
    guards = [str(g.expr) for g in shape_env.guards]
    # T stays symbolic: the rows-per-expert regime (ceil(64*2/8) = 16: 4 < rows <= 16) and the kernels'
    # int32 offset bounds are the only guards, none an equality
    assert not any("Eq(" in g or "==" in g for g in guards), guards
    assert any(g.endswith("> 4") for g in guards) and any(g.endswith("<= 16") for g in guards), guards


def test_reference_plans_keep_the_op(sm90):
    def ref(h, ids, w, w13, w2):
        return (torch.ops.moe_fx.experts(h, ids, w, w13, w2, kernel_choice="reference"),)

    gm = _trace(ref, _inputs(FakeTensorMode()))
    assert "moe_fx.experts" in gm.code and not _launches(gm)
    # activations no kernel has are left to the reference too
    def odd(h, ids, w, w13, w2):
        return (torch.ops.moe_fx.experts(h, ids, w, w13, w2, activation="relu2", alpha=1.0),)

    gm = _trace(odd, _inputs(FakeTensorMode()))
    assert len(_launches(gm)) == len(DECODE)  # relu2 has a kernel


def test_masked_experts_op_becomes_the_same_pipeline(sm90):
    mode = FakeTensorMode()
    with mode:
        x = torch.empty(8, 64, 256, device="cuda", dtype=torch.bfloat16)
        mm = torch.empty(8, device="cuda", dtype=torch.int32)
        w13 = torch.empty(8, 512, 256, device="cuda", dtype=torch.bfloat16)
        w2 = torch.empty(8, 256, 256, device="cuda", dtype=torch.bfloat16)

    def f(x, mm, w13, w2):
        return (torch.ops.moe_fx.masked_experts(x, mm, w13, w2),)

    gm = _trace(f, [x, mm, w13, w2])
    assert [_kernel_name(n) for n in _launches(gm)] == ["masked_gemm_kernel", "activation_kernel", "masked_gemm_kernel"]
    assert "moe_fx.masked_experts" not in gm.code
    for node in _launches(gm):
        _assert_every_parameter_passed(node)
        assert set(node.kwargs["tensors_to_clone"]) == {"c_ptr" if "gemm" in _kernel_name(node) else "y_ptr"}


def test_weights_with_dynamic_dims_specialise_them(sm90):
    """torch.compile(dynamic=True) of a function whose weights are inputs makes E, H, I symbolic too:
    the lowering pins them (kernel constants) and keeps T symbolic."""
    from torch._dynamo.source import ConstantSource
    from torch.fx.experimental.symbolic_shapes import DimDynamic

    shape_env = ShapeEnv()
    mode = FakeTensorMode(shape_env=shape_env)

    def sym(n, name):
        return shape_env.create_symintnode(
            shape_env.create_symbol(n, ConstantSource(name), dynamic_dim=DimDynamic.DYNAMIC), hint=n)

    t, e, h, i, k = sym(64, "T"), sym(8, "E"), sym(256, "H"), sym(256, "I"), sym(2, "K")
    with mode:
        inputs = [torch.empty(t, h, dtype=torch.bfloat16, device="cuda"),
                  torch.empty(t, k, dtype=torch.int64, device="cuda"), torch.empty(t, k, device="cuda"),
                  torch.empty(e, 2 * i, h, dtype=torch.bfloat16, device="cuda"),
                  torch.empty(e, h, i, dtype=torch.bfloat16, device="cuda")]
    gm = _trace(_experts, inputs)
    assert [_kernel_name(n) for n in _launches(gm)] == list(KERNELS)
    pinned = {str(g.expr) for g in shape_env.guards if "Eq(" in str(g.expr) or "==" in str(g.expr)}
    assert not any("T" in g for g in pinned), pinned


def _gemm_tiles(gm) -> list[tuple]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, SWAP_AB, DEVICE_TMA) of every GEMM launch in the graph."""
    return [tuple(n.kwargs["kwargs"][k] for k in ("BLOCK_M", "BLOCK_N", "BLOCK_K", "SWAP_AB", "DEVICE_TMA"))
            for n in _launches(gm) if "gemm" in _kernel_name(n)]


def _symbolic_inputs(hint):
    from torch._dynamo.source import ConstantSource
    from torch.fx.experimental.symbolic_shapes import DimDynamic

    shape_env = ShapeEnv()
    mode = FakeTensorMode(shape_env=shape_env)
    weights = _inputs(mode, t=hint)[3:]
    t = shape_env.create_symintnode(shape_env.create_symbol(hint, ConstantSource("T"), dynamic_dim=DimDynamic.DYNAMIC),
                                    hint=hint)
    with mode:
        hidden = torch.empty(t, 256, dtype=torch.bfloat16, device="cuda")
        ids = torch.empty(t, 2, dtype=torch.int64, device="cuda")
        w = torch.empty(t, 2, device="cuda")
    return [hidden, ids, w, *weights]


@pytest.mark.parametrize("pair", [True, False])
def test_dynamic_graph_tiles_are_the_regimes_not_the_traced_size(sm90, monkeypatch, pair):
    """The cause of the 1.7x "machine-to-machine" spread: a graph compiled for a dynamic T took its
    tiles from the T it was first traced with. Now the tiles are the regime's, whatever the hint, and
    the same as a static trace in that regime; the regime's table entry (device descriptors, swapped
    decode tiles) reaches the generated launches."""
    from moe_fx.lowering.triton import configs, grouped_gemm

    monkeypatch.setattr(grouped_gemm, "PAIR_GATE_UP", pair)

    table = {"NVIDIA H200|bf16|N512|K256|sorted|r2": {"block_m": 64, "block_n": 128, "block_k": 64, "tma": True},
             "NVIDIA H200|bf16|N256|K256|sorted|r2": {"block_m": 32, "block_n": 64, "block_k": 128, "swap_ab": True}}
    monkeypatch.setattr(configs, "_shipped", lambda: table)
    monkeypatch.setattr(configs, "_memory", {})
    monkeypatch.setattr(configs, "_disk_loaded", {})
    # rows per expert ceil(T * 2 / 8): T=80 -> 20, T=256 -> 64, both in regime 2 (17..64)
    tiles = {_gemm_tiles(_trace(_experts, _symbolic_inputs(hint)))[0] for hint in (80, 256)}
    static = _gemm_tiles(_trace(_experts, _inputs(FakeTensorMode(), t=200)))
    # GEMM1 applies the gated activation in its epilogue: the tuned 128 columns of gate/up rows are one tile of 64
    # gate and 64 up rows (PAIR_GATE_UP), or two accumulators of 64 columns (grouped_gemm._split_columns); the
    # swapped GEMM2 tile is kept
    gemm1 = (64, 128, 64, False, True) if pair else (64, 64, 64, False, True)
    assert tiles == {static[0]} and static == [gemm1, (32, 64, 128, True, False)], (tiles, static)
    gm = _trace(_experts, _inputs(FakeTensorMode(), t=200))
    for node in _launches(gm):  # descriptors made in the kernel are no write of the weights or tokens
        if "gemm" in _kernel_name(node):
            assert set(node.kwargs["tensors_to_clone"]) == {"c_ptr"}, node.kwargs["tensors_to_clone"]


def test_cpp_wrapper_graphs_load_tiles_through_pointers(sm90, monkeypatch):
    """A graph Inductor compiles with its C++ wrapper gets no kernel that makes TMA descriptors on the device (torch
    2.11's C++ wrapper gives such kernels no fitting global scratch: an illegal memory access on an H100): the
    regime's TMA tile loads through pointers there, same tile; the Python wrapper's graph keeps the descriptors."""
    from torch._inductor import config as inductor_config

    from moe_fx.lowering.triton import configs

    table = {"NVIDIA H200|bf16|N512|K256|sorted|r2": {"block_m": 64, "block_n": 128, "block_k": 64, "tma": True}}
    monkeypatch.setattr(configs, "_shipped", lambda: table)
    monkeypatch.setattr(configs, "_memory", {})
    monkeypatch.setattr(configs, "_disk_loaded", {})
    python = _gemm_tiles(_trace(_experts, _inputs(FakeTensorMode(), t=200)))
    with inductor_config.patch(cpp_wrapper=True):
        cpp = _gemm_tiles(_trace(_experts, _inputs(FakeTensorMode(), t=200)))
    assert python[0][4] is True and cpp[0][4] is False, (python, cpp)
    assert [t[:4] for t in cpp] == [t[:4] for t in python]
    assert not any(t[4] for t in cpp)


def test_one_token_runs_without_a_sort(sm90):
    """Dynamo specialises one token: its graph launches GEMM1 and GEMM2 on rows in slot order (their SLOTS mode, the
    ids read in place) and the combine (SLOT_ROWS): no sort kernel, each kernel writing only its output."""
    gm = _trace(_experts, _inputs(FakeTensorMode(), t=1))
    launches = _launches(gm)
    assert [_kernel_name(n) for n in launches] == ["masked_gemm_kernel", "masked_gemm_kernel", "unpermute_kernel"]
    gemm1, gemm2, combine = launches
    assert gemm1.kwargs["kwargs"]["SLOTS"] and gemm2.kwargs["kwargs"]["SLOTS"] and combine.kwargs["kwargs"]["SLOT_ROWS"]
    assert gemm1.kwargs["kwargs"]["ACT_FUSED"]
    for node, out in ((gemm1, "c_ptr"), (gemm2, "c_ptr"), (combine, "out_ptr")):
        assert set(node.kwargs["tensors_to_clone"]) == {out}, node.kwargs["tensors_to_clone"]
        _assert_every_parameter_passed(node)
    # fp8 weights keep the sort, whose launch quantises the token
    fp8 = _trace(_experts_fp8, _inputs(FakeTensorMode(), t=1, fp8=True))
    assert _kernel_name(_launches(fp8)[0]) == "sort_small_kernel"


def test_one_token_can_run_down_and_combine_in_one_launch(sm90, monkeypatch):
    """``pipeline.SLOT_DOWN_COMBINE``: one token's graph launches GEMM1 (SLOTS, activation in its epilogue) and
    ``slot_down_combine_kernel`` (GEMM2 and the combine): two launches, each writing only its output; with the
    combine left to Inductor as well, the combine stays Inductor's and GEMM2 its own launch."""
    from moe_fx.lowering.masked_experts import pipeline

    monkeypatch.setattr(pipeline, "SLOT_DOWN_COMBINE", True)
    launches = _launches(_trace(_experts, _inputs(FakeTensorMode(), t=1)))
    assert [_kernel_name(n) for n in launches] == ["masked_gemm_kernel", "slot_down_combine_kernel"]
    for node, out in zip(launches, ("c_ptr", "out_ptr")):
        assert set(node.kwargs["tensors_to_clone"]) == {out}, node.kwargs["tensors_to_clone"]
        _assert_every_parameter_passed(node)
    monkeypatch.setattr(pipeline, "COMBINE_IN_GRAPH", True)
    launches = _launches(_trace(_experts, _inputs(FakeTensorMode(), t=1)))
    assert [_kernel_name(n) for n in launches] == ["masked_gemm_kernel", "masked_gemm_kernel"]


def test_decode_combine_can_be_left_to_inductor(sm90, monkeypatch):
    """``pipeline.COMBINE_IN_GRAPH``: a decode-sized call's combine (regime 0) traces as torch ops (a masked, weighted
    fp32 sum over K; the sorted rows gathered by ``index_select``), which Inductor fuses with what follows: one token
    launches the two GEMMs only, 16 tokens (4 rows per expert) the sort and the GEMMs, fp8 weights the quantising
    sort and the GEMMs; 64 tokens (16 rows per expert) keep the combine kernel."""
    from moe_fx.lowering.masked_experts import pipeline

    monkeypatch.setattr(pipeline, "COMBINE_IN_GRAPH", True)

    def sums(gm):
        return [n.args[1] for n in gm.graph.nodes if n.target is torch.ops.aten.sum.dim_IntList]

    one = _trace(_experts, _inputs(FakeTensorMode(), t=1))
    assert [_kernel_name(n) for n in _launches(one)] == ["masked_gemm_kernel", "masked_gemm_kernel"]
    assert sums(one) == [[1]] and "moe_fx.experts" not in one.code  # one sum, over K
    decode = _trace(_experts, _inputs(FakeTensorMode(), t=16))
    assert [_kernel_name(n) for n in _launches(decode)] == list(DECODE[:-1])
    assert sums(decode) == [[1]] and "index_select" in decode.code
    fp8 = _trace(_experts_fp8, _inputs(FakeTensorMode(), t=1, fp8=True))
    assert [_kernel_name(n) for n in _launches(fp8)] == ["sort_small_kernel", "masked_gemm_fp8_kernel",
                                                         "activation_kernel", "masked_gemm_fp8_kernel"]
    prefill = _trace(_experts, _inputs(FakeTensorMode(), t=64))
    assert [_kernel_name(n) for n in _launches(prefill)] == list(KERNELS) and sums(prefill) == []


def test_static_graph_runs_its_sizes_own_tile_and_a_dynamic_one_the_regimes(sm90, monkeypatch):
    """A static token count (Dynamo always specialises T=1) launches the tile tuned for its exact slot count
    (``...|s<T*K>`` entries); a graph with a symbolic T never does, whatever size it was traced with."""
    from moe_fx.lowering.triton import configs

    regime = {"block_m": 32, "block_n": 64, "block_k": 128, "swap_ab": True}
    own = {"block_m": 16, "block_n": 128, "block_k": 128, "num_stages": 3, "programs_per_sm": 3}
    table = {"NVIDIA H200|bf16|N256|K256|sorted|r2": regime, "NVIDIA H200|bf16|N256|K256|sorted|r2|s400": own}
    monkeypatch.setattr(configs, "_shipped", lambda: table)
    monkeypatch.setattr(configs, "_memory", {})
    monkeypatch.setattr(configs, "_disk_loaded", {})
    # T=200, K=2: 400 slots, 50 rows per expert (regime 2); GEMM2 (N=256, K=256) reads the table
    static = _gemm_tiles(_trace(_experts, _inputs(FakeTensorMode(), t=200)))[1]
    other = _gemm_tiles(_trace(_experts, _inputs(FakeTensorMode(), t=160)))[1]
    dynamic = _gemm_tiles(_trace(_experts, _symbolic_inputs(200)))[1]
    assert static == (16, 128, 128, False, False), static
    assert other == dynamic == (32, 64, 128, True, False), (other, dynamic)


@pytest.mark.parametrize("fp8", [False, True])
def test_flattened_tiles_reach_the_launch_and_write_only_their_outputs(sm90, monkeypatch, fp8):
    """A regime tile with ``flatten`` launches its GEMMs with FLATTEN (one pipeline over a program's tiles), and
    Inductor's analysis of the flattened kernel still finds that it writes only ``c`` (no copy of the weights)."""
    from moe_fx.lowering.triton import configs

    flat = {"block_m": 64, "block_n": 128, "block_k": 128, "num_warps": 4, "num_stages": 3, "flatten": True}
    kind = "fp8" if fp8 else "bf16"
    # T=200, K=2, E=8: 50 rows per expert (regime 2); GEMM1 is 512 x 256, GEMM2 256 x 256
    table = {f"NVIDIA H200|{kind}|N{n}|K256|sorted|r2": flat for n in (256, 512)}
    monkeypatch.setattr(configs, "_shipped", lambda: table)
    monkeypatch.setattr(configs, "_memory", {})
    monkeypatch.setattr(configs, "_disk_loaded", {})
    inputs = _inputs(FakeTensorMode(), t=200, fp8=fp8)
    gm = _trace(_experts_fp8 if fp8 else _experts, inputs)
    gemms = [n for n in _launches(gm) if "gemm" in _kernel_name(n)]
    assert len(gemms) == 2
    for node in gemms:
        assert node.kwargs["kwargs"]["FLATTEN"] is True and node.kwargs["kwargs"]["BLOCK_M"] == 64
        assert set(node.kwargs["tensors_to_clone"]) == {"c_ptr"}, node.kwargs["tensors_to_clone"]
        _assert_every_parameter_passed(node)


@pytest.mark.parametrize("pair", [True, False])
def test_persistent_grids_are_sized_for_the_programs_that_fit(sm90, monkeypatch, pair):
    """A swapped 16x64x128 tile of 2 programs per SM (4 stages) takes 80 KB per program as GEMM2, 147 KB as GEMM1
    with gate/up halves in two accumulators (two weight tiles per k step): that GEMM1's grid is sized for one program
    per SM (the second half would run as a second wave), GEMM2's for two; paired gate/up rows (one weight tile,
    PAIR_GATE_UP) keep two. A symbolic token count gives full grids."""
    from moe_fx.lowering.triton import configs, grouped_gemm

    monkeypatch.setattr(grouped_gemm, "PAIR_GATE_UP", pair)

    swapped = {"block_m": 16, "block_n": 64, "block_k": 128, "num_warps": 4, "num_stages": 4, "programs_per_sm": 2,
               "swap_ab": True}
    table = {f"NVIDIA H200|bf16|N{n}|K256|sorted|r0": swapped for n in (256, 512)}
    monkeypatch.setattr(configs, "_shipped", lambda: table)
    monkeypatch.setattr(configs, "_memory", {})
    monkeypatch.setattr(configs, "_disk_loaded", {})
    gm = _trace(_experts, _symbolic_inputs(2))  # 2 tokens, top-2 of 8: rows per expert <= 4
    grids = [(n.kwargs["kwargs"].get("ACT_FUSED"), n.kwargs["grid"][0][0]) for n in _launches(gm)
             if "gemm" in _kernel_name(n)]
    assert grids == [(True, 264 if pair else 132), (False, 264)], grids


def test_activation_epilogue_where_it_measured_faster(sm90, monkeypatch):
    """Gate/up halves take GEMM1's activation epilogue at every size (it measured faster at prefill sizes too,
    2026-12-06), so no activation kernel is launched; under a rows bound (``FUSE_HALVES_MAX_ROWS``, what a bench A/B
    sets) they take the separate kernel above it. Interleaved gate/up (GPT-OSS) take it at every size."""
    prefill = ("expert_counts_kernel", "sort_slots_kernel", "masked_gemm_kernel", "activation_kernel",
               "masked_gemm_kernel", "unpermute_kernel")
    # T=2048, K=2, E=8: 512 rows per expert (the last regime)
    gm = _trace(_experts, _inputs(FakeTensorMode(), t=2048))
    assert tuple(_kernel_name(n) for n in _launches(gm)) == KERNELS
    assert _launches(gm)[2].kwargs["kwargs"]["ACT_FUSED"]
    monkeypatch.setattr(pipeline, "FUSE_HALVES_MAX_ROWS", 64)
    gm = _trace(_experts, _inputs(FakeTensorMode(), t=2048))
    assert tuple(_kernel_name(n) for n in _launches(gm)) == prefill

    def gpt_oss(h, ids, w, w13, w2):
        return (torch.ops.moe_fx.experts(h, ids, w, w13, w2, gate_up_layout="interleaved", alpha=1.702, limit=7.0,
                                         up_offset=1.0),)

    gm = _trace(gpt_oss, _inputs(FakeTensorMode(), t=2048))
    assert tuple(_kernel_name(n) for n in _launches(gm)) == KERNELS
    gemm1 = _launches(gm)[2].kwargs["kwargs"]
    assert gemm1["ACT_FUSED"] and gemm1["INTERLEAVED"] and gemm1["HAS_LIMIT"]


def _allocated(gm) -> dict[str, int]:
    """Bytes of every buffer the lowered graph allocates, by role: ``rows`` (the per-slot activations, 3-D),
    ``index`` (sort outputs and scratch) and ``out`` (the op's [T, H] result)."""
    out = {"rows": 0, "index": 0, "out": 0}
    for n in gm.graph.nodes:
        if n.op != "call_function" or n.target not in (torch.ops.aten.empty.memory_format, torch.ops.aten.zeros.default):
            continue
        v = n.meta["val"]
        size = v.numel() * v.element_size()
        out["rows" if v.dim() == 3 else "out" if v.dim() == 2 else "index"] += size
    return out


@pytest.mark.parametrize("t", [1024, 16384])
def test_transient_memory_is_the_contiguous_layouts_bound(sm90, t):
    """One Qwen3-30B-A3B layer (E=128, K=8, H=2048, I=768): the sorted layout allocates T*K rows of
    GEMM1's product, the activation and GEMM2's output, no more (the contiguous layout's bound, issue 16);
    with the activation in GEMM1's epilogue (the shipped choice at every size) GEMM1's product is not stored."""
    e, k, h, i = 128, 8, 2048, 768
    gm = _trace(_experts, _inputs(FakeTensorMode(), t=t, h=h, i=i, e=e, k=k))
    slots = t * k
    got = _allocated(gm)
    assert got["rows"] == slots * (i + h) * 2, got
    assert got["index"] == slots * (4 + 8) + (2 * e + 1) * 4 and got["out"] == t * h * 2, got


def _layers(n: int) -> fx.GraphModule:
    """``n`` experts layers in a row, each with its own weights: ``(hidden, ids, w, w13_0, w2_0, ...) -> (out,)``."""
    graph = fx.Graph()
    out, ids, w = (graph.placeholder(name) for name in ("hidden", "ids", "w"))
    for i in range(n):
        w13, w2 = graph.placeholder(f"w13_{i}"), graph.placeholder(f"w2_{i}")
        y = graph.call_function(torch.ops.moe_fx.experts.default, (out, ids, w, w13, w2), {"kernel_choice": "triton"})
        out = graph.call_function(torch.add, (out, y))
    graph.output((out,))
    return fx.GraphModule(torch.nn.Module(), graph)


def _layer_inputs(n: int, t: int):
    mode = FakeTensorMode(shape_env=ShapeEnv())
    first = _inputs(mode, t=t, h=256, i=384, e=16, k=4)
    return first + [w for _ in range(n - 1) for w in _inputs(mode, t=t, h=256, i=384, e=16, k=4)[3:5]]


def _writes(gm: fx.GraphModule) -> list[tuple[str, tuple[str, ...]]]:
    return [(_kernel_name(n), tuple(sorted(n.kwargs["tensors_to_clone"]))) for n in _launches(gm)]


@pytest.mark.parametrize("t", [1, 64])
def test_kernel_access_analysis_runs_once_per_specialisation(sm90, monkeypatch, t):
    """torch analyses which buffers each traced kernel launch writes by generating its Triton IR, for every launch;
    moe_fx's memo (lowering/triton/access_analysis.py) makes that once per kernel specialisation, not once per
    layer, and the graph is the one torch's analysis of every launch gives."""
    import torch._higher_order_ops.triton_kernel_wrap as tkw

    from moe_fx.lowering.triton import access_analysis

    access_analysis.install()
    name = next(a for a in access_analysis.ANALYSES if hasattr(getattr(tkw, a, None), "moe_fx_memo"))
    torch_analysis = getattr(tkw, name).moe_fx_wrapped
    analysed = []

    def counted(kernel, *args):
        analysed.append(kernel)
        return torch_analysis(kernel, *args)

    monkeypatch.setattr(tkw, name, access_analysis._memoised(counted))  # a fresh memo in front of a counter
    gm = _trace(_layers(4), _layer_inputs(4, t))
    launches = _launches(gm)
    per_layer = len(launches) // 4
    assert per_layer >= 3 and len(launches) == 4 * per_layer
    assert len(analysed) == per_layer  # each launch of the first layer (all distinct), none of the other layers
    monkeypatch.setattr(tkw, name, counted)  # torch's analysis of every launch
    analysed.clear()
    plain = _trace(_layers(4), _layer_inputs(4, t))
    assert len(analysed) == 2 * len(launches)  # AOTAutograd's two passes, every launch
    assert _writes(plain) == _writes(gm)


def test_kernel_access_memo_keys_only_what_the_ir_reads(sm90):
    """The memo's key: moe_fx's kernels only, by what torch's IR generation reads (a tensor's dtype, a symbolic size,
    any other value itself); a tensor descriptor or an argument a key cannot hold is never memoised."""
    import triton

    from moe_fx.lowering.triton._loader import kernels
    from moe_fx.lowering.triton.access_analysis import analysis_key

    @triton.jit
    def user_kernel(x_ptr, n):
        pass

    kernel = kernels(torch.device("cuda")).unpermute_kernel
    with FakeTensorMode(shape_env=ShapeEnv()) as mode:
        a, b = torch.empty(4, device="cuda"), torch.empty(8, 2, device="cuda")
        c = torch.empty(4, device="cuda", dtype=torch.bfloat16)
        sym = mode.shape_env.create_unbacked_symint()
    assert analysis_key(user_kernel, {"x_ptr": a, "n": 4}, {}) is None
    assert analysis_key(kernel, {"y_ptr": a, "k": 4}, {}) == analysis_key(kernel, {"y_ptr": b, "k": 4}, {})
    assert analysis_key(kernel, {"y_ptr": a, "k": 4}, {}) != analysis_key(kernel, {"y_ptr": c, "k": 4}, {})
    assert analysis_key(kernel, {"y_ptr": a, "k": 4}, {}) != analysis_key(kernel, {"y_ptr": a, "k": 1}, {})
    assert analysis_key(kernel, {"y_ptr": a, "k": sym}, {}) is not None
    assert analysis_key(kernel, {"y_ptr": a, "k": [4]}, {}) is None
    assert analysis_key(kernel, {"y_ptr": a, "k": 4}, {"y_ptr": ("stable", ([16],))}) is None
