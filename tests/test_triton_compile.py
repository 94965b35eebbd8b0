"""Compile every Triton kernel for Hopper (sm_90) on a machine without a GPU.

The CPU tests run the kernels under the interpreter, which accepts code the compiler rejects (a
non-constexpr global, say) and never shows whether the main loops are pipelined. This test runs
Triton's real compiler down to PTX for sm_90 with the specialisation a launch on contiguous
tensors gets (unit strides as constants, 16-divisible sizes) and checks the GEMMs' structure:
Hopper MMA (wgmma) for 64+ row tiles, async copies (pipelined loads), no local-memory spills.
"""

from __future__ import annotations

import re

import pytest
import torch

triton = pytest.importorskip("triton")

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-side compile check (GPU runs the kernels)")


def _compile(fn, types: dict, consts: dict, warps: int = 4, stages: int = 3):
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig, attrs = {}, {}
    names = list(fn.arg_names)
    for idx, name in enumerate(names):
        if name in consts:
            sig[name] = "constexpr"
        else:
            sig[name] = types.get(name, "i32")
            if sig[name].startswith("tensordesc"):
                continue
            if name.endswith("_ptr") or name.startswith("s_") or name in ("N", "K", "H", "I"):
                attrs[(idx,)] = [["tt.divisibility", 16]]
    try:
        src = ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs)
        return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": stages})
    except (TypeError, ImportError, FileNotFoundError) as err:  # other triton API / no ptxas in this install
        pytest.skip(f"cannot compile for sm_90 here: {err}")


def _kernels():
    import moe_fx.lowering.triton._kernels as k

    return k


GEMM = {"GROUP_M": 8, "E_POW2": 128, "EVEN_K": True, "UPCAST": False, "s_ak": 1, "s_bk": 1, "s_cn": 1,
        "bias_ptr": None, "HAS_BIAS": False, "sorted_ptr": None, "rw_ptr": None, "SORTED": False, "GATHER_A": False,
        "TOPK": 1, "ROUTE_W": False, "SWAP_AB": False, "DEVICE_TMA": False, "FLATTEN": False}
#: masked_gemm_kernel's epilogue activation and fp8 weights off (the bf16 kernel's extra constants)
NO_ACT = {"ACT_FUSED": False, "ACT": 0, "GATED": False, "INTERLEAVED": False, "HAS_LIMIT": False, "B_FP8": False,
          "bs_ptr": None, "SLOTS": False, "ids_ptr": None, "PAIR_HALVES": False}
#: Inductor types Python float arguments as fp64 (seen on torch 2.11): the kernels must compile with those
ACT_FLOATS = {"alpha": "fp64", "limit": "fp64", "up_offset": "fp64"}


@pytest.mark.parametrize(
    "fp8,bm,bn,bk,warps,stages,tma",
    [
        (False, 128, 256, 64, 8, 3, False),
        (False, 128, 256, 64, 8, 3, True),
        (False, 16, 64, 128, 4, 4, False),
        (True, 128, 128, 128, 8, 4, False),
        (True, 128, 128, 128, 4, 3, True),
        (True, 128, 256, 128, 8, 3, True),
        (True, 16, 32, 128, 4, 5, False),
    ],
)
def test_gemm_compiles_pipelined(fp8, bm, bn, bk, warps, stages, tma):
    k = _kernels()
    consts = dict(GEMM, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, TMA=tma)
    elem = "fp8e4nv" if fp8 else "bf16"
    if tma:
        types = {"a_ptr": f"tensordesc<{elem}[1, {bm}, {bk}]>", "b_ptr": f"tensordesc<{elem}[1, {bn}, {bk}]>"}
    else:
        types = {"a_ptr": f"*{elem}", "b_ptr": f"*{elem}"}
    types["c_ptr"] = "*bf16"
    if fp8:
        fn = k.masked_gemm_fp8_kernel
        types.update({"as_ptr": "*fp32", "bs_ptr": "*fp32"})
        consts["s_ask"] = 1
        consts["SCALAR_BS"] = bn <= 128
        consts["PREFETCH_SCALES"] = True
    else:
        fn = k.masked_gemm_kernel
        consts.update(IEEE=False, **NO_ACT)
        types.update(ACT_FLOATS)
    types["masked_m_ptr"] = "*i32"
    ptx = _compile(fn, types, consts, warps, stages).asm["ptx"]
    if tma:
        assert "cp.async.bulk.tensor" in ptx, "TMA loads expected"
    else:
        assert "cp.async" in ptx, "main loop not pipelined (no async copies)"
    assert ("wgmma.mma_async" in ptx) == (bm >= 64), "Hopper MMA expected exactly for 64+ row tiles"
    assert "ld.local" not in ptx and "st.local" not in ptx, "register spills"
    if fp8 and bm >= 64:
        # Promotion of each k step: one FMA per accumulator element a thread holds when b's scale
        # is one value per tile, plus one multiply per element (the outer product of the scales)
        # when it varies per column. More would mean the scale product is recomputed per element.
        per_thread = bm * bn // (32 * warps)
        fma, mul = ptx.count("fma.rn.f32"), ptx.count("mul.f32")
        assert fma == per_thread, (fma, per_thread)
        assert mul <= (per_thread if bn > 128 else 8), (mul, per_thread)


