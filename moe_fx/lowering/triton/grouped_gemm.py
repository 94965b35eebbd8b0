"""Masked grouped GEMMs (``c[g, :m_g] = a[g, :m_g] @ b[g]^T``) in Triton, bf16 and fp8 (1x128 / 128x128).

Both are persistent kernels that visit only the valid row tiles (``masked_m`` is read on the
device; nothing synchronises with the host, so they can be captured in CUDA graphs). Any ``M``,
``N``, ``K`` and group count: tails are masked. Rows ``>= masked_m[g]`` of the output are left as
they were (unwritten).
"""

from __future__ import annotations

import functools

import torch

from moe_fx.lowering.triton import configs
from moe_fx.lowering.triton._loader import is_traced, launch
from moe_fx.ops.recipe import FP8_BLOCK, FP8_DTYPE, cdiv

__all__ = ["check_offsets", "masked_gemm", "masked_gemm_fp8", "num_programs", "tune_masked_gemm"]

_FLOATS = (torch.bfloat16, torch.float16, torch.float32)
_FP8 = FP8_DTYPE


def _hint(v: object) -> int | None:
    """A plain int for a host-side hint: a SymInt's hint while traced (for tile choice only: the
    graph then serves nearby sizes with the same tiles; see :mod:`moe_fx.lowering.problem`)."""
    if v is None or isinstance(v, int):
        return v
    node = v.node
    hint = node.hint if node.hint is not None else node.shape_env.size_hint(node.expr)
    return int(hint)


def _known_empty(*sizes: object) -> bool:
    """True only when a size is statically 0 (a symbolic size is assumed to be >= 1: no guard)."""
    return any(isinstance(s, int) and s == 0 for s in sizes)


def num_programs(device: torch.device, cfg: configs.TileConfig, tile_bound: object) -> int:
    """Persistent grid size: enough programs to fill the GPU, never more than the tiles there can be.

    A symbolic bound (the token count is dynamic in a compiled graph) gives the full-GPU size: the
    programs without a tile return at once, and the grid stays a constant of the compiled code.
    """
    full = 4 if device.type != "cuda" else _sms(device) * cfg.programs_per_sm
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
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _capability(index) >= (9, 0)


@functools.cache
def _capability(index: int) -> tuple[int, int]:
    return tuple(torch.cuda.get_device_capability(index))


