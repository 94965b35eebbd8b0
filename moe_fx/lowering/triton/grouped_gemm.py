"""Masked grouped GEMMs (``c[g, :m_g] = a[g, :m_g] @ b[g]^T``) in Triton, bf16 and fp8 (1x128 / 128x128).

Both are persistent kernels that visit only the valid row tiles (``masked_m`` is read on the
device; nothing synchronises with the host, so they can be captured in CUDA graphs). Any ``M``,
``N``, ``K`` and group count: tails are masked. Rows ``>= masked_m[g]`` of the output are left as
they were (unwritten).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from moe_fx.lowering.problem import size_hint
from moe_fx.lowering.triton import configs
from moe_fx.lowering.triton._loader import is_traced, launch
from moe_fx.lowering.triton.act_args import epilogue_args
from moe_fx.ops import ExpertActivation
from moe_fx.ops.recipe import FP8_BLOCK, FP8_DTYPE, cdiv

__all__ = ["SLOT_DOWN_MAX_TOPK", "SLOT_DOWN_TILE", "SlotRows", "SortedRows", "check_offsets", "masked_gemm",
           "masked_gemm_fp8", "num_programs", "slot_down_combine", "sorted_gemm", "tune_masked_gemm"]

_FLOATS = (torch.bfloat16, torch.float16, torch.float32)
#: fp8 GEMMs load each k step's scales one step ahead (``masked_gemm_fp8_kernel``'s PREFETCH_SCALES); read at every
#: launch, so ``bench/fused_activation.py --switch fp8_scales`` can time both sides in one process. Off: on the H200
#: it measured 0.93-1.05x before the 2026-12-05 retune and 0.97-1.05x after (bench/results/fp8_scales_2026-12-05*),
#: no consistent gain; the shipped tiles are tuned with it off.
PREFETCH_FP8_SCALES = False
#: gate/up halves in GEMM1's epilogue as one weight tile of gate rows and the up rows below them (one accumulator,
#: the unfused tile's MMA shape and bytes, ``masked_gemm_kernel``'s PAIR_HALVES) instead of two accumulators of half
#: the tile (a swapped tile: two weight tiles). Read at every launch: ``bench/fused_activation.py --switch
#: pair_halves`` times both: 1.00-1.02x on the H200 (bench/results/pair_halves_2026-12-05.md).
PAIR_GATE_UP = True
_FP8 = FP8_DTYPE


def _hint(v: object) -> int | None:
    """A plain int for a host-side hint (:func:`moe_fx.lowering.problem.size_hint`; for tile choice only: the graph
    then serves nearby sizes with the same tiles), None as it is."""
    return None if v is None else size_hint(v)


def _known_empty(*sizes: object) -> bool:
    """True only when a size is statically 0 (a symbolic size is assumed to be >= 1: no guard)."""
    return any(isinstance(s, int) and s == 0 for s in sizes)


def num_programs(device: torch.device, cfg: configs.TileConfig, tile_bound: object, per_sm: int | None = None) -> int:
    """Persistent grid size: enough programs to fill the GPU, never more than the tiles there can be.

    A symbolic bound (the token count is dynamic in a compiled graph) gives the full-GPU size: the
    programs without a tile return at once, and the grid stays a constant of the compiled code.
    ``per_sm``: the programs that fit on an SM as launched (:func:`configs.resident_programs`; default the
    tile's ``programs_per_sm``).
    """
    full = 4 if device.type != "cuda" else _sms(device) * (per_sm or cfg.programs_per_sm)
    if not isinstance(tile_bound, int):
        return full
    return max(1, min(tile_bound, full))


def _sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 1
    from moe_fx.lowering.problem import probe_capabilities

    return probe_capabilities(device).num_sms or 1


def _pow2(n: int) -> int:
    p = 1
    while p < n:
        p *= 2
    return p


def _check_masked(name: str, masked_m: torch.Tensor, groups: int, device: torch.device) -> None:
    if masked_m.dtype != torch.int32 or masked_m.shape != (groups,) or masked_m.device != device:
        raise ValueError(
            f"{name}: masked_m must be int32 [{groups}] on {device}, got {masked_m.dtype} "
            f"{list(masked_m.shape)} on {masked_m.device}"
        )


_I32 = 2**31


def check_offsets(name: str, *tensors: torch.Tensor) -> None:
    """Raise if a tensor's offsets inside one group (all but dim 0) could overflow int32.

    The kernels index the group with int64 and rows / columns inside a group with int32 (cheaper
    address arithmetic in the main loop); that bounds one group to 2**31 elements of offset. With a
    symbolic size the bound becomes a check of the compiled graph (``torch._check``).
    """
    for t in tensors:
        if t is None or t.dim() != 3:
            continue
        span = sum((size - 1) * abs(st) for size, st in zip(t.shape[1:], t.stride()[1:]))
        msg = (f"{name}: one group of a {list(t.shape)} tensor (strides {list(t.stride())}) spans {span} "
               "elements, beyond the kernels' int32 offsets; split the groups or the rows")
        if isinstance(span, int):
            if span >= _I32:
                raise ValueError(msg)
        else:
            torch._check(span < _I32, lambda msg=msg: msg)


def _out(name: str, out: torch.Tensor | None, shape: tuple, dtype: torch.dtype, device: torch.device):
    if out is None:
        return torch.empty(shape, dtype=dtype, device=device)
    if tuple(out.shape) != shape or out.dtype != dtype or out.device != device:
        raise ValueError(
            f"{name}: out must be {dtype} {list(shape)} on {device}, got {out.dtype} {list(out.shape)} on {out.device}"
        )
    return out


def _tma_ok(t: torch.Tensor) -> bool:
    """Whether ``t`` (3-D) can be read through a TMA descriptor: unit last stride, 16-byte aligned rest."""
    size = t.element_size()
    return (
        t.dim() == 3
        and t.stride(2) == 1
        and t.data_ptr() % 16 == 0
        and all((st * size) % 16 == 0 for st in t.stride()[:2])
        and t.shape[2] * size >= 16
    )


def _tma_capable(device: torch.device) -> bool:
    if device.type == "cpu":
        return True  # the interpreter emulates descriptors (tests exercise the TMA branch there)
    from moe_fx.lowering.problem import probe_capabilities

    cap = probe_capabilities(device).capability  # the assumed GPU while tracing for one this machine lacks
    return cap is not None and tuple(cap) >= (9, 0)


def _operands(
    cfg: configs.TileConfig, a: torch.Tensor, b: torch.Tensor, *, gather: bool = False
) -> tuple[object, object, bool]:
    """``(a, b, tma)``: TMA descriptors when the config asks for them and the tensors allow it.

    ``a`` is 3-D (the sorted layout's rows are ``[1, rows, K]``); a gathered ``a`` (tokens picked
    through the sorted ids) stays a tensor and only ``b`` gets a descriptor. Not while traced
    for Inductor: host-side descriptors cannot be recorded outside Dynamo's own tracing (torch
    2.11-2.13), so compiled graphs load tiles through pointers.
    """
    if is_traced(a) or not (cfg.tma and _tma_capable(a.device) and (gather or _tma_ok(a)) and _tma_ok(b)):
        return a, b, False
    from triton.tools.tensor_descriptor import TensorDescriptor

    b_desc = TensorDescriptor.from_tensor(b, [1, cfg.block_n, cfg.block_k])
    if gather:
        return a, b_desc, True
    return TensorDescriptor.from_tensor(a, [1, cfg.block_m, cfg.block_k]), b_desc, True


def _device_tma_ok(a: torch.Tensor, b: torch.Tensor, gather: bool) -> bool:
    """Whether the kernels can make TMA descriptors of ``b`` (and of ``a`` unless gathered) on the device.

    Unit last stride, 16-byte aligned strides and rows (TMA's rules); base addresses are checked on
    real tensors (a traced stand-in has none: its buffers come from the allocator, weights are
    parameters, both aligned). Never in a graph Inductor compiles with its C++ wrapper: such a kernel needs
    global scratch memory from its launcher, and torch 2.11's C++ wrapper passes none that fits (an fp8
    prefill graph under it stopped with an illegal memory access on an H100, 2026-12-06; pytorch#148051
    gave C++-launched kernels a null scratch pointer); there the tile loads through pointers.
    """
    if is_traced(a) and _compiling_with_cpp_wrapper():
        return False
    if a.device.type == "cuda" and not _tma_capable(a.device):
        return False
    ts = [b] if gather else [b, a]
    for t in ts:
        size = t.element_size()
        if t.dim() != 3 or t.stride(2) != 1 or t.shape[2] * size < 16:
            return False
        if any(isinstance(st, int) and (st * size) % 16 for st in t.stride()[:2] if st):
            return False
        if not is_traced(t) and t.data_ptr() % 16:
            return False
    return True


def _compiling_with_cpp_wrapper() -> bool:
    """Whether the graph being traced is compiled with Inductor's C++ wrapper (``cpp_wrapper`` in force: Inductor
    traces a graph's ops inside its config patches)."""
    from torch._inductor import config

    return bool(config.cpp_wrapper)