def test_gemm_bias_epilogue_compiles_pipelined():
    k = _kernels()
    consts = dict(GEMM, BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, TMA=False, IEEE=False, HAS_BIAS=True, **NO_ACT)
    del consts["bias_ptr"]
    types = {"a_ptr": "*bf16", "b_ptr": "*bf16", "c_ptr": "*bf16", "masked_m_ptr": "*i32", "bias_ptr": "*bf16",
             **ACT_FLOATS}
    ptx = _compile(k.masked_gemm_kernel, types, consts, 8, 3).asm["ptx"]
    assert "cp.async" in ptx and "wgmma.mma_async" in ptx and "ld.local" not in ptx


@pytest.mark.parametrize("quant", [False, True])
@pytest.mark.parametrize("gpt_oss", [False, True])
def test_elementwise_kernels_compile(quant, gpt_oss):
    k = _kernels()
    out_t = "*fp8e4nv" if quant else "*bf16"
    act = {"ACT": 0, "GATED": True, "INTERLEAVED": gpt_oss, "HAS_LIMIT": gpt_oss, "HAS_BIAS": gpt_oss}
    # Inductor types Python float arguments as fp64 (seen on torch 2.11): the kernel must compile with those
    types = {"x_ptr": "*bf16", "y_ptr": out_t, "masked_m_ptr": "*i32", "alpha": "fp64", "limit": "fp64",
             "up_offset": "fp64"}
    consts = {**act, "QUANT": quant, "INTERP": False, "BLOCK_M": 16, "BLOCK_N": 128, "E_POW2": 128}
    if quant:
        types["ys_ptr"] = "*fp32"
    else:
        consts["ys_ptr"] = None
    if gpt_oss:
        types["bias_ptr"] = "*bf16"
    else:
        consts["bias_ptr"] = None
    _compile(k.activation_kernel, types, consts)
    types = {"h_ptr": "*bf16", "ids_ptr": "*i64", "counts_ptr": "*i32", "x_ptr": out_t, "pos_ptr": "*i64"}
    consts = {"K_POW2": 8, "BLOCK_H": 1024, "WEIGHTS_ON_INPUT": quant, "DEDUPE": not quant,
              "QUANT": quant, "INTERP": False}
    for name, present, t in (("w_ptr", quant, "*fp32"), ("xs_ptr", quant, "*fp32")):
        if present:
            types[name] = t
        else:
            consts[name] = None
    ptx = _compile(k.permute_kernel, types, consts).asm["ptx"]
    assert "ld.local" not in ptx and "st.local" not in ptx  # 1024 columns a step (fp8: 8 groups), no spills
    types = {"y_ptr": "*bf16", "pos_ptr": "*i64", "w_ptr": "*fp32", "out_ptr": "*bf16"}
    consts = {"K_POW2": 8, "BLOCK_H": 1024, "HAS_W": not quant, "IDENTITY": gpt_oss, "SLOT_ROWS": False}
    if gpt_oss:
        types.update({"ids_ptr": "*i64", "h_ptr": "*bf16"})
    else:
        consts.update({"ids_ptr": None, "h_ptr": None})
    _compile(k.unpermute_kernel, types, consts)