def _operands(cfg: configs.TileConfig, a: torch.Tensor, b: torch.Tensor) -> tuple[object, object, bool]:
    """``(a, b, tma)``: TMA descriptors when the config asks for them and the tensors allow it.

    Not while traced for Inductor: host-side descriptors cannot be recorded outside Dynamo's own
    tracing (torch 2.11-2.13), so compiled graphs load tiles through pointers.
    """
    if is_traced(a) or not (cfg.tma and _tma_capable(a.device) and _tma_ok(a) and _tma_ok(b)):
        return a, b, False
    from triton.tools.tensor_descriptor import TensorDescriptor

    return (
        TensorDescriptor.from_tensor(a, [1, cfg.block_m, cfg.block_k]),
        TensorDescriptor.from_tensor(b, [1, cfg.block_n, cfg.block_k]),
        True,
    )


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

    Returns:
        ``[G, M, N]`` in ``a.dtype``. Any of M, expected_m, max_total_m may be symbolic while traced.
    """
    if a.dim() != 3 or b.dim() != 3 or a.shape[0] != b.shape[0] or a.shape[2] != b.shape[2]:
        raise ValueError(f"masked_gemm: want a [G, M, K] and b [G, N, K], got {list(a.shape)} and {list(b.shape)}")
    if a.dtype not in _FLOATS or b.dtype != a.dtype:
        raise TypeError(f"masked_gemm: a and b must share a dtype of {_FLOATS}, got {a.dtype} and {b.dtype}")
    g, m, k = a.shape
    n = b.shape[1]
    _check_masked("masked_gemm", masked_m, g, a.device)
    _check_bias("masked_gemm", bias, g, n, a.device)
    out = _out("masked_gemm", out, (g, m, n), a.dtype, a.device)
    check_offsets("masked_gemm", a, b, out)
    if _known_empty(g, m, n):
        return out
    cfg = config or configs.fit_smem(
        configs.get_config("bf16", n, k, _hint(expected_m if expected_m is not None else m), a.device,
                           _hint(active_groups), _sms(a.device), allow_tma=not is_traced(a)),
        a.element_size(),
    )
    nprog = num_programs(a.device, cfg, _tile_bound(g, m, n, cfg, max_total_m))
    a_in, b_in, tma = _operands(cfg, a, b)
    launch(
        "masked_gemm_kernel", a.device, (nprog,),
        a_in, b_in, out, masked_m,
        g, m, n, k,
        *a.stride(), *b.stride(), *out.stride(),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
        E_POW2=_pow2(g), EVEN_K=k % cfg.block_k == 0, IEEE=a.dtype == torch.float32, UPCAST=a.device.type == "cpu",
        TMA=tma, **_bias_args(bias), num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
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
        bias, expected_m, max_total_m, config, active_groups: as in :func:`masked_gemm`.

    Returns:
        bf16 ``[G, M, N]``.
    """
    if a.dim() != 3 or b.dim() != 3 or a.shape[0] != b.shape[0] or a.shape[2] != b.shape[2]:
        raise ValueError(f"masked_gemm_fp8: want a [G, M, K] and b [G, N, K], got {list(a.shape)} and {list(b.shape)}")
    if a.dtype != _FP8 or b.dtype != _FP8:
        raise TypeError(f"masked_gemm_fp8: a and b must be float8_e4m3fn, got {a.dtype} and {b.dtype}")
    g, m, k = a.shape
    n = b.shape[1]
    kb = cdiv(k, FP8_BLOCK)
    if tuple(a_scale.shape) != (g, m, kb) or a_scale.dtype != torch.float32:
        raise ValueError(
            f"masked_gemm_fp8: a_scale must be float32 {[g, m, kb]}, got {a_scale.dtype} {list(a_scale.shape)}"
        )
    nb = cdiv(n, FP8_BLOCK)
    if tuple(b_scale.shape) != (g, nb, kb) or b_scale.dtype != torch.float32:
        raise ValueError(
            f"masked_gemm_fp8: b_scale must be float32 {[g, nb, kb]}, got {b_scale.dtype} {list(b_scale.shape)}"
        )
    _check_masked("masked_gemm_fp8", masked_m, g, a.device)
    _check_bias("masked_gemm_fp8", bias, g, n, a.device)
    out = _out("masked_gemm_fp8", out, (g, m, n), torch.bfloat16, a.device)
    check_offsets("masked_gemm_fp8", a, a_scale, b, b_scale, out)
    if _known_empty(g, m, n):
        return out
    cfg = config or configs.get_config(
        "fp8", n, k, _hint(expected_m if expected_m is not None else m), a.device, _hint(active_groups),
        _sms(a.device), allow_tma=not is_traced(a),
    )
    if FP8_BLOCK % cfg.block_k:
        raise ValueError(f"masked_gemm_fp8: block_k must divide {FP8_BLOCK} (one scale group per k step), got {cfg.block_k}")
    nprog = num_programs(a.device, cfg, _tile_bound(g, m, n, cfg, max_total_m))
    a_in, b_in, tma = _operands(cfg, a, b)
    launch(
        "masked_gemm_fp8_kernel", a.device, (nprog,),
        a_in, a_scale, b_in, b_scale, out, masked_m,
        g, m, n, k,
        *a.stride(), *a_scale.stride(), *b.stride(), *b_scale.stride(), *out.stride(),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
        E_POW2=_pow2(g), EVEN_K=k % cfg.block_k == 0, UPCAST=a.device.type == "cpu",
        TMA=tma, SCALAR_BS=FP8_BLOCK % cfg.block_n == 0, **_bias_args(bias),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    return out


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