def _tile_bound(groups: int, m: object, n: int, cfg: configs.TileConfig, max_total_m: object) -> object:
    tiles_m = groups * cdiv(m, cfg.block_m)
    if max_total_m is not None:
        tiles_m = torch.sym_min(tiles_m, cdiv(max_total_m, cfg.block_m) + groups)
    return tiles_m * cdiv(n, cfg.block_n)


def _check_bias(name: str, bias: torch.Tensor | None, groups: int, n: int, device: torch.device) -> None:
    if bias is None:
        return
    if tuple(bias.shape) != (groups, n) or not bias.dtype.is_floating_point or bias.device != device:
        raise ValueError(f"{name}: bias must be float [{groups}, {n}] on {device}, got {bias.dtype} {list(bias.shape)}")
    if bias.stride(1) != 1 and n > 1:
        raise ValueError(f"{name}: bias must be contiguous along N, got strides {list(bias.stride())}")


def _bias_args(bias: torch.Tensor | None) -> dict[str, object]:
    if bias is None:
        return {"bias_ptr": None, "s_biasg": 0, "HAS_BIAS": False}
    return {"bias_ptr": bias, "s_biasg": bias.stride(0), "HAS_BIAS": True}


@dataclass(frozen=True)
class SortedRows:
    """The contiguous ("sorted") layout of one call: every (token, k) slot's row, rows grouped by expert.

    Expert ``e`` owns rows ``[start[e], start[e] + counts[e])`` of the 2-D row buffers (``start`` is
    the exclusive sum of ``counts``, computed inside the kernels). Built by
    :func:`moe_fx.lowering.triton.sort.sort_by_expert`.

    Attributes:
        scratch: ``[2E + 1]`` int32: rows per expert (``[:E]``, what the GEMMs read as their counts), rows
            in all (``[E]``, the activation's), then the sort's cursors. One buffer that kernels take
            whole: a traced graph holds no view of a buffer its kernels write.
        sorted_slots: ``[N]`` int32, slot ``t * K + k`` of each row (rows past the total unspecified).
        slot_pos: ``[N]`` int64, the row of each slot (-1: the slot sends no row).
        topk: K. num_rows: N = T * K, the static bound on the total (may be symbolic). num_experts: E.
    """

    scratch: torch.Tensor
    sorted_slots: torch.Tensor
    slot_pos: torch.Tensor
    topk: int
    num_rows: object
    num_experts: int

    @property
    def counts(self) -> torch.Tensor:
        """``[E]`` int32 rows per expert (a view: for eager code and tests)."""
        return self.scratch[: self.num_experts]

    @property
    def total(self) -> torch.Tensor:
        """``[1]`` int32 rows in all (a view: for eager code and tests)."""
        return self.scratch[self.num_experts : self.num_experts + 1]