def _sorted_gemm(fp8: bool, gather: bool, route_w: bool = False, act: dict | None = None, **consts):
    """(kernel, types, constants) of a sorted-layout GEMM launch on contiguous tensors (``act``: the bf16
    kernel's constants that differ from :data:`NO_ACT`: the epilogue activation, ``B_FP8`` fp8 weights)."""
    k = _kernels()
    consts = dict(GEMM, TMA=False, SORTED=True, GATHER_A=gather, TOPK=8, ROUTE_W=route_w, s_ag=0, s_cg=0, **consts)
    elem = "fp8e4nv" if fp8 else "bf16"
    types = {"a_ptr": f"*{elem}", "b_ptr": f"*{elem}", "c_ptr": "*bf16", "masked_m_ptr": "*i32"}
    for name, on, t in (("sorted_ptr", gather, "*i32"), ("rw_ptr", route_w, "*fp32")):
        if on:
            types[name] = t
            del consts[name]
    if fp8:
        types.update({"as_ptr": "*fp32", "bs_ptr": "*fp32"})
        consts.update(s_ask=1, s_asg=0, SCALAR_BS=consts["BLOCK_N"] <= 128, PREFETCH_SCALES=True)
        return k.masked_gemm_fp8_kernel, types, consts
    consts.update(IEEE=False, **{**NO_ACT, **(act or {})})
    if consts["B_FP8"]:  # fp8 weights with their block scales (W8A16)
        types.update({"b_ptr": "*fp8e4nv", "bs_ptr": "*fp32"})
        del consts["bs_ptr"]
    types.update(ACT_FLOATS)
    return k.masked_gemm_kernel, types, consts


@pytest.mark.parametrize(
    "fp8,bm,bn,bk,warps,stages,gather,route_w",
    [
        (False, 128, 256, 64, 8, 3, True, False),   # GEMM1 of the sorted layout: tokens gathered
        (False, 128, 256, 64, 8, 3, False, False),  # GEMM2: contiguous sorted rows
        (False, 16, 64, 128, 4, 4, True, True),     # decode tile, weights on the input
        (True, 128, 128, 128, 8, 4, True, False),
        (True, 64, 128, 128, 4, 4, False, False),
    ],
)
def test_sorted_gemm_compiles_pipelined(fp8, bm, bn, bk, warps, stages, gather, route_w):
    """The contiguous layout's modes of the GEMM kernels: still pipelined, wgmma, no spills."""
    fn, types, consts = _sorted_gemm(fp8, gather, route_w, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk)
    ptx = _compile(fn, types, consts, warps, stages).asm["ptx"]
    assert "cp.async" in ptx, "main loop not pipelined (no async copies)"
    assert ("wgmma.mma_async" in ptx) == (bm >= 64)
    assert "ld.local" not in ptx and "st.local" not in ptx, "register spills"


@pytest.mark.parametrize("fp8", [False, True])
def test_flattened_regime_candidates_compile_to_one_pipelined_loop(fp8):
    """Every ``flatten`` tile that tuning may ship, compiled with its warps and stages: the tile loop and the k loop
    are one loop (no nested loop left), still async copies and wgmma, no spills, and the shared memory it asks for
    within :meth:`TileConfig.smem_bytes` (plus barriers), whose programs per SM must fit side by side."""
    from moe_fx.lowering.triton.configs import regime_candidates

    kind = "fp8" if fp8 else "bf16"
    flat = {c for regime in range(5) for c in regime_candidates(kind, regime) if c.flatten}
    assert len(flat) >= 5
    for cfg in sorted(flat, key=str):
        gather = not cfg.tma  # GEMM1 gathers its tokens through pointers; GEMM2 reads sorted rows (descriptors)
        fn, types, consts = _sorted_gemm(fp8, gather, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k)
        consts.update(GROUP_M=cfg.group_m, TMA=cfg.tma, DEVICE_TMA=cfg.tma, SWAP_AB=cfg.swap_ab, FLATTEN=True)
        compiled = _compile(fn, types, consts, cfg.num_warps, cfg.num_stages)
        ptx = compiled.asm["ptx"]
        assert "Depth=2" not in ptx, (cfg, "the tile loop still holds a k loop")
        assert ("cp.async.bulk.tensor" if cfg.tma else "cp.async") in ptx, cfg
        assert ("wgmma.mma_async" in ptx) == (cfg.block_m >= 64 or cfg.swap_ab), cfg  # 16-row tiles: mma
        _assert_fits(compiled, cfg, fp8)


