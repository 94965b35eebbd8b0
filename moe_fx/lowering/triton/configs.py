"""Tile configurations of the masked grouped GEMMs, by shape bucket, with a tuning cache on disk.

A problem is keyed by the GEMM kind (``"bf16"`` covers bf16/fp16/fp32, ``"fp8"``, ``"w8a16"``: bf16
activations times fp8 weights, which falls back to the ``"fp8"`` entries: the same weight stream), ``N``, ``K`` and a
bucket of the expected rows per expert (``expected_m``, a host-side estimate such as
``ceil(T * K / E)``; never read from ``masked_m``, which stays on the device): powers of two from
16 to 4096; decode buckets (up to 32 rows) also by a bucket of the experts hit (``min(E, T * K)``:
Mixtral at T=1 hits 2 of 8 experts, Qwen3 8 of 128, and the best tile differs). Lookup order for a key: this process's memory, the user cache file
(``$MOE_FX_CACHE_DIR`` or ``~/.cache/moe_fx``, ``triton_tiles.json``), the table shipped with the
package (``tuned_tiles.json``, measured on an H200), then those keys under the tuned GPU of the same compute
capability (:data:`TUNED_DEVICE`: an H100 reads the H200's tiles), then the regime entry of the nearest tuned
shape on the same device (then on that GPU), then a Hopper heuristic (decode: 16-row tiles
that stream the weights; prefill: 128-row tiles). :func:`tune` benchmarks the candidates of a
bucket and writes the winner to the user cache, so a second run does not tune again.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import pathlib
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace

import torch

__all__ = [
    "TUNED_DEVICE",
    "TileConfig",
    "cache_path",
    "candidates",
    "fit_smem",
    "get_config",
    "m_bucket",
    "nearest_regime_entry",
    "pick_regime_config",
    "programs_that_fit",
    "regime_bucket",
    "regime_candidates",
    "regime_key",
    "resident_programs",
    "store",
    "tile_devices",
    "tile_source",
    "tune",
]

log = logging.getLogger("moe_fx.lowering.triton")


@dataclass(frozen=True)
class TileConfig:
    """One launch configuration of a masked GEMM kernel."""

    block_m: int
    block_n: int
    block_k: int
    group_m: int = 8
    num_warps: int = 4
    num_stages: int = 4
    programs_per_sm: int = 1
    #: load A and B tiles through TMA tensor descriptors (Hopper's copy engine) instead of pointer
    #: arithmetic; used only where the tensors meet TMA's alignment rules (else pointers, silently).
    #: The sorted layout makes its descriptors on the device (also in Inductor-launched kernels; a
    #: gathered A stays on pointers), the masked layout on the host (eager calls only).
    tma: bool = False
    #: compute ``acc^T = b^T a^T``: with few rows per tile (decode) the weight tile becomes the MMA's
    #: M dimension, so Hopper's wgmma (64+ rows) runs instead of the older mma for 16-row tiles
    swap_ab: bool = False
    #: one software pipeline over all of a program's (tile, k step) pairs (Triton's loop flattening): the
    #: next tile's loads run during a tile's epilogue, where the nested loops fill and drain the pipeline
    #: per tile (short-K GEMMs and decode GEMVs of several tiles per program pay that every tile)
    flatten: bool = False

    def smem_bytes(self, elem_bytes: int, b_tiles: int = 1) -> int:
        """Shared memory the pipelined A and B tiles take (the kernel's dominant use).

        ``b_tiles``: weight tiles per k step: 2 where a swapped tile applies gate/up halves in its epilogue
        (it keeps its width and loads the gate's and the up's rows: ``grouped_gemm._split_columns``).

        fp32 operands take one more half-size buffer: 128x256x64 at 2 stages asked for 240 KB, 48 KB
        over its 192 KB of tiles (triton 3.6 on an H200, 2026-12-04). A flattened loop's epilogue stages
        its tile through shared memory: 2-32 KB more in every tile compiled for sm_90 with triton 3.6
        (128x256 and 128x128: 32 KB; 64x128: 8 KB; 16x64 swapped: 2 KB), counted as ``min(2 BM BN, 32 KB)``.
        """
        tiles = (self.block_m + b_tiles * self.block_n) * self.block_k * elem_bytes * self.num_stages
        tiles += (self.block_m + b_tiles * self.block_n) * self.block_k * 2 if elem_bytes >= 4 else 0
        return tiles + (min(2 * self.block_m * self.block_n, FLATTEN_EPILOGUE_SMEM) if self.flatten else 0)


#: the most shared memory a flattened loop's epilogue was seen to add (see :meth:`TileConfig.smem_bytes`)
FLATTEN_EPILOGUE_SMEM = 32 * 1024


def resident_programs(cfg: TileConfig, elem_bytes: int, b_tiles: int = 1) -> int:
    """Programs of ``cfg`` per SM a persistent grid is sized for: its ``programs_per_sm``, fewer where the launch's
    tiles do not fit side by side (:func:`programs_that_fit`; a swapped tile with gate/up halves in its epilogue
    loads ``b_tiles = 2`` weight tiles per k step: the unfused GEMM's 2 x 80 KB become 2 x 147 KB for
    16x64x128, 4 stages). A grid sized for more programs than fit runs the rest as a second wave."""
    return max(1, min(cfg.programs_per_sm, programs_that_fit(cfg.smem_bytes(elem_bytes, b_tiles))))


#: shared memory of one Hopper SM (sm_90: 228 KB), of which every program resident on it reserves
#: :data:`BLOCK_RESERVED_SMEM` (CUDA's per-block reservation) besides what it asks for
SM_SMEM = 228 * 1024
BLOCK_RESERVED_SMEM = 1024
#: what Triton adds to :meth:`TileConfig.smem_bytes` (its barriers: 32 bytes in every tile compiled so far), with room
SMEM_MARGIN = 1024
#: shared memory one program's pipelined tiles may take: sm_90's 227 KB a block less :data:`SMEM_MARGIN`. The
#: 128x256x64 bf16 tile at 4 stages with a flattened loop asks for 229408 bytes (triton 3.6 and 3.9), and it was
#: the fastest prefill tile on an H100 (2026-12-06), so the budget is the hardware's, not a rounder number below it
SMEM_BUDGET = 226 * 1024  # SM_SMEM - BLOCK_RESERVED_SMEM - SMEM_MARGIN, written out: settings read literals


def programs_that_fit(smem_bytes: int) -> int:
    """Programs asking for ``smem_bytes`` each (:meth:`TileConfig.smem_bytes`) that one SM holds side by side: a
    persistent grid sized for more runs its last programs as a second wave. 0 where one does not fit."""
    return SM_SMEM // (smem_bytes + BLOCK_RESERVED_SMEM + SMEM_MARGIN)


def fit_smem(cfg: TileConfig, elem_bytes: int) -> TileConfig:
    """``cfg`` with fewer stages, then a shorter k step, until its tiles of ``elem_bytes`` fit the budget.

    Tile tables are keyed by kind, not by element size: an entry tuned for bf16 also serves fp32
    operands, whose tiles take twice the shared memory.
    """
    while cfg.smem_bytes(elem_bytes) > SMEM_BUDGET:
        if cfg.num_stages > 2:
            cfg = replace(cfg, num_stages=cfg.num_stages - 1)
        elif cfg.block_k > 32:
            cfg = replace(cfg, block_k=cfg.block_k // 2)
        else:
            break
    return cfg


def m_bucket(expected_m: int) -> int:
    """Power-of-two bucket of the expected rows per expert, clamped to [16, 4096]."""
    b = 16
    while b < expected_m and b < 4096:
        b *= 2
    return b


def _heuristic(
    kind: str, n: int, k: int, bucket: int, active_groups: int | None = None, num_sms: int = 132
) -> TileConfig:
    fp8 = kind in ("fp8", "w8a16")  # fp8 weights: k steps of one 128-wide scale group
    bk = 128 if fp8 else 64
    if bucket <= 32:
        # Decode: weights stream through 16/32-row tiles. 64-column tiles, two programs per SM,
        # measured well when there are many tiles; with few (few experts hit, small N: Mixtral's
        # down projection at T=1 has 2 x 64 tiles) half the SMs would idle, so narrow the tiles and
        # run more programs per SM to keep more loads in flight.
        bm = 16 if bucket <= 16 else 32
        bn, ppsm = 64, 2
        if active_groups is not None and active_groups * -(-n // 64) < 2 * num_sms:
            bn, ppsm = 32, 4
        return TileConfig(bm, bn, 128, 1, 4, 5 if fp8 else 4, ppsm)
    if bucket <= 64:
        # two programs per SM (98 KB of shared memory each) keep more weight bytes in flight
        return TileConfig(64, 128, bk, 4, 4, 4, 2 if fp8 else 1)
    if fp8:
        return TileConfig(128, 128, 128, 8, 8, 4, 1, tma=True)
    return TileConfig(128, 256, 64, 8, 8, 3, 1, tma=True)


def candidates(kind: str, bucket: int) -> list[TileConfig]:
    """The configurations :func:`tune` tries for a bucket (a short list: tuning runs on a lease)."""
    fp8 = kind == "fp8"
    if bucket <= 32:
        # Decode: the GEMMs stream weights; what matters is bytes in flight per SM (tile width x
        # k step x stages x programs per SM) against the number of tiles there are to spread.
        bm = 16 if bucket <= 16 else 32
        out = []
        for bn in (32, 64, 128):
            for ppsm in (2, 4) if bn == 32 else (1, 2):
                cfg = TileConfig(bm, bn, 128, 1, 4, 5 if fp8 else 4, ppsm)
                if programs_that_fit(cfg.smem_bytes(1 if fp8 else 2)) >= ppsm:
                    out.append(cfg)
        if not fp8:  # fp8 steps are one 128-wide scale group; bf16 can take longer k steps
            for cfg in (TileConfig(bm, 32, 256, 1, 4, 4, 2), TileConfig(bm, 64, 256, 1, 4, 3, 1)):
                if programs_that_fit(cfg.smem_bytes(2)) >= cfg.programs_per_sm:
                    out.append(cfg)
        return out
    if bucket <= 128:
        if fp8:
            return [
                TileConfig(64, 128, 128, 4, 4, 4, 2),
                TileConfig(64, 128, 128, 4, 4, 4, 2, tma=True),
                TileConfig(64, 256, 128, 4, 8, 3, 1, tma=True),
                TileConfig(128, 128, 128, 8, 8, 4, 1, tma=True),
            ]
        return [
            TileConfig(64, 128, 64, 4, 4, 4, 1),
            TileConfig(64, 128, 64, 4, 4, 4, 2, tma=True),
            TileConfig(64, 256, 64, 4, 8, 4, 1, tma=True),
            TileConfig(128, 128, 64, 8, 8, 4, 1, tma=True),
        ]
    if fp8:
        # Two resident programs per SM let one promote (scale) its partial sums while the other's
        # tensor-core work runs: the overlap that DeepGEMM gets from two consumer warp groups.
        return [
            TileConfig(128, 128, 128, 8, 8, 4, 1),
            TileConfig(128, 128, 128, 8, 8, 4, 1, tma=True),
            TileConfig(64, 128, 128, 8, 4, 4, 2),
            TileConfig(64, 128, 128, 8, 4, 4, 2, tma=True),
        ]
    return [
        TileConfig(128, 256, 64, 8, 8, 3, 1),
        TileConfig(128, 256, 64, 8, 8, 3, 1, tma=True),
        TileConfig(128, 128, 64, 8, 8, 4, 1, tma=True),
        TileConfig(128, 128, 64, 8, 4, 3, 2, tma=True),
        TileConfig(64, 256, 64, 8, 4, 4, 1, tma=True),
    ]


def regime_candidates(kind: str, regime: int) -> list[TileConfig]:
    """The configurations ``bench/tune_tiles.py --sorted`` tries for a rows-per-expert regime.

    Short lists (tuning runs on a lease): every candidate is timed at every token count of the
    regime and the one with the best worst case is kept (:func:`pick_regime_config`). Real routings
    are uneven: an expert of a regime that expects up to 16 rows gets 20 and more, so each regime
    also tries row tiles twice its bound (a second row tile streams the expert's weights again).
    Swapped tiles (``swap_ab``) put decode tiles on wgmma; ``tma`` tiles make their descriptors on
    the device; ``flatten`` tiles pipeline across a program's tiles (twins of earlier winners).
    """
    from moe_fx.lowering.problem import regime_bounds

    fp8 = kind == "fp8"
    _, hi = regime_bounds(regime)
    T = TileConfig
    # both bf16 prefill regimes (65-256 rows per expert and above): the 4-stage 128x256x64 twin came first in a
    # trial on an H100 (2026-12-06, bench/results/tune_tiles_sorted_2026-12-06_bf16_prefill_flat4_h100.md)
    bf16_prefill_flat = [T(128, 256, 64, 8, 8, 3, 1, tma=True), T(128, 128, 64, 8, 8, 4, 1, tma=True),
                         T(128, 256, 64, 8, 8, 4, 1, tma=True)]
    # 64-row tiles halve the padding of an expert's last tile (Qwen3 T=4096: 21% of the 128-row tiles' rows are
    # padding, 12% of 64-row ones); 64x256 on 8 warps keeps wgmma's width and a 128x128 tile's operand bytes per
    # FLOP within 25% (64x128 tiles lost 1.1-1.5x). Compiled for sm_90 on the CPU: 142 registers, no spills, 160 KB
    # of shared memory. On an H100 it lost 1.10-1.34x at every Qwen3 prefill T, both GEMMs (bench/results/
    # tune_tiles_sorted_2026-12-06_bf16_prefill_qwen3_s19_h100.md); it stays a candidate for the untimed H200
    bf16_prefill_half_rows = T(64, 256, 64, 8, 8, 4, 1, tma=True)
    if hi is not None and hi <= 4:  # decode: the weights stream; bytes in flight per SM decide
        if fp8:
            # 3-4 resident programs of 16x64 / 16x128 tiles: vLLM's H200 decode tiles (16x128x128, 3 stages)
            # run ~4 CTAs per SM, twice the weight bytes in flight of two programs (Qwen3 fp8 T=64: 181 vs 218 µs)
            cands = [T(16, 64, 128, 1, 4, 5, 2), T(16, 128, 128, 1, 4, 5, 1), T(16, 32, 128, 1, 4, 5, 4),
                     T(16, 64, 128, 1, 4, 5, 2, swap_ab=True), T(16, 128, 128, 1, 4, 4, 1, swap_ab=True),
                     T(16, 128, 128, 1, 4, 3, 3), T(16, 128, 128, 1, 4, 3, 3, swap_ab=True),
                     T(16, 64, 128, 1, 4, 4, 4, swap_ab=True)]
            flat = [T(16, 64, 128, 1, 4, 4, 3, swap_ab=True), T(16, 128, 128, 1, 4, 3, 3, swap_ab=True)]
        else:
            cands = [T(16, 64, 128, 1, 4, 4, 2), T(16, 32, 256, 1, 4, 4, 2), T(16, 128, 128, 1, 4, 4, 1),
                     T(16, 64, 256, 1, 4, 3, 1), T(16, 64, 128, 1, 4, 4, 2, swap_ab=True),
                     T(16, 64, 64, 1, 4, 4, 4), T(16, 128, 64, 1, 4, 3, 3, swap_ab=True),
                     T(16, 64, 64, 1, 4, 4, 2, swap_ab=True)]
            flat = [T(16, 64, 128, 1, 4, 4, 2, swap_ab=True), T(16, 64, 128, 1, 4, 4, 2)]
    elif hi is not None and hi <= 16:
        if fp8:
            cands = [T(16, 64, 128, 1, 4, 5, 2), T(32, 128, 128, 4, 4, 4, 2), T(32, 64, 128, 1, 4, 4, 2, swap_ab=True),
                     T(16, 128, 128, 1, 4, 4, 1, swap_ab=True), T(16, 128, 128, 1, 4, 3, 3),
                     T(32, 128, 128, 1, 4, 3, 2, swap_ab=True)]
            flat = [T(16, 128, 128, 1, 4, 3, 2), T(32, 64, 128, 1, 4, 4, 2, swap_ab=True)]
        else:
            cands = [T(16, 64, 128, 1, 4, 4, 2), T(16, 32, 256, 1, 4, 4, 2), T(32, 64, 128, 1, 4, 4, 2),
                     T(32, 128, 128, 1, 4, 3, 1), T(32, 64, 128, 1, 4, 4, 2, swap_ab=True), T(16, 64, 64, 1, 4, 4, 4),
                     T(32, 128, 64, 1, 4, 3, 3, swap_ab=True), T(32, 64, 64, 1, 4, 4, 2, swap_ab=True)]
            flat = [T(32, 64, 128, 1, 4, 4, 2, swap_ab=True), T(16, 64, 128, 1, 4, 4, 2)]
    elif hi is not None and hi <= 64:
        if fp8:
            cands = [T(32, 128, 128, 4, 4, 4, 2), T(64, 128, 128, 4, 4, 4, 2), T(128, 128, 128, 8, 8, 4, 1),
                     T(64, 128, 128, 4, 4, 4, 2, tma=True), T(32, 128, 128, 1, 4, 3, 2)]
            flat = [T(64, 128, 128, 4, 4, 3, 2), T(128, 128, 128, 8, 8, 4, 1, tma=True)]
        else:
            # 128x256: vLLM's tuned H200 tile at these sizes (Mixtral T=256: 737 against 865 µs, 2026-12-04), which
            # runs 4 stages (196 KB)
            cands = [T(32, 64, 128, 4, 4, 4, 2), T(64, 128, 64, 4, 4, 4, 1), T(64, 64, 128, 4, 4, 3, 2),
                     T(128, 128, 64, 8, 8, 4, 1), T(64, 128, 64, 4, 4, 4, 1, tma=True), T(128, 256, 64, 8, 8, 3, 1),
                     T(128, 256, 64, 8, 8, 3, 1, tma=True), T(128, 256, 64, 1, 8, 4, 1),
                     T(128, 256, 64, 1, 8, 4, 1, tma=True)]
            flat = [T(128, 256, 64, 1, 8, 3, 1, tma=True), T(64, 128, 64, 4, 4, 4, 1, tma=True)]
    elif fp8:  # more than 64 rows per expert (both prefill regimes); 64x64x128 at three programs per SM lost at
        # every T on an H100 (1.02-2.5x, bench/results/tune_tiles_sorted_2026-12-05_fp8_prefill_*_h100.md)
        cands = [T(64, 128, 128, 8, 4, 4, 2), T(128, 128, 128, 8, 8, 4, 1), T(128, 128, 128, 8, 8, 4, 1, tma=True),
                 T(64, 128, 128, 8, 4, 4, 2, tma=True)]
        flat = [T(64, 128, 128, 8, 4, 3, 2), T(128, 128, 128, 8, 8, 4, 1, tma=True)]
    elif hi is not None:
        cands = [T(64, 128, 64, 8, 4, 4, 2), T(128, 128, 64, 8, 8, 4, 1), T(128, 256, 64, 8, 8, 3, 1),
                 T(128, 256, 64, 8, 8, 3, 1, tma=True), T(128, 128, 64, 8, 8, 4, 1, tma=True),
                 T(128, 256, 64, 8, 8, 4, 1, tma=True), bf16_prefill_half_rows]
        flat = bf16_prefill_flat
    else:
        cands = [T(128, 256, 64, 8, 8, 3, 1), T(128, 128, 64, 8, 8, 4, 1), T(128, 128, 64, 8, 4, 3, 2),
                 T(128, 256, 64, 8, 8, 3, 1, tma=True), T(128, 128, 64, 8, 4, 3, 2, tma=True),
                 T(128, 256, 64, 8, 8, 4, 1, tma=True), bf16_prefill_half_rows]
        flat = bf16_prefill_flat
    # flattened twins of the tiles that won (or came close) in the 2026-12-04 tuning, at a stage count whose
    # epilogue staging still fits two programs per SM where the twin runs two. Programs per SM are what fits
    # side by side in registers too (tests/test_triton_compile.py compiles every candidate as launched): the
    # 32x128x128 fp8 tiles of 2026-12-04 asked for 3 with ~190 registers a thread (2 fit), so a third of their
    # grid ran as a second wave. The swapped bf16 16x64x64 / 32x64x64 tiles fit two programs per SM where GEMM1
    # applies gate/up halves in two accumulators (two weight tiles per k step: grouped_gemm.PAIR_GATE_UP off), which
    # 16x64x128 / 32x64x128 do not; paired gate/up rows (the default) load one weight tile like the unfused GEMM.
    return cands + [replace(c, flatten=True) for c in flat]


def pick_regime_config(timings: dict[int, dict[TileConfig, float]]) -> tuple[TileConfig, float]:
    """The configuration whose worst slowdown over the token counts of a regime is least.

    ``timings[T][cfg]`` = time of ``cfg`` at token count T (any unit; a failed candidate is absent).
    Returns ``(config, worst)`` with ``worst = max_T time(config, T) / min_cfg time(cfg, T)`` (1.0 =
    the best at every T). Only candidates timed at every T compete.
    """
    if not timings:
        raise ValueError("pick_regime_config: no timings")
    common = set.intersection(*(set(per) for per in timings.values()))
    if not common:
        raise ValueError("pick_regime_config: no candidate was timed at every token count")
    best_at = {t: min(per.values()) for t, per in timings.items()}

    def worst(cfg: TileConfig) -> float:
        return max(per[cfg] / best_at[t] for t, per in timings.items())

    cfg = min(sorted(common, key=lambda c: asdict(c).__repr__()), key=worst)
    return cfg, worst(cfg)


def store(entries: dict[str, TileConfig]) -> None:
    """Write tuned entries to the user cache (merged with what another process wrote meanwhile)."""
    for key, cfg in entries.items():
        _memory.pop(key, None)
        _disk()[key] = asdict(cfg)
    _memory.clear()  # lookups memoise by call site; a new entry must be seen
    path = cache_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    merged = _read(path)
    merged.update(_disk())
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(merged, indent=1, sort_keys=True))
    os.replace(tmp, path)


def cache_path() -> pathlib.Path:
    """The user tuning cache file."""
    root = os.environ.get("MOE_FX_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "moe_fx")
    return pathlib.Path(root) / "triton_tiles.json"


def _device_name(device: torch.device) -> str:
    if device.type != "cuda":
        return device.type
    from moe_fx.lowering.problem import probe_capabilities

    return probe_capabilities(device).device_name


def _capability(device: torch.device) -> tuple[int, int] | None:
    if device.type != "cuda":
        return None
    from moe_fx.lowering.problem import probe_capabilities

    return probe_capabilities(device).capability


#: The GPU whose tuned tiles a GPU of the same compute capability borrows for the shapes it has no tiles of its
#: own for (:func:`tile_devices`). An H100 runs the H200's SM (sm_90, 132 SMs, the same shared memory); only the
#: HBM differs. With the heuristic instead, an H100 ran Qwen3-30B-A3B's layer at 48% of its floor at T=4096
#: (bench/results/h100_2026-12-05_summary.md).
TUNED_DEVICE = {(9, 0): "NVIDIA H200"}


def tile_devices(device_name: str, capability: tuple[int, int] | None) -> tuple[str, ...]:
    """The device names whose tiles a GPU reads, in order: its own, then :data:`TUNED_DEVICE`'s of its compute
    capability (when that is another GPU)."""
    sibling = TUNED_DEVICE.get(capability) if capability is not None else None
    return (device_name,) if sibling in (None, device_name) else (device_name, sibling)


def _key(
    device_name: str, kind: str, n: int, k: int, bucket: int, active_groups: int | None = None, *, ptr: bool = False
) -> str:
    """Cache key; decode buckets (<= 32 rows) also carry a bucket of the experts hit, which sets their best tile;
    ``ptr`` keys hold the best tile among those that load through pointers (no TMA descriptors)."""
    key = f"{device_name}|{kind}|N{n}|K{k}|m{bucket}"
    if active_groups is not None and bucket <= 32:
        key += f"|g{m_bucket(active_groups)}"
    return key + ("|ptr" if ptr else "")


def _read(path: pathlib.Path) -> dict[str, dict]:
    try:
        with open(path) as f:
            data = json.load(f)
    except FileNotFoundError:
        return {}
    except (OSError, json.JSONDecodeError) as err:
        log.warning("moe_fx: ignoring unreadable tile cache %s (%s)", path, err)
        return {}
    return data if isinstance(data, dict) else {}


@functools.cache
def _shipped() -> dict[str, dict]:
    return _read(pathlib.Path(__file__).with_name("tuned_tiles.json"))


_memory: dict[str, TileConfig] = {}
_disk_loaded: dict[str, dict] | None = None


def _disk() -> dict[str, dict]:
    global _disk_loaded
    if _disk_loaded is None:
        _disk_loaded = _read(cache_path())
    return _disk_loaded


def regime_bucket(regime: int) -> int:
    """The rows bucket that stands for a rows-per-expert regime when the token count is symbolic.

    A graph compiled for a dynamic T serves every T of its regime (:mod:`moe_fx.lowering.problem`);
    its tiles must not depend on the T it happened to be traced with (a graph first traced at
    T=256 ran Mixtral at T=4096 with 64-row tiles, 1.7x slower: the machine-to-machine "spread").
    """
    from moe_fx.lowering.problem import regime_bounds

    lo, hi = regime_bounds(regime)
    return m_bucket(hi if hi is not None else 4 * lo)


def regime_key(device_name: str, kind: str, n: int, k: int, layout: str, regime: int, slots: int | None = None) -> str:
    """Key of a regime's tuned tile: one configuration for every token count of the regime.

    With ``slots`` (``T * K``, the sorted rows of a call whose token count is static): the key of the
    best tile at exactly that size, shipped where it beats the regime's by a margin (a graph Dynamo
    specialised, such as every T=1 decode step, then runs it).
    """
    return f"{device_name}|{kind}|N{n}|K{k}|{layout}|r{regime}" + (f"|s{slots}" if slots is not None else "")


#: how far (``|log2 N ratio| + |log2 K ratio|``) a tuned shape's tile is carried to an untuned one: a tile
#: tuned for 2048-wide GEMMs is no guide for a 128-wide test layer (nor does it fit its fp32 operands)
NEAREST_MAX_DISTANCE = 2.0


def nearest_regime_entry(
    tables: tuple[dict[str, dict], ...], device_name: str, kinds: tuple[str, ...], n: int, k: int, layout: str,
    regime: int,
) -> tuple[str, dict] | None:
    """The regime entry (key, tile) of the tuned GEMM shape nearest to ``N x K`` (same device, kind, layout and regime).

    Distance is ``|log2(N / N')| + |log2(K / K')|``, at most :data:`NEAREST_MAX_DISTANCE`, the first kind of
    ``kinds`` before the others; ties go
    to the earlier table (the user cache before the shipped one), then the first key in sorted order.
    Tiles transfer between nearby shapes far better than the heuristic guesses: OLMoE's GEMMs (2048 x 2048,
    2048 x 1024), untuned, ran 3-30% (bf16) and 14-45% (fp8) slower per regime than tuned with the
    heuristic's tiles, and within 0-6% (bf16) and 0-16% (fp8) with Qwen3-MoE's
    (bench/results/tune_tiles_sorted_2026-12-04_olmoe.md). ``None`` when no entry qualifies.
    """
    import math

    best: tuple[float, int, str, dict] | None = None
    for order, table in enumerate(tables):
        for key, raw in table.items():
            f = _regime_key_fields(key)
            if (f is None or f[0] != device_name or f[1] not in kinds or f[4] != layout or f[5] != regime
                    or f[6] is not None):
                continue
            dist = abs(math.log2(n / f[2])) + abs(math.log2(k / f[3]))
            if dist > NEAREST_MAX_DISTANCE:
                continue
            dist += kinds.index(f[1]) * 1e3
            if best is None or (dist, order, key) < best[:3]:
                best = (dist, order, key, raw)
    return (best[2], best[3]) if best else None


def tile_source(kind: str, n: int, k: int, device_name: str, layout: str = "sorted",
                capability: tuple[int, int] | None = None) -> str | None:
    """What a ``N x K`` GEMM's tiles come from when nobody tuned that shape on ``device_name``; ``None`` if tuned.

    For ``moe_fx.explain``: ``"2048x2048: none tuned on <gpu>, <tuned gpu>'s (compute capability 9.0)"`` (the
    shape tuned on :data:`TUNED_DEVICE`'s GPU of ``capability``), ``"...: none tuned on <gpu>, the nearest tuned
    shape's (1536x2048)"`` or ``"...: none tuned on <gpu>, a heuristic's"``.
    """
    tables = (_disk(), _shipped())

    def tuned(dev: str) -> bool:
        return any((f := _regime_key_fields(key)) and f[:5] == (dev, kind, n, k, layout) for t in tables for key in t)

    names = tile_devices(device_name, capability)
    if tuned(device_name):
        return None
    for dev in names[1:]:
        if tuned(dev):
            return f"{n}x{k}: none tuned on {device_name}, {dev}'s (compute capability {capability[0]}.{capability[1]})"
    from moe_fx.lowering.problem import ROW_REGIMES

    near = None
    for dev in names:
        for regime in range(len(ROW_REGIMES) + 1):  # the first regime with a nearby tuned shape names it
            near = near or nearest_regime_entry(tables, dev, (kind,), n, k, layout, regime)
    if near is None:
        return f"{n}x{k}: none tuned on {device_name}, a heuristic's"
    dev, _, n2, k2, *_ = _regime_key_fields(near[0])
    where = "" if dev == device_name else f" on {dev}"
    return f"{n}x{k}: none tuned on {device_name}, the nearest tuned shape's ({n2}x{k2}{where})"


def _regime_key_fields(key: str) -> tuple[str, str, int, int, str, int, int | None] | None:
    """``(device, kind, N, K, layout, regime, slots or None)`` of a :func:`regime_key`; ``None`` for other keys."""
    parts = key.split("|")
    if len(parts) not in (6, 7) or parts[5][:1] != "r" or (len(parts) == 7 and parts[6][:1] != "s"):
        return None
    try:
        n, k, regime = int(parts[2].removeprefix("N")), int(parts[3].removeprefix("K")), int(parts[5][1:])
        slots = int(parts[6][1:]) if len(parts) == 7 else None
    except ValueError:
        return None
    return parts[0], parts[1], n, k, parts[4], regime, slots


def get_config(
    kind: str,
    n: int,
    k: int,
    expected_m: int | None,
    device: torch.device,
    active_groups: int | None = None,
    num_sms: int = 132,
    *,
    allow_tma: bool = True,
    layout: str = "masked",
    regime: int | None = None,
    symbolic: bool = False,
    slots: int | None = None,
) -> TileConfig:
    """The tile configuration for a grouped GEMM of ``kind`` ("bf16" / "fp8") on ``device``.

    Lookup: the regime's entry (``layout`` "masked" or "sorted", tuned over every token count of the
    regime by ``bench/tune_tiles.py``) when ``regime`` is given; else the rows bucket of
    ``expected_m`` — the regime's bucket when the token count is ``symbolic`` (never the size a graph
    happened to be traced with) — in the user cache, then the shipped table, for this GPU and then for the tuned
    GPU of its compute capability (:func:`tile_devices`); then, with a regime, the entry of the nearest tuned
    shape (:func:`nearest_regime_entry`), on the same two GPUs in that order; then the heuristic.
    ``active_groups`` (host-side estimate of the groups with rows, ``min(E, T * K)``) keys decode
    buckets. ``allow_tma=False`` (compiled graphs, see ``grouped_gemm._operands``) prefers, for the
    masked layout (host-made descriptors), the best tuned tile that loads through pointers, and never
    returns a TMA tile there; the sorted layout makes its descriptors on the device and keeps its tile.
    ``slots`` (a static ``T * K``, with a regime and a static token count only) looks up the tile tuned for
    exactly that size first (:func:`regime_key`).
    """
    if device.type == "cpu":
        # Interpreter: few, small programs keep the emulation quick; speed is not measured there.
        return TileConfig(16, 64, 64, 1, 4, 1, 1)
    if layout not in ("masked", "sorted"):
        raise ValueError(f"moe_fx: unknown GEMM layout {layout!r}")
    name = _device_name(device)
    names = tile_devices(name, _capability(device))
    if symbolic and regime is not None:
        expected_m, active_groups = regime_bucket(regime), None
    bucket = m_bucket(expected_m or 1)
    if symbolic or regime is None:
        slots = None
    mkey = _key(name, kind, n, k, bucket, active_groups, ptr=not allow_tma) + f"|{layout}|r{regime}|s{slots}"
    cfg = _memory.get(mkey)
    if cfg is None:
        tables = (_disk(), _shipped())
        kinds = (kind, "fp8") if kind == "w8a16" else (kind,)  # w8a16 streams the fp8 weights' bytes
        raw = None
        for dev in names:  # this GPU's tiles, else those of the tuned GPU of its compute capability
            keys: tuple[str, ...] = ()
            for kd in kinds:
                if regime is not None:
                    if slots is not None:
                        keys += (regime_key(dev, kd, n, k, layout, regime, slots),)
                    keys += (regime_key(dev, kd, n, k, layout, regime),)
                keys += (_key(dev, kd, n, k, bucket, active_groups, ptr=not allow_tma),
                         _key(dev, kd, n, k, bucket, ptr=not allow_tma))
                if not allow_tma:
                    keys += (_key(dev, kd, n, k, bucket, active_groups), _key(dev, kd, n, k, bucket))
            raw = next((table[key] for table in tables for key in keys if key in table), None)
            if raw is not None:
                break
        for dev in names if raw is None and regime is not None else ():
            # a shape nobody tuned: the tile of the nearest one that was
            near = nearest_regime_entry(tables, dev, kinds, n, k, layout, regime)
            raw = near[1] if near else None
            if raw is not None:
                break
        cfg = _from_dict(raw) if raw else _heuristic(kind, n, k, bucket, active_groups, num_sms)
        if not allow_tma and layout == "masked":  # the sorted layout makes its descriptors on the device
            cfg = replace(cfg, tma=False)
        _memory[mkey] = cfg
    return cfg


def _from_dict(raw: dict) -> TileConfig:
    known = {f for f in TileConfig.__dataclass_fields__}
    return TileConfig(**{f: v for f, v in raw.items() if f in known})


def tune(
    kind: str,
    n: int,
    k: int,
    expected_m: int,
    device: torch.device,
    bench: Callable[[TileConfig], float],
    active_groups: int | None = None,
    *,
    force: bool = False,
    timings: dict[TileConfig, float] | None = None,
) -> TileConfig:
    """Time every candidate of the bucket with ``bench(cfg) -> ms`` and cache the fastest on disk.

    A bucket already in the user cache is not tuned again (unless ``force``). Candidates that fail
    to compile or run (too much shared memory, say) are skipped with a log line. ``timings``, when
    given, receives every candidate's time in ms (benchmark reports).
    """
    # lazy: configs is importable without triton
    from triton.compiler.errors import CompilationError
    from triton.runtime.errors import OutOfResources

    bucket = m_bucket(expected_m)
    key = _key(_device_name(device), kind, n, k, bucket, active_groups)
    if key in _disk() and not force:
        cfg = _from_dict(_disk()[key])
        _memory[key] = cfg
        return cfg
    best: tuple[float, TileConfig] | None = None
    for cfg in candidates(kind, bucket):
        try:
            ms = bench(cfg)
        except (RuntimeError, ValueError, OutOfResources, CompilationError) as err:
            log.info("moe_fx: tile %s failed for %s: %s", cfg, key, str(err).splitlines()[0][:200])
            continue
        log.info("moe_fx: %s %s -> %.4f ms", key, cfg, ms)
        if timings is not None:
            timings[cfg] = ms
        if best is None or ms < best[0]:
            best = (ms, cfg)
    cfg = _heuristic(kind, n, k, bucket, active_groups) if best is None else best[1]
    store({key: cfg})
    _memory[key] = cfg
    return cfg