@dataclass(frozen=True)
class SlotRows:
    """Rows in slot order, no sort: slot ``(t, k)`` owns row ``t * K + k`` if its id names an expert (a decode step
    of one token: :func:`moe_fx.lowering.masked_experts.pipeline.slot_rows`). The GEMMs read each slot's expert id
    (their SLOTS mode) and the combine finds each slot's row from its id (SLOT_ROWS).

    Attributes:
        topk_ids: ``[T, K]`` expert ids (any integer dtype and strides).
        topk: K. num_rows: N = T * K. num_experts: E.
    """

    topk_ids: torch.Tensor
    topk: int
    num_rows: int
    num_experts: int

    @classmethod
    def of(cls, topk_ids: torch.Tensor, num_experts: int) -> SlotRows:
        """The slot-order rows of ``topk_ids`` (``[T, K]``, a static T) over ``num_experts`` experts."""
        t, k = topk_ids.shape
        return cls(topk_ids, int(k), int(t) * int(k), int(num_experts))


def _gemm_config(kind: str, a: torch.Tensor, n: int, k: int, hints: dict, layout: str) -> configs.TileConfig:
    """The tile configuration of one launch (see :func:`configs.get_config` for the lookup)."""
    cfg = configs.get_config(
        kind, n, k, _hint(hints.get("expected_m")), a.device, _hint(hints.get("active_groups")), _sms(a.device),
        allow_tma=not is_traced(a), layout=layout, regime=hints.get("regime"),
        symbolic=not isinstance(hints.get("expected_m"), (int, type(None))),
        slots=hints["slots"] if isinstance(hints.get("slots"), int) else None,
    )
    return configs.fit_smem(cfg, a.element_size()) if kind in ("bf16", "w8a16") else cfg