def _assert_fits(compiled, cfg, fp8: bool) -> None:
    """``compiled`` (``cfg``'s tile for sm_90) spills no registers, asks for no more shared memory than
    :meth:`TileConfig.smem_bytes` (plus barriers), which ``configs.fit_smem`` sizes the stages by, and its programs per
    SM fit side by side in an SM's shared memory."""
    from moe_fx.lowering.triton.configs import BLOCK_RESERVED_SMEM, SM_SMEM

    ptx = compiled.asm["ptx"]
    assert "ld.local" not in ptx and "st.local" not in ptx, (cfg, "register spills")
    shared, estimate = compiled.metadata.shared, cfg.smem_bytes(1 if fp8 else 2)
    assert shared <= estimate + 1024, (cfg, shared, estimate)
    assert (shared + BLOCK_RESERVED_SMEM) * cfg.programs_per_sm <= SM_SMEM, (cfg, shared)


@pytest.mark.parametrize("kind", ["bf16", "fp8"])
def test_prefill_regime_candidates_compile_within_their_shared_memory(kind):
    """Every tile tuning may ship for more than 64 rows per expert (one program per SM; the flattened and the
    several-program tiles have their own tests), compiled with its warps and stages as GEMM1 (tokens gathered) and
    GEMM2 (sorted rows) launch it: pipelined loads, wgmma, and the fit of :func:`_assert_fits`."""
    from moe_fx.lowering.problem import regime_bounds
    from moe_fx.lowering.triton.configs import regime_candidates

    fp8 = kind == "fp8"
    tiles = {c for regime in range(5) if (regime_bounds(regime)[1] or 65) > 64
             for c in regime_candidates(kind, regime) if not c.flatten and c.programs_per_sm == 1}
    assert tiles
    for cfg in sorted(tiles, key=str):
        for gather in (True, False):
            fn, types, consts = _sorted_gemm(fp8, gather, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
                                             BLOCK_K=cfg.block_k)
            consts.update(GROUP_M=cfg.group_m, TMA=cfg.tma, DEVICE_TMA=cfg.tma, SWAP_AB=cfg.swap_ab)
            compiled = _compile(fn, types, consts, cfg.num_warps, cfg.num_stages)
            ptx = compiled.asm["ptx"]
            assert "cp.async" in ptx and "wgmma.mma_async" in ptx, (cfg, gather)
            _assert_fits(compiled, cfg, fp8)


def _registers(compiled) -> int:
    """Registers a thread of ``compiled`` (an sm_90 build) takes, read from its cubin by triton's own cuobjdump."""
    import os
    import subprocess
    import tempfile

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    if not os.path.exists(tool):
        pytest.skip(f"no cuobjdump in this triton ({tool})")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        out = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True, text=True, check=True).stdout
    return int(re.search(r"REG:(\d+)", out).group(1))


#: an sm_90 SM: 64K registers, allocated per warp in steps of 8 a thread; 228 KB of shared memory, 1 KB of it
#: reserved per resident program
SM_REGISTERS, SM_SHARED, PROGRAM_RESERVED = 65536, 233472, 1024