def _launch_gemm(
    kind: str, a, a_scale, b, b_scale, masked_m, out, groups: int, m: object, n: int, k: int,
    cfg: configs.TileConfig, tile_bound: object, *, a_strides: tuple, as_strides: tuple, c_strides: tuple,
    bias, sorted_rows: SortedRows | None, gather: bool, route_weights, epilogue: dict | None = None,
) -> None:
    """One launch of the masked / sorted GEMM kernel of ``kind`` (the layouts differ only in row offsets):
    ``"bf16"`` (bf16/fp16/fp32 operands), ``"fp8"`` (fp8 x fp8, 1x128 / 128x128 scales) or ``"w8a16"``
    (bf16 activations x fp8 weights with 128x128 scales, dequantised in the kernel).

    ``epilogue``: the activation's kernel arguments (:func:`moe_fx.lowering.triton.act_args.epilogue_args`)
    when GEMM1 applies it (bf16 kinds only)."""
    # a swapped tile with gate/up halves in two accumulators loads the gate's and the up's weight tiles
    b_tiles = 2 if epilogue and _halves(epilogue) and not epilogue["PAIR_HALVES"] and cfg.swap_ab else 1
    nprog = num_programs(a.device, cfg, tile_bound, configs.resident_programs(cfg, a.element_size(), b_tiles))
    device_tma = sorted_rows is not None and cfg.tma and _device_tma_ok(a, b, gather)
    if device_tma:
        a_in, b_in, tma = a, b, True
    elif sorted_rows is not None:
        a_in, b_in, tma = a, b, False
    else:
        a_in, b_in, tma = _operands(cfg, a, b, gather=gather)
    if sorted_rows is not None:
        rw = route_weights
        slots = isinstance(sorted_rows, SlotRows)
        extra = dict(sorted_ptr=sorted_rows.sorted_slots if gather and not slots else None, rw_ptr=rw,
                     s_rwt=rw.stride(0) if rw is not None else 0, s_rwk=rw.stride(1) if rw is not None else 0,
                     SORTED=True, GATHER_A=gather, TOPK=sorted_rows.topk, ROUTE_W=rw is not None)
        if slots:  # the bf16 kernel's slot mode (SlotRows): each slot's expert id, the experts in b
            ids = sorted_rows.topk_ids
            extra.update(ids_ptr=ids, s_it=ids.stride(0), s_ik=ids.stride(1), NUM_W=sorted_rows.num_experts,
                         SLOTS=True)
    else:
        extra = {}
    common = dict(
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m, E_POW2=_pow2(groups),
        EVEN_K=k % cfg.block_k == 0, UPCAST=a.device.type == "cpu", TMA=tma, **_bias_args(bias), **extra,
        SWAP_AB=cfg.swap_ab, DEVICE_TMA=device_tma, FLATTEN=cfg.flatten,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    if kind == "fp8":
        launch(
            "masked_gemm_fp8_kernel", a.device, (nprog,),
            a_in, a_scale, b_in, b_scale, out, masked_m,
            groups, m, n, k,
            *a_strides, *as_strides, *b.stride(), *b_scale.stride(), *c_strides,
            SCALAR_BS=FP8_BLOCK % cfg.block_n == 0, PREFETCH_SCALES=PREFETCH_FP8_SCALES, **common,
        )  # fmt: skip
    else:
        w8a16 = {} if kind != "w8a16" else {"bs_ptr": b_scale, "s_bsg": b_scale.stride(0), "s_bsn": b_scale.stride(1),
                                            "s_bsk": b_scale.stride(2), "B_FP8": True}
        launch(
            "masked_gemm_kernel", a.device, (nprog,),
            a_in, b_in, out, masked_m,
            groups, m, n, k,
            *a_strides, *b.stride(), *c_strides,
            IEEE=a.dtype == torch.float32, **common, **(epilogue or {}), **w8a16,
        )  # fmt: skip


def _check_operands(name: str, a: torch.Tensor, b: torch.Tensor, fp8: bool, a_dim: int, grouped: bool = True,
                    *, w8a16: bool = False) -> None:
    if a.dim() != a_dim or b.dim() != 3 or a.shape[-1] != b.shape[2] or (grouped and a.shape[0] != b.shape[0]):
        want = "a [G, M, K]" if grouped else "a [T, K] or [1, N, K]"
        raise ValueError(f"{name}: want {want} and b [G, N, K], got {list(a.shape)} and {list(b.shape)}")
    if fp8:
        if a.dtype != _FP8 or b.dtype != _FP8:
            raise TypeError(f"{name}: a and b must be float8_e4m3fn, got {a.dtype} and {b.dtype}")
    elif w8a16:
        if a.dtype not in (torch.bfloat16, torch.float16) or b.dtype != _FP8:
            raise TypeError(f"{name}: fp8 weights with unquantised activations need a bf16/fp16 and b float8_e4m3fn, "
                            f"got {a.dtype} and {b.dtype}")
    elif a.dtype not in _FLOATS or b.dtype != a.dtype:
        raise TypeError(f"{name}: a and b must share a dtype of {_FLOATS}, got {a.dtype} and {b.dtype}")


def _check_scales(name: str, a_scale: torch.Tensor | None, a_shape: tuple, b_scale: torch.Tensor, g: int, n: int,
                  k: int):
    """fp32 1x128 scales of a (``None``: a is not quantised) and 128x128 block scales of b."""
    kb = cdiv(k, FP8_BLOCK)
    if a_scale is not None and (tuple(a_scale.shape) != (*a_shape, kb) or a_scale.dtype != torch.float32):
        raise ValueError(f"{name}: a_scale must be float32 {[*a_shape, kb]}, got {a_scale.dtype} {list(a_scale.shape)}")
    nb = cdiv(n, FP8_BLOCK)
    if tuple(b_scale.shape) != (g, nb, kb) or b_scale.dtype != torch.float32:
        raise ValueError(f"{name}: b_scale must be float32 {[g, nb, kb]}, got {b_scale.dtype} {list(b_scale.shape)}")


def masked_gemm(
    a: torch.Tensor,
    b: torch.Tensor,
    masked_m: torch.Tensor,
    out: torch.Tensor | None = None,
    *,
    bias: torch.Tensor | None = None,
    expected_m: int | None = None,
    max_total_m: int | None = None,
    config: configs.TileConfig | None = None,
    active_groups: int | None = None,
    regime: int | None = None,
) -> torch.Tensor:
    """Masked grouped GEMM ``out[g, :masked_m[g]] = a[g, :masked_m[g]] @ b[g]^T (+ bias[g])``, fp32 accumulation.

    Args:
        a: ``[G, M, K]`` bf16, fp16 or fp32 (fp32 uses exact IEEE products), any strides.
        b: ``[G, N, K]`` same dtype as ``a``, any strides.
        masked_m: ``[G]`` int32 on the same device: valid rows of each group (clamped to ``M``).
        out: optional ``[G, M, N]`` output in ``a.dtype``; rows past ``masked_m`` are not written.
        bias: optional float ``[G, N]`` (contiguous along N) added to every valid row.
        expected_m: host-side hint of the rows per group (picks the tile bucket); default ``M``.
        max_total_m: host-side bound on ``sum(masked_m)`` (``T * K`` for MoE) to size the grid.
        config: force a tile configuration (tuning and tests).
        active_groups: host-side estimate of the groups with rows (``min(G, T * K)``), for tile sizing.
        regime: the rows-per-expert regime of the call (:func:`moe_fx.lowering.problem.row_regime`):
            with a symbolic ``expected_m`` the tiles are the regime's, never the traced size's.

    Returns:
        ``[G, M, N]`` in ``a.dtype``. Any of M, expected_m, max_total_m may be symbolic while traced.
    """
    _check_operands("masked_gemm", a, b, False, 3)
    g, m, k = a.shape
    n = b.shape[1]
    _check_masked("masked_gemm", masked_m, g, a.device)
    _check_bias("masked_gemm", bias, g, n, a.device)
    out = _out("masked_gemm", out, (g, m, n), a.dtype, a.device)
    check_offsets("masked_gemm", a, b, out)
    if _known_empty(g, m, n):
        return out
    hints = {"expected_m": expected_m if expected_m is not None else m, "active_groups": active_groups, "regime": regime}
    cfg = config or _gemm_config("bf16", a, n, k, hints, "masked")
    _launch_gemm("bf16", a, None, b, None, masked_m, out, g, m, n, k, cfg, _tile_bound(g, m, n, cfg, max_total_m),
                 a_strides=a.stride(), as_strides=(), c_strides=out.stride(), bias=bias, sorted_rows=None,
                 gather=False, route_weights=None)
    return out


def masked_gemm_fp8(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    b: torch.Tensor,
    b_scale: torch.Tensor,
    masked_m: torch.Tensor,
    out: torch.Tensor | None = None,
    *,
    bias: torch.Tensor | None = None,
    expected_m: int | None = None,
    max_total_m: int | None = None,
    config: configs.TileConfig | None = None,
    active_groups: int | None = None,
    regime: int | None = None,
) -> torch.Tensor:
    """Masked grouped fp8 GEMM with DeepSeek-style block scales, bf16 out, fp32 accumulation.

    ``out[g, r, n] = sum_k a[g, r, k] * a_scale[g, r, k // 128] * b[g, n, k] * b_scale[g, n // 128, k // 128]``
    (+ ``bias[g, n]``) for rows ``r < masked_m[g]``.

    Args:
        a: ``[G, M, K]`` float8_e4m3fn activations.
        a_scale: ``[G, M, ceil(K/128)]`` fp32 per-token-group scales, ANY strides (MN-major,
            TMA-aligned views as DeepGEMM wants them are read in place).
        b: ``[G, N, K]`` float8_e4m3fn weights.
        b_scale: ``[G, ceil(N/128), ceil(K/128)]`` fp32 block scales, any strides.
        masked_m: ``[G]`` int32, valid rows per group.
        out: optional bf16 ``[G, M, N]``.
        bias, expected_m, max_total_m, config, active_groups, regime: as in :func:`masked_gemm`.

    Returns:
        bf16 ``[G, M, N]``.
    """
    _check_operands("masked_gemm_fp8", a, b, True, 3)
    g, m, k = a.shape
    n = b.shape[1]
    _check_scales("masked_gemm_fp8", a_scale, (g, m), b_scale, g, n, k)
    _check_masked("masked_gemm_fp8", masked_m, g, a.device)
    _check_bias("masked_gemm_fp8", bias, g, n, a.device)
    out = _out("masked_gemm_fp8", out, (g, m, n), torch.bfloat16, a.device)
    check_offsets("masked_gemm_fp8", a, a_scale, b, b_scale, out)
    if _known_empty(g, m, n):
        return out
    hints = {"expected_m": expected_m if expected_m is not None else m, "active_groups": active_groups, "regime": regime}
    cfg = config or _gemm_config("fp8", a, n, k, hints, "masked")
    _check_fp8_block_k("masked_gemm_fp8", cfg)
    _launch_gemm("fp8", a, a_scale, b, b_scale, masked_m, out, g, m, n, k, cfg, _tile_bound(g, m, n, cfg, max_total_m),
                 a_strides=a.stride(), as_strides=a_scale.stride(), c_strides=out.stride(), bias=bias,
                 sorted_rows=None, gather=False, route_weights=None)
    return out


def _check_fp8_block_k(name: str, cfg: configs.TileConfig) -> None:
    if FP8_BLOCK % cfg.block_k:
        raise ValueError(f"{name}: block_k must divide {FP8_BLOCK} (one scale group per k step), got {cfg.block_k}")


def sorted_gemm(
    a: torch.Tensor,
    b: torch.Tensor,
    rows: SortedRows | SlotRows,
    out: torch.Tensor | None = None,
    *,
    a_scale: torch.Tensor | None = None,
    b_scale: torch.Tensor | None = None,
    gather: bool = False,
    route_weights: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    expected_m: object = None,
    active_groups: object = None,
    regime: int | None = None,
    config: configs.TileConfig | None = None,
    activation: ExpertActivation | None = None,
) -> torch.Tensor:
    """Grouped GEMM on the contiguous layout: each sorted row times its expert's ``b[e]^T``.

    ``out[0, start[e] + r] = A[row] @ b[e]^T (* w) (+ bias[e])`` for ``r < counts[e]``, where ``A[row]``
    is ``a[0, start[e] + r]``, or with ``gather`` the token ``a[sorted_slots[start[e] + r] // K]``
    (GEMM1 reads ``hidden`` in place). fp8 when ``a_scale`` / ``b_scale`` are given (1x128 / 128x128,
    as in :func:`masked_gemm_fp8`; a's scales follow a's rows). Sorted row buffers are ``[1, N, *]``
    (one group of rows): the pipeline hands them from kernel to kernel with no view in between.

    Args:
        a: tokens ``[T, K]`` (gather) or sorted rows ``[1, N, K]``; bf16/fp16/fp32, or float8_e4m3fn.
        b: ``[E, N_out, K]`` weights, any strides; float8_e4m3fn with ``b_scale`` (with a bf16/fp16 ``a`` and no
            ``a_scale``: W8A16, the weight tiles dequantised in registers, the activations never quantised).
        rows: the layout (:class:`SortedRows`), ``N = rows.num_rows``; or rows in slot order (:class:`SlotRows`,
            bf16/fp16/fp32 only: row ``t * K + k`` is slot ``(t, k)``'s, times expert ``topk_ids[t, k]``).
        out: optional ``[1, N, N_out]`` (a's dtype, bf16 for fp8); rows past the total are not written.
        a_scale: fp32 ``[T, K/128]`` or ``[1, N, K/128]`` (a's rows), any strides.
        route_weights: ``[T, K]`` routing weights that multiply each row (weights on the input).
        bias: float ``[E, N_out]``. expected_m, active_groups, regime, config: as in :func:`masked_gemm`.
        activation: the expert activation, applied in the epilogue (bf16/fp16/fp32 only): the output
            is then ``[1, N, N_out / 2]`` of ``act(gate) * (up + up_offset)`` (gated; ``b`` holds gate and
            up rows, ``bias`` too) or ``[1, N, N_out]`` of ``act(h)``, from the fp32 products: the GEMM1
            product is never stored and the activation kernel does not run. ``config`` is then the
            unfused GEMM's tile (:func:`_split_columns` makes the launch's from it).

    Returns:
        ``[1, N, N_out]`` (``N_out / 2`` columns with a gated ``activation``).
    """
    w8a16 = b_scale is not None and a.dtype != _FP8
    fp8 = b_scale is not None and not w8a16
    name = "sorted_gemm"
    _check_operands(name, a, b, fp8, 2 if gather else 3, grouped=False, w8a16=w8a16)
    e, n, k = b.shape
    num_rows = rows.num_rows
    slots = isinstance(rows, SlotRows)
    index = rows.topk_ids if slots else rows.scratch  # what the kernels read of the layout
    if (rows.num_experts != e or index.device != a.device
            or (index.dtype != torch.int32 if not slots else index.dtype.is_floating_point)):
        raise ValueError(f"{name}: rows were laid out for {rows.num_experts} experts on {index.device}, "
                         f"b has {e} on {a.device}")
    if slots and (fp8 or w8a16):
        raise ValueError(f"{name}: rows in slot order run bf16/fp16/fp32 GEMMs, not fp8 weights")
    if not gather and tuple(a.shape[:2]) != (1, num_rows):
        raise ValueError(f"{name}: sorted rows must be [1, {num_rows}, K], got {list(a.shape)}")
    _check_bias(name, bias, e, n, a.device)
    if fp8 and a_scale is None:
        raise ValueError(f"{name}: fp8 activations need a_scale")
    if w8a16 and a_scale is not None:
        raise ValueError(f"{name}: a_scale given for {a.dtype} activations (fp8 weights take bf16 activations "
                         "unscaled, or fp8 activations with their scales)")
    if b_scale is not None:
        _check_scales(name, a_scale, tuple(a.shape[:-1]), b_scale, e, n, k)
    if route_weights is not None and (route_weights.dim() != 2 or route_weights.shape[1] != rows.topk):
        raise ValueError(f"{name}: route_weights must be [T, {rows.topk}], got {list(route_weights.shape)}")
    if route_weights is not None and not gather:
        raise ValueError(f"{name}: route_weights apply to the gathered GEMM (the first) only")
    epilogue, n_out = None, n
    if activation is not None:
        if fp8:
            raise ValueError(f"{name}: the activation epilogue runs on bf16/fp16/fp32 GEMMs, not fp8")
        if activation.gated and n % 2:
            raise ValueError(f"{name}: a gated activation needs an even number of weight rows, got {n}")
        epilogue = epilogue_args(activation, name)
        epilogue["PAIR_HALVES"] = _halves(epilogue) and PAIR_GATE_UP
        n_out = n // 2 if activation.gated else n
    out = _out(name, out, (1, num_rows, n_out), torch.bfloat16 if fp8 else a.dtype, a.device)
    check_offsets(name, a if a.dim() == 3 else a.unsqueeze(0), out)
    if _known_empty(num_rows, n):
        return out
    kind = "fp8" if fp8 else "w8a16" if w8a16 else "bf16"
    hints = {"expected_m": expected_m, "active_groups": active_groups, "regime": regime, "slots": num_rows}
    cfg = config or _gemm_config(kind, a, n, k, hints, "sorted")
    if b_scale is not None:
        _check_fp8_block_k(name, cfg)
    if epilogue is not None and activation.gated and not epilogue["PAIR_HALVES"]:
        cfg = _split_columns(cfg, activation.gate_up_layout)
    # group strides 0: row offsets come from the expert's start (the kernels' SORTED mode)
    a_strides = (0, *a.stride()) if gather else (0, *a.stride()[1:])
    as_strides = () if not fp8 else (0, *a_scale.stride()) if gather else (0, *a_scale.stride()[1:])
    # the grid's tile columns: interleaved and paired epilogue tiles walk b's rows (2 per output column)
    tile_cols = n if epilogue is not None and (epilogue["INTERLEAVED"] or epilogue["PAIR_HALVES"]) else n_out
    # slot order: T * K groups (slots) of one row each; sorted: E experts of up to N rows
    groups, group_rows = (num_rows, 1) if slots else (e, num_rows)
    _launch_gemm(kind, a, a_scale, b, b_scale, index, out, groups, num_rows, n_out, k, cfg,
                 _tile_bound(groups, group_rows, tile_cols, cfg, num_rows), a_strides=a_strides, as_strides=as_strides,
                 c_strides=(0, *out.stride()[1:]), bias=bias, sorted_rows=rows, gather=gather,
                 route_weights=route_weights, epilogue=epilogue)
    return out


#: ``slot_down_combine``'s tile (not tuned: a first choice, see its docstring): 16 output columns a program (Qwen3's
#: H = 2048 gives 128 programs for 132 SMs), 256-deep k steps (8 KB of bf16 weights a step, four in flight)
SLOT_DOWN_TILE = {"block_n": 16, "block_k": 256, "num_warps": 4, "num_stages": 4}
#: most slots a token may have in :func:`slot_down_combine` (the columns of its MMA tile)
SLOT_DOWN_MAX_TOPK = 16


def slot_down_combine(
    a: torch.Tensor,
    b: torch.Tensor,
    rows: SlotRows,
    topk_weights: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    weights_on_output: bool = True,
    hidden: torch.Tensor | None = None,
    identity_experts: int = 0,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """GEMM2 and the combine of rows in slot order in one launch: ``[T, H]``.

    ``out[t] = sum_k w[t, k] * (a[0, t * K + k] @ b[e]^T + bias[e])`` with ``e = topk_ids[t, k]`` over the slots whose
    id names one of ``b``'s experts, in fp32, plus ``w[t, k] * hidden[t]`` for identity experts (ids in
    ``[E, E + identity_experts)``): what :func:`sorted_gemm` (GEMM2) and
    :func:`~moe_fx.lowering.triton.permute.unpermute_from_masked` (``slot_rows=True``) compute in two launches,
    without the ``[T * K, H]`` rows between them (and without rounding them to ``a``'s dtype).

    Args:
        a: the activation rows ``[1, T * K, I]`` in slot order (bf16/fp16/fp32, any strides).
        b: ``[E, H, I]`` expert weights of ``a``'s dtype, any strides.
        rows: the call's :class:`SlotRows` (at most :data:`SLOT_DOWN_MAX_TOPK` slots a token).
        topk_weights: ``[T, K]`` routing weights. weights_on_output: False when they were applied to the input
            (the rows are then summed unweighted; identity experts are still scaled).
        bias: float ``[E, H]``, contiguous along H. hidden: ``[T, H]``, for identity experts.
        out_dtype: the result's dtype (default ``a``'s). The tile is :data:`SLOT_DOWN_TILE`.
    """
    name = "slot_down_combine"
    if not isinstance(rows, SlotRows):
        raise TypeError(f"{name}: needs rows in slot order (SlotRows), got {type(rows).__name__}")
    t, k = rows.topk_ids.shape
    if k > SLOT_DOWN_MAX_TOPK:
        raise ValueError(f"{name}: at most {SLOT_DOWN_MAX_TOPK} slots a token, got {k}")
    _check_operands(name, a, b, False, 3, grouped=False)
    e, h, inter = b.shape
    if rows.num_experts != e or tuple(a.shape) != (1, rows.num_rows, inter):
        raise ValueError(f"{name}: want a [1, {rows.num_rows}, {inter}] and b of {rows.num_experts} experts, got a "
                         f"{list(a.shape)} and b {list(b.shape)}")
    if tuple(topk_weights.shape) != (t, k) or topk_weights.device != a.device:
        raise ValueError(f"{name}: topk_weights must be [{t}, {k}] on {a.device}, got {list(topk_weights.shape)}")
    _check_bias(name, bias, e, h, a.device)
    identity = identity_experts > 0
    if identity and (hidden is None or tuple(hidden.shape) != (t, h)):
        raise ValueError(f"{name}: identity experts need hidden [{t}, {h}]")
    out = torch.empty(t, h, dtype=out_dtype or a.dtype, device=a.device)
    if _known_empty(t, h):
        return out
    cfg = SLOT_DOWN_TILE
    ids = rows.topk_ids
    hid_strides = hidden.stride() if identity else (0, 0)
    launch(
        "slot_down_combine_kernel", a.device, (cdiv(h, cfg["block_n"]), t),
        a, b, out, ids, topk_weights, hidden if identity else None, bias,
        h, inter, e, identity_experts,
        a.stride(1), a.stride(2), *b.stride(), *out.stride(), *ids.stride(), *topk_weights.stride(), *hid_strides,
        bias.stride(0) if bias is not None else 0,
        TOPK=k, BLOCK_N=cfg["block_n"], BLOCK_K=cfg["block_k"], UPCAST=a.device.type == "cpu",
        IEEE=a.dtype == torch.float32, HAS_W=weights_on_output, HAS_BIAS=bias is not None, IDENTITY=identity,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )  # fmt: skip
    return out


def _halves(epilogue: dict) -> bool:
    """The epilogue applies a gated activation whose gate and up rows are halves of ``b`` (not interleaved)."""
    return bool(epilogue["GATED"]) and not epilogue["INTERLEAVED"]


def _split_columns(cfg: configs.TileConfig, gate_up_layout: str) -> configs.TileConfig:
    """The tile of a gated epilogue launch from the unfused GEMM's (``cfg``, tuned for ``2I`` columns).

    Halves: gate and up get an accumulator each of half the unfused tile's columns (the same registers,
    the same weight bytes per k step, the same number of tiles). A swapped tile keeps its width: its
    columns are the MMA's M, which wgmma needs at 64 or more (and its accumulators are small).
    Interleaved: the unfused tile itself (its accumulator is split into gate and up columns).
    """
    if cfg.swap_ab or gate_up_layout == "interleaved":
        return cfg
    return replace(cfg, block_n=max(16, cfg.block_n // 2))


def tune_masked_gemm(
    kind: str,
    groups: int,
    n: int,
    k: int,
    expected_m: int,
    device: torch.device | str = "cuda",
    active_groups: int | None = None,
    *,
    force: bool = False,
    timings: dict[configs.TileConfig, float] | None = None,
) -> configs.TileConfig:
    """Benchmark the candidate tiles for one (kind, N, K, bucket) and cache the best on disk.

    ``force`` tunes again a bucket the cache already holds; ``timings`` receives each candidate's ms.

    Loads are uniform: ``expected_m`` rows in each of the first ``active_groups`` groups (all by
    default), the rest empty, as a decode step that hits few experts leaves them.
    """
    import triton.testing

    device = torch.device(device)
    bucket = configs.m_bucket(expected_m)
    m = max(expected_m, 1)
    active = groups if active_groups is None else max(1, min(active_groups, groups))
    masked_m = torch.zeros(groups, dtype=torch.int32, device=device)
    masked_m[:active] = m
    hints = {"expected_m": bucket, "max_total_m": active * m, "active_groups": active}
    if kind == "fp8":
        a = torch.randn(groups, m, k, device=device).to(_FP8)
        b = torch.randn(groups, n, k, device=device).to(_FP8)
        a_s = torch.rand(groups, m, cdiv(k, FP8_BLOCK), device=device) + 0.5
        b_s = torch.rand(groups, cdiv(n, FP8_BLOCK), cdiv(k, FP8_BLOCK), device=device) + 0.5

        def run(cfg):
            return masked_gemm_fp8(a, a_s, b, b_s, masked_m, config=cfg, **hints)
    else:
        a = torch.randn(groups, m, k, device=device, dtype=torch.bfloat16)
        b = torch.randn(groups, n, k, device=device, dtype=torch.bfloat16)

        def run(cfg):
            return masked_gemm(a, b, masked_m, config=cfg, **hints)

    def bench(cfg: configs.TileConfig) -> float:
        run(cfg)
        torch.cuda.synchronize(device)
        # CUDA-graph replays time the GPU alone: a plain call of a decode-sized GEMM is host-bound,
        # and timing the host would pick tiles at random
        with torch.cuda.device(device):
            return triton.testing.do_bench_cudagraph(lambda: run(cfg), rep=25)

    return configs.tune(kind, n, k, expected_m, device, bench, active_groups, force=force, timings=timings)