@pytest.mark.parametrize("kind", ["bf16", "fp8"])
def test_regime_candidates_fit_their_programs_per_sm(kind):
    """A persistent grid is sized for the programs per SM its launch expects (:func:`configs.resident_programs`: the
    tile's ``programs_per_sm``, fewer where the launched tiles' shared memory does not fit them); if they do not fit
    side by side (registers or shared memory of the kernel as compiled), the rest of the grid runs as a second wave.
    Every candidate of several programs, compiled with its warps and stages as the pipeline launches it (bf16 GEMM1
    up to 64 rows per expert with gate/up halves in its epilogue: a swapped tile then loads two weight tiles per k
    step; GEMM2 plain)."""
    from moe_fx.lowering.triton.configs import regime_candidates, resident_programs

    fp8 = kind == "fp8"
    halves = {"ACT_FUSED": True, "ACT": 0, "GATED": True, "PAIR_HALVES": True}  # grouped_gemm.PAIR_GATE_UP
    seen = set()
    for regime in range(5):
        for cfg in regime_candidates(kind, regime):
            fused = not fp8 and regime <= 2
            if cfg.programs_per_sm == 1 or (cfg, fused) in seen:
                continue
            seen.add((cfg, fused))
            for gather, act in ((True, halves if fused else None), (False, None)):
                block_n = cfg.block_n  # a paired tile keeps the unfused tile (no grouped_gemm._split_columns)
                fn, types, consts = _sorted_gemm(fp8, gather, act=act, BLOCK_M=cfg.block_m, BLOCK_N=block_n,
                                                 BLOCK_K=cfg.block_k)
                consts.update(GROUP_M=cfg.group_m, TMA=cfg.tma, DEVICE_TMA=cfg.tma, SWAP_AB=cfg.swap_ab,
                              FLATTEN=cfg.flatten)
                compiled = _compile(fn, types, consts, cfg.num_warps, cfg.num_stages)
                regs = (_registers(compiled) + 7) // 8 * 8
                by_regs = SM_REGISTERS // (regs * 32 * cfg.num_warps)
                by_smem = SM_SHARED // (compiled.metadata.shared + PROGRAM_RESERVED)
                expected = resident_programs(cfg, 1 if fp8 else 2)  # one weight tile per k step
                assert min(by_regs, by_smem) >= expected, (
                    regime, cfg, "GEMM1" if gather else "GEMM2", "fused" if act else "", regs, compiled.metadata.shared)


@pytest.mark.parametrize("form", ["silu", "gpt_oss"])
def test_one_token_gemms_and_combine_compile_without_a_sort(form):
    """Rows in slot order (one token, no sort): GEMM1 with its epilogue and GEMM2 in the SLOTS mode on the decode
    tile (swapped: wgmma), and the combine finding each slot's row from its id: no spills."""
    k = _kernels()
    for gather in (True, False):
        fn, types, consts = _activation_gemm(form if gather else "none", 16, 64, 128, False, True)
        consts["SLOTS"] = True
        del consts["ids_ptr"]
        types["ids_ptr"] = "*i64"
        if gather:
            consts.pop("sorted_ptr", None)
            types.pop("sorted_ptr", None)
            consts["sorted_ptr"] = None
        ptx = _compile(fn, types, consts, 4, 4).asm["ptx"]
        assert "wgmma.mma_async" in ptx and "cp.async" in ptx, form
        assert "ld.local" not in ptx and "st.local" not in ptx, form
    types = {"y_ptr": "*bf16", "pos_ptr": "*i64", "w_ptr": "*fp32", "out_ptr": "*bf16", "ids_ptr": "*i64"}
    consts = {"K_POW2": 8, "BLOCK_H": 128, "HAS_W": True, "IDENTITY": form == "gpt_oss", "SLOT_ROWS": True}
    if form == "gpt_oss":
        types["h_ptr"] = "*bf16"
    else:
        consts["h_ptr"] = None
    _compile(k.unpermute_kernel, types, consts)


@pytest.mark.parametrize("form", ["silu", "gpt_oss"])
def test_slot_down_combine_compiles_pipelined(form):
    """GEMM2 and the combine of one token's slots in one launch (``slot_down_combine``) on its shipped tile: one
    software-pipelined loop of (slot, k step) with async copies, MMAs on the 16-column tile, no spills."""
    from moe_fx.lowering.triton.grouped_gemm import SLOT_DOWN_TILE

    k = _kernels()
    gpt_oss = form == "gpt_oss"
    types = {"a_ptr": "*bf16", "b_ptr": "*bf16", "out_ptr": "*bf16", "ids_ptr": "*i64", "w_ptr": "*fp32"}
    consts = {"s_ak": 1, "s_bk": 1, "s_on": 1, "s_hh": 1, "TOPK": 4 if gpt_oss else 8,
              "BLOCK_N": SLOT_DOWN_TILE["block_n"], "BLOCK_K": SLOT_DOWN_TILE["block_k"], "UPCAST": False,
              "IEEE": False, "HAS_W": True, "HAS_BIAS": gpt_oss, "IDENTITY": gpt_oss}
    if gpt_oss:
        types.update(h_ptr="*bf16", bias_ptr="*bf16")
    else:
        consts.update(h_ptr=None, bias_ptr=None)
    ptx = _compile(k.slot_down_combine_kernel, types, consts, SLOT_DOWN_TILE["num_warps"],
                   SLOT_DOWN_TILE["num_stages"]).asm["ptx"]
    assert "mma.sync" in ptx or "wgmma.mma_async" in ptx, form
    assert "cp.async" in ptx, form
    assert "ld.local" not in ptx and "st.local" not in ptx, form


def test_sort_kernels_compile():
    from moe_fx.lowering.triton.sort import BITONIC_SORT_SLOTS, DECODE_PAIRWISE_SLOTS, bitonic_log, pairwise_slots

    k = _kernels()
    for e_pow2 in (8, 128, 256, 512):  # 256: DeepSeek-V3's experts
        block = max(16, min(1024, 16384 // e_pow2))
        consts = {"TOPK": 8, "BLOCK": block, "E_POW2": e_pow2}
        _compile(k.expert_counts_kernel, {"ids_ptr": "*i64", "counts_ptr": "*i32"}, consts)
        ptx = _compile(k.sort_slots_kernel, {"ids_ptr": "*i64", "counts_ptr": "*i32", "sorted_ptr": "*i32",
                                             "pos_ptr": "*i64"}, consts).asm["ptx"]
        assert "atom.global" in ptx and "ld.local" not in ptx
        small = {"TOPK": 8, "CHUNK": max(16, min(64, 8192 // e_pow2)), "E_POW2": e_pow2, "PAIRS": pairwise_slots(e_pow2),
                 "DECODE_PAIRS": DECODE_PAIRWISE_SLOTS, "PAIRWISE": True, "QUANT": False, "BLOCK_T": 8,
                 "INTERP": False, "x_ptr": None, "q_ptr": None, "qs_ptr": None}
        # the slot count as a run-time value, and as a constant (a static shape; the constant that decides the
        # pairwise branches when the frontend folds them: a name bound in a folded branch must not reach the loops)
        # 1024: the bitonic sort alone; 2048, and 300 with it off: one program per block of pairwise slots. The
        # bitonic network (seconds to compile) at two expert counts: its tiles do not depend on E but the histogram's
        on = BITONIC_SORT_SLOTS if e_pow2 in (8, 256) else 0
        for n, bitonic in ((None, on), (20, 0), (40, 0), (128, 0), (1024, on), (None, 0), (300, 0), (2048, on)):
            consts = {**small, "SORT_LOG": bitonic_log(bitonic)} | ({} if n is None else {"N": n})
            ptx = _compile(k.sort_small_kernel, {"ids_ptr": "*i64", "counts_ptr": "*i32", "sorted_ptr": "*i32",
                                                 "pos_ptr": "*i64"}, consts).asm["ptx"]
            assert "atom.global" not in ptx and "ld.local" not in ptx  # no atomics, no spills
        # the fp8 decode step's launch: the sort's programs, then the token quantisation's
        quant = {k: v for k, v in small.items() if not k.endswith("_ptr")}
        quant |= {"QUANT": True, "SORT_LOG": bitonic_log(on)}
        for sizes in ({}, {"N": 1, "T": 1}):  # run-time sizes, and the ones Triton folds (1: one token, top-1)
            ptx = _compile(k.sort_small_kernel, {"ids_ptr": "*i64", "counts_ptr": "*i32", "sorted_ptr": "*i32",
                                                 "pos_ptr": "*i64", "x_ptr": "*bf16", "q_ptr": "*fp8e4nv",
                                                 "qs_ptr": "*fp32"}, quant | sizes).asm["ptx"]
            assert "atom.global" not in ptx and "ld.local" not in ptx
    _compile(k.quantize_rows_kernel, {"x_ptr": "*bf16", "q_ptr": "*fp8e4nv", "s_ptr": "*fp32"},
             {"BLOCK_T": 8, "INTERP": False})


@pytest.mark.parametrize("form", ["bf16", "fp8", "quant"])
def test_contiguous_rows_kernel_compiles(form):
    """The copy into DeepGEMM's aligned contiguous layout, in its three forms (bf16 rows; fp8 codes and scales
    copied; bf16 tokens quantised in the copy), for DeepSeek-V3's top-8 of 256 experts: no spills."""
    k = _kernels()
    x = "*bf16" if form != "fp8" else "*fp8e4nv"
    out = "*bf16" if form == "bf16" else "*fp8e4nv"
    types = {"x_ptr": x, "xs_ptr": "*fp32" if form == "fp8" else x, "w_ptr": "*fp32", "scratch_ptr": "*i32",
             "pos_ptr": "*i64", "ids_ptr": "*i64", "out_ptr": out, "outs_ptr": "*fp32" if form != "bf16" else out,
             "m_idx_ptr": "*i32", "pos_out_ptr": "*i64"}
    consts = {"TOPK": 8, "K_POW2": 8, "E_POW2": 256, "ALIGN": 128, "BLOCK_H": 1024, "SG_POW2": 64,
              "HAS_SCALE": form == "fp8", "QUANT": form == "quant", "ROUTE_W": True, "INTERP": False}
    ptx = _compile(k.contiguous_rows_kernel, types, consts).asm["ptx"]
    assert "ld.local" not in ptx and "st.local" not in ptx


@pytest.mark.parametrize("use_dot", [False, True])
@pytest.mark.parametrize("fp8", [False, True])
def test_decode_experts_kernel_compiles(fp8, use_dot):
    """The decode path's kernel (measured on the H200, not chosen: docs/triton.md) at its default slices."""
    k = _kernels()
    w = "*fp8e4nv" if fp8 else "*bf16"
    types = {"x_ptr": "*bf16", "ids_ptr": "*i64", "rw_ptr": "*fp32", "w13_ptr": w, "w2_ptr": w, "s13_ptr": "*fp32",
             "s2_ptr": "*fp32", "b13_ptr": "*bf16", "part_ptr": "*fp32", **ACT_FLOATS}
    consts = {"TOPK": 8, "BLOCK_I": 64 if fp8 else 128, "BLOCK_K": 128, "BLOCK_H": 256, "ACT": 0, "GATED": True,
              "INTERLEAVED": False, "HAS_LIMIT": False, "HAS_BIAS": False, "ROUTE_ON_INPUT": False, "FP8": fp8,
              "INTERP": False, "USE_DOT": use_dot, "IEEE": False}
    ptx = _compile(k.decode_experts_kernel, types, consts).asm["ptx"]
    assert ("mma" in ptx) == use_dot


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("swap_ab,device_tma,gather", [(True, False, True), (False, True, False), (False, True, True)])
def test_sorted_gemm_swap_and_device_descriptors_compile(fp8, swap_ab, device_tma, gather):
    """Swapped decode tiles reach wgmma with 16 rows; device-made descriptors load through TMA."""
    bm, bn, bk = (16, 64, 128) if swap_ab else (128, 128, 128 if fp8 else 64)
    fn, types, consts = _sorted_gemm(fp8, gather, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk)
    consts.update(TMA=device_tma, SWAP_AB=swap_ab, DEVICE_TMA=device_tma)
    ptx = _compile(fn, types, consts, 4 if swap_ab else 8, 4 if fp8 else 3).asm["ptx"]
    assert "wgmma.mma_async" in ptx, "Hopper MMA expected (the swapped 16-row tile too)"
    if device_tma:
        assert "cp.async.bulk.tensor" in ptx, "TMA loads expected"
    assert "ld.local" not in ptx and "st.local" not in ptx, "register spills"


def _activation_gemm(form: str, bm: int, bn: int, bk: int, device_tma: bool, swap_ab: bool, **act):
    """(kernel, types, constants) of a sorted-layout GEMM with the activation ``form`` in its epilogue (GEMM1,
    gathering; GPT-OSS with its biases and clamp), or of GEMM2 for ``form="none"``; ``act``: more constants."""
    if form != "none":
        act = {"ACT_FUSED": True, "ACT": 4 if form == "relu2" else 0, "GATED": form != "relu2",
               "INTERLEAVED": form == "gpt_oss", "HAS_LIMIT": form == "gpt_oss", **act}
    fn, types, consts = _sorted_gemm(False, form != "none", act=act, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk)
    consts.update(TMA=device_tma, SWAP_AB=swap_ab, DEVICE_TMA=device_tma)
    if form == "gpt_oss":
        types["bias_ptr"] = "*bf16"
        del consts["bias_ptr"]
        consts["HAS_BIAS"] = True
    return fn, types, consts


@pytest.mark.parametrize(
    "form,bm,bn,bk,warps,stages,device_tma,swap_ab,pair",
    [
        ("silu", 128, 128, 64, 8, 3, True, False, False),    # prefill: the 128x256 unfused tile, two accumulators
        ("silu", 64, 64, 128, 4, 4, False, False, False),    # mid-size tile, pointer loads
        ("silu", 128, 256, 64, 8, 3, True, False, True),     # the same 128x256 tile, gate and up rows in one box
        ("silu", 64, 128, 64, 4, 4, False, False, True),     # paired through pointers
        ("silu", 16, 64, 128, 4, 4, False, True, True),      # paired, swapped decode tile: one weight tile
        ("gpt_oss", 128, 256, 64, 8, 3, True, False, False),  # interleaved rows: the unfused tile, split; bias, clamp
        ("gpt_oss", 64, 128, 64, 4, 4, False, False, False),  # the same through pointers
        ("silu", 16, 64, 128, 4, 4, False, True, False),     # decode: swapped tile (wgmma on the weight rows)
        ("gpt_oss", 16, 64, 128, 4, 4, False, True, False),  # GPT-OSS decode: swapped, then split into gate/up
        ("relu2", 128, 256, 64, 8, 3, True, False, False),   # not gated: one accumulator, the unfused tile
    ],
)
def test_gemm_with_activation_epilogue_compiles_pipelined(form, bm, bn, bk, warps, stages, device_tma, swap_ab, pair):
    """GEMM1 with the activation in its epilogue: the accumulators on wgmma, pipelined loads, no spills (``pair``:
    gate/up halves as one tile, loaded by one 4-D descriptor box with device descriptors)."""
    fn, types, consts = _activation_gemm(form, bm, bn, bk, device_tma, swap_ab, PAIR_HALVES=pair)
    ptx = _compile(fn, types, consts, warps, stages).asm["ptx"]
    assert "wgmma.mma_async" in ptx, "Hopper MMA expected"
    assert ("cp.async.bulk.tensor" if device_tma else "cp.async") in ptx, "main loop not pipelined"
    assert "ld.local" not in ptx and "st.local" not in ptx, "register spills"


@pytest.mark.parametrize(
    "form,bm,bn,bk,warps,stages,swap_ab,device_tma",
    [
        ("silu", 16, 64, 128, 4, 5, True, False),     # the decode regime's swapped tile (fp8 table entry)
        ("gpt_oss", 16, 64, 128, 4, 5, True, False),  # interleaved gate/up, biases, clamp
        ("silu", 32, 128, 128, 4, 4, False, False),   # 5..16 rows per expert: the fp8 table's unswapped tile
        ("none", 16, 64, 128, 4, 5, True, True),      # GEMM2: fp8 weights through device-made descriptors
    ],
)
def test_bf16_activations_fp8_weights_gemm_compiles(form, bm, bn, bk, warps, stages, swap_ab, device_tma):
    """W8A16 (masked_gemm_kernel's B_FP8): fp8 weight tiles dequantised in registers (code times block scale,
    rounded to bf16) feed bf16 MMAs on one accumulator, loads stay pipelined, no spills; GEMM1 with the activation
    in its epilogue, GEMM2 without."""
    fn, types, consts = _activation_gemm(form, bm, bn, bk, device_tma, swap_ab, B_FP8=True)
    ptx = _compile(fn, types, consts, warps, stages).asm["ptx"]
    # wgmma where the MMA's M (the weight rows of a swapped tile, else the rows) is 64 or more; bf16 operands only
    assert ("wgmma.mma_async" in ptx) == (swap_ab or bm >= 64), "Hopper MMA expected exactly for 64+ row MMAs"
    mmas = set(re.findall(r"(?:wgmma\.mma_async|mma)\.sync\.aligned\.[\w.]+", ptx))
    assert mmas and all(".bf16.bf16" in m for m in mmas), f"bf16 MMAs expected, got {mmas}"
    # the codes convert a pair per instruction; the scaled weights go back to bf16 a pair per instruction
    assert "cvt.rn.f16x2.e4m3x2" in ptx and "cvt.rn.bf16x2.f32" in ptx
    assert ("cp.async.bulk.tensor" if device_tma else "cp.async") in ptx, "main loop not pipelined"
    assert "ld.local" not in ptx and "st.local" not in ptx, "register spills"
