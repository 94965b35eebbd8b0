"""Triton kernels of the masked-layout MoE pipeline (no Python wrappers here: see the sibling modules).

This module is loaded twice where needed (see :mod:`moe_fx.lowering.triton._loader`): compiled for
CUDA tensors, and under Triton's interpreter for CPU tensors. Keep it free of module state.

Masked layout: activations ``[E, max_m, H]`` plus ``masked_m [E]`` int32, rows ``>= masked_m[e]`` of
expert ``e`` are garbage and never read as data. The GEMM and activation kernels are persistent:
every program reads ``masked_m`` once, lays the *valid* tiles of all experts end to end
(expert-major, a cumulative sum of ``cdiv(masked_m[e], BLOCK_M) * num_n``) and strides over them,
so no program is ever spent on a tile that starts beyond ``masked_m[e]`` (with ``max_m = T`` most of
the ``[E, max_m]`` rectangle is padding; launching a program per padded tile would cost more than
the work at decode sizes).
"""

import triton
import triton.language as tl

# Only builtins of triton.language are used (tl.sum / tl.max / tl.cumsum / tl.cdiv are themselves
# @triton.jit functions, compiled-mode objects that the CPU interpreter copy of this module cannot
# call); reductions go through tl.reduce / tl.associative_scan with the combine functions below.

# The fp8 recipe (moe_fx.ops.recipe; globals used in kernels must be constexpr). This module is also
# loaded as a file of its own under the interpreter (see _loader), so it keeps its imports minimal.
from moe_fx.ops.recipe import FP8_E4M3_MAX as _FP8_MAX, FP8_SCALE_FLOOR as _SCALE_FLOOR  # noqa: E402

FP8_MAX = tl.constexpr(_FP8_MAX)
SCALE_FLOOR = tl.constexpr(_SCALE_FLOOR)


@triton.jit
def _add(a, b):
    return a + b


@triton.jit
def _maxf(a, b):
    return tl.maximum(a, b)


@triton.jit
def _minf(a, b):
    return tl.minimum(a, b)


@triton.jit
def _valid_tiles(rows, M, BLOCK_M: tl.constexpr):
    """Rows and row tiles of every expert from its loaded count: (rows, tiles, inclusive cumsum of tiles).

    The kernels load ``masked_m`` themselves and pass the values: Inductor's mutation analysis of
    user kernels follows a helper's arguments as if it could write through them, so a pointer handed
    to a helper would mark ``masked_m`` as written (and make Inductor copy it before every launch).
    """
    rows = tl.minimum(tl.maximum(rows, 0), M)  # never trust a count beyond the buffer
    tiles = (rows + BLOCK_M - 1) // BLOCK_M
    return rows, tiles, tl.associative_scan(tiles, 0, _add)


@triton.jit
def _tile_coords(t, offs_e, rows, tiles, cum, num_n, GROUP_M: tl.constexpr):
    """Expert, rows of that expert, and (pid_m, pid_n) of valid tile number ``t``.

    Tiles of one expert are ordered in groups of GROUP_M row tiles (column tiles inner) so that
    programs running together share the rows of A and the columns of B in L2.
    """
    e = tl.reduce((cum * num_n <= t).to(tl.int32), 0, _add)
    start = tl.reduce(tl.where(offs_e == e, cum - tiles, 0), 0, _add) * num_n
    num_m = tl.reduce(tl.where(offs_e == e, tiles, 0), 0, _add)
    m_e = tl.reduce(tl.where(offs_e == e, rows, 0), 0, _add)
    local = t - start
    width = GROUP_M * num_n
    first_m = (local // width) * GROUP_M
    gsize = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (local % width) % gsize
    pid_n = (local % width) // gsize
    return e, m_e, pid_m, pid_n


@triton.jit
def _slot_offsets(offs, s_it, s_ik, TOPK: tl.constexpr):
    """Element offsets in ``topk_ids`` of flattened (token, k) slots (the kernels load them themselves:
    a pointer handed to a helper counts as written in Inductor's mutation analysis)."""
    return (offs // TOPK).to(tl.int64) * s_it + (offs % TOPK) * s_ik


@triton.jit
def _row_index(e, offs_m, pid_m, starts, offs_e, BLOCK_M: tl.constexpr, SORTED: tl.constexpr):
    """A tile's rows in its row buffers, and the (group, row) origin of its TMA loads.

    Masked layout: row ``r`` of expert ``e`` is row ``r`` of group ``e`` (the caller adds ``e * s_g``).
    Contiguous (sorted) layout: expert ``e`` owns rows ``[start[e], start[e] + rows[e])`` of one group
    (group strides 0); with GATHER_A the kernel then reads its A rows through the sorted slots
    (the tokens ``sorted[row] // TOPK``: GEMM1 reads the tokens where they are, no permuted copy).
    """
    if SORTED:
        start = tl.reduce(tl.where(offs_e == e, starts, 0), 0, _add)
        return start + offs_m, 0, start + pid_m * BLOCK_M
    return offs_m, e, pid_m * BLOCK_M


@triton.jit
def _mma(acc, a, b, SWAP_AB: tl.constexpr, IEEE: tl.constexpr):
    """``acc + a @ b`` (``[BM, BK] x [BK, BN]``), or with SWAP_AB ``acc + b^T a^T`` (acc is ``[BN, BM]``)."""
    if SWAP_AB:
        if IEEE:
            out = tl.dot(tl.trans(b), tl.trans(a), acc, input_precision="ieee")
        else:
            out = tl.dot(tl.trans(b), tl.trans(a), acc)
    elif IEEE:
        out = tl.dot(a, b, acc, input_precision="ieee")
    else:
        out = tl.dot(a, b, acc)
    return out


@triton.jit
def _dot(a, b, SWAP_AB: tl.constexpr, IEEE: tl.constexpr):
    """``a @ b`` as a new fp32 tile (``b^T a^T`` with SWAP_AB): one k step's product, scaled before it joins
    the accumulator."""
    if SWAP_AB:
        if IEEE:
            out = tl.dot(tl.trans(b), tl.trans(a), input_precision="ieee")
        else:
            out = tl.dot(tl.trans(b), tl.trans(a))
    elif IEEE:
        out = tl.dot(a, b, input_precision="ieee")
    else:
        out = tl.dot(a, b)
    return out


@triton.jit
def masked_gemm_kernel(
    a_ptr,
    b_ptr,
    c_ptr,
    masked_m_ptr,
    E,
    M,
    N,
    K,
    s_ag,
    s_am,
    s_ak,
    s_bg,
    s_bn,
    s_bk,
    s_cg,
    s_cm,
    s_cn,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    E_POW2: tl.constexpr,
    EVEN_K: tl.constexpr,
    IEEE: tl.constexpr,
    UPCAST: tl.constexpr,
    TMA: tl.constexpr = False,
    bias_ptr=None,
    s_biasg=0,
    HAS_BIAS: tl.constexpr = False,
    sorted_ptr=None,
    rw_ptr=None,
    s_rwt=0,
    s_rwk=0,
    SORTED: tl.constexpr = False,
    GATHER_A: tl.constexpr = False,
    TOPK: tl.constexpr = 1,
    ROUTE_W: tl.constexpr = False,
    SWAP_AB: tl.constexpr = False,
    DEVICE_TMA: tl.constexpr = False,
    ACT_FUSED: tl.constexpr = False,
    ACT: tl.constexpr = 0,
    GATED: tl.constexpr = False,
    INTERLEAVED: tl.constexpr = False,
    HAS_LIMIT: tl.constexpr = False,
    alpha=1.0,
    limit=0.0,
    up_offset=0.0,
    bs_ptr=None,
    s_bsg=0,
    s_bsn=0,
    s_bsk=0,
    B_FP8: tl.constexpr = False,
    FLATTEN: tl.constexpr = False,
    ids_ptr=None,
    s_it=0,
    s_ik=0,
    NUM_W=0,
    SLOTS: tl.constexpr = False,
    PAIR_HALVES: tl.constexpr = False,
):
    """c[g, :m_g, :] = a[g, :m_g, :] @ b[g]^T (+ bias[g]), fp32 accumulation, stored in c's dtype.

    B_FP8 (fp8 weights, bf16 activations: W8A16): ``b`` is float8_e4m3fn with fp32 128x128 block scales
    ``bs[g, n // 128, k // 128]``; each k step (BLOCK_K divides 128: one scale group) dequantises the weight
    tile in registers (code times its block's scale, rounded to ``a``'s dtype, as vLLM's W8A16 Triton kernels
    do) and multiplies it into the one fp32 accumulator. The weight bytes are the fp8 ones and the activations
    are never quantised to fp8.

    With TMA, ``a_ptr`` / ``b_ptr`` are 3-D tensor descriptors (blocks ``[1, BLOCK_M, BLOCK_K]`` /
    ``[1, BLOCK_N, BLOCK_K]``): the copy engine zero-fills past the tensor's edges, so tails need
    no masks; rows past ``masked_m`` inside the buffer load garbage that is never stored.

    SORTED (the contiguous layout, see :func:`_row_index`): ``masked_m`` holds each expert's row
    count and expert ``g``'s rows are rows ``start[g] + r`` of ``a`` and ``c`` (group strides 0); GATHER_A reads row ``sorted[start[g] + r] // TOPK`` of ``a`` instead (GEMM1
    reading the tokens where they are); ROUTE_W multiplies each row by its routing weight
    ``rw[slot // TOPK, slot % TOPK]`` before the bias (weights applied to the expert's input:
    ``(w x) W^T = w (x W^T)``).

    ACT_FUSED (the expert activation in the epilogue, :func:`_act_epilogue`): ``c`` gets ``N`` columns of
    ``act(gate) * (up + up_offset)`` (GATED; ``b`` holds ``2N`` rows) or of ``act(h)``, from the fp32
    products, so the ``[M, 2N]`` product is never stored. Gate/up as halves (rows ``j`` and ``N + j``):
    a tile keeps two accumulators of BLOCK_N columns, gate and up; with PAIR_HALVES one accumulator instead, over
    BLOCK_N / 2 gate rows and the BLOCK_N / 2 up rows N below them, loaded as one weight tile (one descriptor load of
    a ``[2, BLOCK_N / 2, BLOCK_K]`` box of ``b`` viewed as ``[G, 2, N, K]``), split in the epilogue: the unfused
    tile's MMA shape and weight bytes per k step, BLOCK_N / 2 output columns. INTERLEAVED (rows ``2j``, ``2j + 1``):
    a tile multiplies BLOCK_N consecutive rows of ``b``, as unfused, and splits its accumulator into
    BLOCK_N / 2 gate and up columns. Biases are ``b``'s rows (``[G, 2N]``).

    SLOTS (with SORTED; a decode step whose rows need no sort): group ``g`` is (token, k) slot ``g`` of ``E = T * K``
    slots, with one row, row ``g`` of ``a`` and ``c``, multiplied by expert ``ids[g // TOPK, g % TOPK]``'s weights
    (of ``NUM_W``; a slot whose id is outside ``[0, NUM_W)`` has no row). ``masked_m`` is not read.

    FLATTEN: one software pipeline over every (tile, k step) of a program instead of one per tile
    (``tl.range(flatten=True)``); the epilogue then stages through up to 32 KB more shared memory
    (:meth:`~moe_fx.lowering.triton.configs.TileConfig.smem_bytes`). The interpreter runs it as the nested loops.
    """
    # Written out in both GEMM kernels on purpose: a pointer handed to a helper counts as written in
    # Inductor's mutation analysis, which would then copy the weights before every launch.
    if DEVICE_TMA:  # tensor descriptors made on the device (what Inductor-launched kernels can use)
        # the unit last stride is written as a literal (the host checked it): TMA needs it static
        EW = NUM_W if SLOTS else E  # weight groups (slots name their expert)
        if ACT_FUSED and GATED and PAIR_HALVES and not INTERLEAVED:  # gate and up rows j, N + j: one box of both
            b_ptr = tl.make_tensor_descriptor(b_ptr, shape=[EW, 2, N, K], strides=[s_bg, N * s_bn, s_bn, 1],
                                              block_shape=[1, 2, BLOCK_N // 2, BLOCK_K])
        elif ACT_FUSED and GATED:  # gate and up: 2N rows
            b_ptr = tl.make_tensor_descriptor(b_ptr, shape=[EW, 2 * N, K], strides=[s_bg, s_bn, 1],
                                              block_shape=[1, BLOCK_N, BLOCK_K])
        else:
            b_ptr = tl.make_tensor_descriptor(b_ptr, shape=[EW, N, K], strides=[s_bg, s_bn, 1],
                                              block_shape=[1, BLOCK_N, BLOCK_K])
        if not GATHER_A:
            if SORTED:  # one group of rows (its group stride is never used)
                a_ptr = tl.make_tensor_descriptor(a_ptr, shape=[1, M, K], strides=[M * s_am, s_am, 1],
                                                  block_shape=[1, BLOCK_M, BLOCK_K])
            else:
                a_ptr = tl.make_tensor_descriptor(a_ptr, shape=[E, M, K], strides=[s_ag, s_am, 1],
                                                  block_shape=[1, BLOCK_M, BLOCK_K])
    # gate/up halves in the epilogue: a second accumulator over the up rows, N below the gate's (HALVES), or one tile
    # of gate and up rows (PAIRED)
    HALVES: tl.constexpr = ACT_FUSED and GATED and not INTERLEAVED and not PAIR_HALVES
    PAIRED: tl.constexpr = ACT_FUSED and GATED and not INTERLEAVED and PAIR_HALVES
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    offs_e = tl.arange(0, E_POW2)
    if SLOTS:  # one row per slot naming an expert of b (its id loaded here: see _slot_offsets)
        slot_w = tl.load(ids_ptr + _slot_offsets(offs_e, s_it, s_ik, TOPK), mask=offs_e < E, other=-1)
        rows, tiles, cum = _valid_tiles(((slot_w >= 0) & (slot_w < NUM_W)).to(tl.int32), M, BLOCK_M)
    else:
        rows, tiles, cum = _valid_tiles(tl.load(masked_m_ptr + offs_e, mask=offs_e < E, other=0), M, BLOCK_M)
    if ACT_FUSED and (INTERLEAVED or PAIRED):  # tiles walk b's 2N rows; each gives BLOCK_N // 2 output columns
        NB = 2 * N
    else:
        NB = N
    num_n = (NB + BLOCK_N - 1) // BLOCK_N
    total = tl.reduce(tiles, 0, _add) * num_n
    if SLOTS:  # slot g's row is row g
        starts = offs_e
    else:
        starts = tl.associative_scan(rows, 0, _add) - rows  # first sorted row of each expert (SORTED)
    # FLATTEN: the tile loop and the k loop become one software-pipelined loop (Triton's loop flattening), so the
    # loads of a program's next tile are in flight while this tile's epilogue runs, instead of a pipeline that
    # fills and drains per tile (short-K GEMMs pay that per tile)
    for t in tl.range(pid, total, nprog, flatten=FLATTEN):
        e, m_e, pid_m, pid_n = _tile_coords(t, offs_e, rows, tiles, cum, num_n, GROUP_M)
        e64 = e.to(tl.int64)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_k = tl.arange(0, BLOCK_K)
        mask_m = offs_m < m_e
        if PAIRED:  # b's rows of the tile: BLOCK_N / 2 gate rows, then the up rows N below them
            col = pid_n * (BLOCK_N // 2) + tl.arange(0, BLOCK_N) % (BLOCK_N // 2)
            offs_n = (tl.arange(0, BLOCK_N) // (BLOCK_N // 2)) * N + col
            mask_n = col < N
        else:
            offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # b's rows of the tile (halves: the gate's)
            mask_n = offs_n < NB
        srow, g0, m0 = _row_index(e, offs_m, pid_m, starts, offs_e, BLOCK_M, SORTED)
        c_idx = srow.to(tl.int64)
        if SLOTS:  # group e is slot e, whose row is row e: the weights are those of the expert it names
            e = tl.reduce(tl.where(offs_e == e, slot_w, 0), 0, _add).to(tl.int32)  # ids may be int64: TMA wants i32
            e64 = e.to(tl.int64)
        if GATHER_A and SLOTS:  # the row is the slot
            slot = srow
            a_idx = (slot // TOPK).to(tl.int64)
        elif GATHER_A:  # the row's (token, k) slot, loaded here (a pointer passed to a helper counts as written)
            slot = tl.load(sorted_ptr + srow, mask=mask_m, other=0)
            a_idx = (slot // TOPK).to(tl.int64)
        else:
            slot = srow
            a_idx = c_idx
        if not (TMA and not GATHER_A):
            a_ptrs = a_ptr + e64 * s_ag + a_idx[:, None] * s_am + offs_k[None, :] * s_ak
        if not TMA:
            b_ptrs = b_ptr + e64 * s_bg + offs_n[None, :] * s_bn + offs_k[:, None] * s_bk
            if HALVES:
                u_ptrs = b_ptrs + N * s_bn
        if SWAP_AB:  # acc^T = b^T a^T: the weight tile is the MMA's M (wgmma needs 64+), the few rows its N
            acc = tl.full((BLOCK_N, BLOCK_M), 0.0, tl.float32)
        else:
            acc = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
        if HALVES:  # the up accumulator (acc + 0.0: a new tensor of its shape)
            acc_u = acc + 0.0
        for k0 in range(0, K, BLOCK_K):
            if TMA and not GATHER_A:
                a = a_ptr.load([g0, m0, k0]).reshape(BLOCK_M, BLOCK_K)
            elif EVEN_K:
                a = tl.load(a_ptrs, mask=mask_m[:, None], other=0.0)
            else:
                a = tl.load(a_ptrs, mask=mask_m[:, None] & (offs_k[None, :] < K - k0), other=0.0)
            if TMA and PAIRED:
                b = b_ptr.load([e, 0, pid_n * (BLOCK_N // 2), k0]).reshape(BLOCK_N, BLOCK_K).T
            elif TMA:
                b = b_ptr.load([e, pid_n * BLOCK_N, k0]).reshape(BLOCK_N, BLOCK_K).T
                if HALVES:
                    u = b_ptr.load([e, N + pid_n * BLOCK_N, k0]).reshape(BLOCK_N, BLOCK_K).T
            elif EVEN_K:
                b = tl.load(b_ptrs, mask=mask_n[None, :], other=0.0)
                if HALVES:
                    u = tl.load(u_ptrs, mask=mask_n[None, :], other=0.0)
            else:
                b = tl.load(b_ptrs, mask=mask_n[None, :] & (offs_k[:, None] < K - k0), other=0.0)
                if HALVES:
                    u = tl.load(u_ptrs, mask=mask_n[None, :] & (offs_k[:, None] < K - k0), other=0.0)
            if UPCAST:  # the CPU interpreter's dot mis-reads bf16 / fp8 operands; fp32 is exact there
                a = a.to(tl.float32)
                b = b.to(tl.float32)
                if HALVES:
                    u = u.to(tl.float32)
            if B_FP8:  # W8A16 (one k group per step): the weight tile dequantised into a's dtype, then a plain MMA
                # the block scale multiplies the weights, not the product, so the MMAs chain on one accumulator as
                # the bf16 kernel's do (a product scaled per k step would wait for each MMA before the next)
                bs_k = bs_ptr + e64 * s_bsg + (k0 // 128) * s_bsk
                bsc = tl.load(bs_k + (offs_n // 128) * s_bsn, mask=mask_n, other=0.0)
                acc = _mma(acc, a, (b.to(tl.float32) * bsc[None, :]).to(a.dtype), SWAP_AB, IEEE or UPCAST)
                if HALVES:
                    usc = tl.load(bs_k + ((N + offs_n) // 128) * s_bsn, mask=mask_n, other=0.0)
                    acc_u = _mma(acc_u, a, (u.to(tl.float32) * usc[None, :]).to(a.dtype), SWAP_AB, IEEE or UPCAST)
            else:
                acc = _mma(acc, a, b, SWAP_AB, IEEE or UPCAST)
                if HALVES:
                    acc_u = _mma(acc_u, a, u, SWAP_AB, IEEE or UPCAST)
            if not (TMA and not GATHER_A):
                a_ptrs += BLOCK_K * s_ak
            if not TMA:
                b_ptrs += BLOCK_K * s_bk
                if HALVES:
                    u_ptrs += BLOCK_K * s_bk
        if SWAP_AB:
            acc = tl.trans(acc)
            if HALVES:
                acc_u = tl.trans(acc_u)
        if ROUTE_W:  # each row's routing weight rw[slot // TOPK, slot % TOPK] (weights on the input)
            rw = tl.load(rw_ptr + _slot_offsets(slot, s_rwt, s_rwk, TOPK), mask=mask_m, other=0.0).to(tl.float32)
            acc = acc * rw[:, None]
            if HALVES:
                acc_u = acc_u * rw[:, None]
        if HAS_BIAS:  # bias [G, rows of b], contiguous along them
            acc += tl.load(bias_ptr + e64 * s_biasg + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
            if HALVES:
                acc_u += tl.load(bias_ptr + e64 * s_biasg + N + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
        if ACT_FUSED and GATED and (INTERLEAVED or PAIRED):  # half the tile's columns are gate, half up
            if INTERLEAVED:  # columns (2j, 2j + 1) of the tile: (gate, up) of output column j
                g, u = tl.split(tl.reshape(acc, (BLOCK_M, BLOCK_N // 2, 2)))
            else:  # columns j and BLOCK_N / 2 + j
                g, u = tl.split(tl.permute(tl.reshape(acc, (BLOCK_M, 2, BLOCK_N // 2)), (0, 2, 1)))
            acc = _act_epilogue(g, u, alpha, limit, up_offset, ACT, True, HAS_LIMIT, UPCAST)
            offs_n = pid_n * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
            mask_n = offs_n < N
        elif HALVES:
            acc = _act_epilogue(acc, acc_u, alpha, limit, up_offset, ACT, True, HAS_LIMIT, UPCAST)
        elif ACT_FUSED:
            acc = _act_epilogue(acc, acc, alpha, limit, up_offset, ACT, False, HAS_LIMIT, UPCAST)
        c_ptrs = c_ptr + e64 * s_cg + c_idx[:, None] * s_cm + offs_n[None, :] * s_cn
        tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


@triton.jit
def masked_gemm_fp8_kernel(
    a_ptr,
    as_ptr,
    b_ptr,
    bs_ptr,
    c_ptr,
    masked_m_ptr,
    E,
    M,
    N,
    K,
    s_ag,
    s_am,
    s_ak,
    s_asg,
    s_asm,
    s_ask,
    s_bg,
    s_bn,
    s_bk,
    s_bsg,
    s_bsn,
    s_bsk,
    s_cg,
    s_cm,
    s_cn,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    E_POW2: tl.constexpr,
    EVEN_K: tl.constexpr,
    UPCAST: tl.constexpr,
    TMA: tl.constexpr = False,
    SCALAR_BS: tl.constexpr = False,
    bias_ptr=None,
    s_biasg=0,
    HAS_BIAS: tl.constexpr = False,
    sorted_ptr=None,
    rw_ptr=None,
    s_rwt=0,
    s_rwk=0,
    SORTED: tl.constexpr = False,
    GATHER_A: tl.constexpr = False,
    TOPK: tl.constexpr = 1,
    ROUTE_W: tl.constexpr = False,
    SWAP_AB: tl.constexpr = False,
    DEVICE_TMA: tl.constexpr = False,
    FLATTEN: tl.constexpr = False,
    PREFETCH_SCALES: tl.constexpr = False,
):
    """fp8 x fp8 -> bf16 (+ bias[g]): a with 1x128 per-row group scales, b with 128x128 block scales.

    BLOCK_K divides 128, so each k step lies in one scale group: the partial product of the step
    is scaled by a_scale[row, k//128] * b_scale[col//128, k//128] before it joins the accumulator.
    SCALAR_BS (a column tile inside one 128-column scale block) folds b's scale into the row
    scales first, so promoting the step costs one FMA per accumulator element instead of three:
    that promotion runs on the CUDA cores beside the tensor cores and bounds this kernel's speed.
    PREFETCH_SCALES: each k step loads the next step's scales, so their latency hides behind a whole step
    instead of its MMA alone (the loads of the step's own scales are not pipelined by Triton: they were issued just
    before the MMA and waited for right after it).
    TMA, SORTED, GATHER_A, ROUTE_W, SWAP_AB, FLATTEN: as in :func:`masked_gemm_kernel` (``as`` rows follow ``a``'s).
    """
    # Written out in both GEMM kernels on purpose: a pointer handed to a helper counts as written in
    # Inductor's mutation analysis, which would then copy the weights before every launch.
    if DEVICE_TMA:  # tensor descriptors made on the device (what Inductor-launched kernels can use)
        # the unit last stride is written as a literal (the host checked it): TMA needs it static
        b_ptr = tl.make_tensor_descriptor(b_ptr, shape=[E, N, K], strides=[s_bg, s_bn, 1],
                                          block_shape=[1, BLOCK_N, BLOCK_K])
        if not GATHER_A:
            if SORTED:  # one group of rows (its group stride is never used)
                a_ptr = tl.make_tensor_descriptor(a_ptr, shape=[1, M, K], strides=[M * s_am, s_am, 1],
                                                  block_shape=[1, BLOCK_M, BLOCK_K])
            else:
                a_ptr = tl.make_tensor_descriptor(a_ptr, shape=[E, M, K], strides=[s_ag, s_am, 1],
                                                  block_shape=[1, BLOCK_M, BLOCK_K])
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    offs_e = tl.arange(0, E_POW2)
    rows, tiles, cum = _valid_tiles(tl.load(masked_m_ptr + offs_e, mask=offs_e < E, other=0), M, BLOCK_M)
    num_n = (N + BLOCK_N - 1) // BLOCK_N
    total = tl.reduce(tiles, 0, _add) * num_n
    starts = tl.associative_scan(rows, 0, _add) - rows  # first sorted row of each expert (SORTED)
    for t in tl.range(pid, total, nprog, flatten=FLATTEN):  # FLATTEN: see masked_gemm_kernel
        e, m_e, pid_m, pid_n = _tile_coords(t, offs_e, rows, tiles, cum, num_n, GROUP_M)
        e64 = e.to(tl.int64)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        mask_m = offs_m < m_e
        mask_n = offs_n < N
        srow, g0, m0 = _row_index(e, offs_m, pid_m, starts, offs_e, BLOCK_M, SORTED)
        c_idx = srow.to(tl.int64)
        if GATHER_A:  # the row's (token, k) slot, loaded here (a pointer passed to a helper counts as written)
            slot = tl.load(sorted_ptr + srow, mask=mask_m, other=0)
            a_idx = (slot // TOPK).to(tl.int64)
        else:
            slot = srow
            a_idx = c_idx
        if not (TMA and not GATHER_A):
            a_ptrs = a_ptr + e64 * s_ag + a_idx[:, None] * s_am + offs_k[None, :] * s_ak
        if not TMA:
            b_ptrs = b_ptr + e64 * s_bg + offs_n[None, :] * s_bn + offs_k[:, None] * s_bk
        as_ptrs = as_ptr + e64 * s_asg + a_idx * s_asm  # a's scales follow a's rows
        if SCALAR_BS:
            bs_ptrs = bs_ptr + e64 * s_bsg + ((pid_n * BLOCK_N) // 128) * s_bsn
        else:
            bs_ptrs = bs_ptr + e64 * s_bsg + (offs_n // 128) * s_bsn
        if SWAP_AB:  # acc^T = b^T a^T: the weight tile is the MMA's M (wgmma needs 64+), the few rows its N
            acc = tl.full((BLOCK_N, BLOCK_M), 0.0, tl.float32)
        else:
            acc = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
        if PREFETCH_SCALES:  # the first k step's scales; each step then loads the next step's
            a_s = tl.load(as_ptrs, mask=mask_m, other=0.0)
            if SCALAR_BS:
                b_s = tl.load(bs_ptrs)
            else:
                b_s = tl.load(bs_ptrs, mask=mask_n, other=0.0)
        for k0 in range(0, K, BLOCK_K):
            if TMA and not GATHER_A:
                a = a_ptr.load([g0, m0, k0]).reshape(BLOCK_M, BLOCK_K)
                b = b_ptr.load([e, pid_n * BLOCK_N, k0]).reshape(BLOCK_N, BLOCK_K).T
            elif TMA:  # gathered A through pointers (masked at a K tail, as TMA zero-fills b's), b through TMA
                if EVEN_K:
                    a = tl.load(a_ptrs, mask=mask_m[:, None], other=0.0)
                else:
                    a = tl.load(a_ptrs, mask=mask_m[:, None] & (offs_k[None, :] < K - k0), other=0.0)
                b = b_ptr.load([e, pid_n * BLOCK_N, k0]).reshape(BLOCK_N, BLOCK_K).T
            elif EVEN_K:
                a = tl.load(a_ptrs, mask=mask_m[:, None], other=0.0)
                b = tl.load(b_ptrs, mask=mask_n[None, :], other=0.0)
            else:
                a = tl.load(a_ptrs, mask=mask_m[:, None] & (offs_k[None, :] < K - k0), other=0.0)
                b = tl.load(b_ptrs, mask=mask_n[None, :] & (offs_k[:, None] < K - k0), other=0.0)
            if not PREFETCH_SCALES:  # this step's scales, loaded now (waited for after the MMA)
                kg = k0 // 128
                a_s = tl.load(as_ptrs + kg * s_ask, mask=mask_m, other=0.0)
                if SCALAR_BS:
                    b_s = tl.load(bs_ptrs + kg * s_bsk)
                else:
                    b_s = tl.load(bs_ptrs + kg * s_bsk, mask=mask_n, other=0.0)
            if SWAP_AB:  # the same step transposed: rows are the accumulator's columns
                if SCALAR_BS:
                    scale = (a_s * b_s)[None, :]
                else:
                    scale = b_s[:, None] * a_s[None, :]
            elif SCALAR_BS:
                scale = (a_s * b_s)[:, None]
            else:
                scale = a_s[:, None] * b_s[None, :]
            if PREFETCH_SCALES:  # the next step's scales: a whole step (its MMA) to arrive, not the MMA's tail
                # the last step loads its own group again (in bounds; never used)
                kn = tl.minimum((k0 + BLOCK_K) // 128, (K - 1) // 128)
                a_s = tl.load(as_ptrs + kn * s_ask, mask=mask_m, other=0.0)
                if SCALAR_BS:
                    b_s = tl.load(bs_ptrs + kn * s_bsk)
                else:
                    b_s = tl.load(bs_ptrs + kn * s_bsk, mask=mask_n, other=0.0)
            if UPCAST:  # the CPU interpreter's dot mis-reads fp8 operands; fp32 is exact there
                a = a.to(tl.float32)
                b = b.to(tl.float32)
            # an explicit FMA: Triton stops fusing a multiply and an add by default after 3.9
            acc = tl.fma(_dot(a, b, SWAP_AB, UPCAST), scale, acc)
            if not (TMA and not GATHER_A):
                a_ptrs += BLOCK_K * s_ak
            if not TMA:
                b_ptrs += BLOCK_K * s_bk
        if SWAP_AB:
            acc = tl.trans(acc)
        if ROUTE_W:  # each row's routing weight rw[slot // TOPK, slot % TOPK] (weights on the input)
            rw = tl.load(rw_ptr + _slot_offsets(slot, s_rwt, s_rwk, TOPK), mask=mask_m, other=0.0)
            acc = acc * rw.to(tl.float32)[:, None]
        if HAS_BIAS:  # bias [G, N], contiguous along N
            acc += tl.load(bias_ptr + e64 * s_biasg + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
        c_ptrs = c_ptr + e64 * s_cg + c_idx[:, None] * s_cm + offs_n[None, :] * s_cn
        tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


@triton.jit
def _quant_groups(v, ROWS: tl.constexpr, COLS: tl.constexpr, INTERP: tl.constexpr):
    """fp32 ``v [ROWS, COLS]`` (COLS a multiple of 128) as e4m3 values (still fp32) and the fp32 scale of
    each 1x128 group, ``[ROWS, COLS // 128]``: ``scale = max(amax, floor) / 448`` (moe_fx.ops.recipe). The
    activation quantisation of quantize_rows, the decode sort, the activation kernel, the masked permute and the
    copy into the contiguous layout."""
    v3 = tl.reshape(v, (ROWS, COLS // 128, 128))
    amax = tl.reduce(tl.abs(v3), 2, _maxf)
    scale = tl.maximum(amax, SCALE_FLOOR) / FP8_MAX
    q = tl.clamp(v3 / scale[:, :, None], -FP8_MAX, FP8_MAX)
    if INTERP:
        q = _e4m3_grid(q)
    return tl.reshape(q, (ROWS, COLS)), scale


@triton.jit
def _quant_token_slots(v, w, dtype: tl.constexpr, K_POW2: tl.constexpr, BLOCK_H: tl.constexpr, ROUTE_W: tl.constexpr,
                       INTERP: tl.constexpr):
    """One token's ``BLOCK_H`` columns ``v`` quantised per 1x128 group (``_quant_groups``), for each of its K_POW2
    slots: the codes in ``dtype`` and the scales ``[K_POW2, BLOCK_H // 128]``, times the slot's routing weight ``w``
    with ROUTE_W (``q(w x)`` has the codes of ``q(x)`` and the scale ``w * scale``: quantised once, scaled per slot).
    The tokens' copies into the masked and the contiguous layouts."""
    q, scale = _quant_groups(tl.reshape(v.to(tl.float32), (1, BLOCK_H)), 1, BLOCK_H, INTERP)
    codes = tl.broadcast_to(q.to(dtype), (K_POW2, BLOCK_H))  # converted once, stored K times
    scales = tl.broadcast_to(scale, (K_POW2, BLOCK_H // 128))
    if ROUTE_W:
        scales = scales * w[:, None]
    return codes, scales


@triton.jit
def _e4m3_grid(x):
    """Round fp32 (already within +-448) to the nearest float8_e4m3fn value, ties to even, in fp32.

    Used only under the CPU interpreter, whose fp32 -> fp8 cast is wrong for values between codes
    (31.7 -> 16) but exact for representable ones: rounding first makes the cast exact there.
    """
    ax = tl.abs(x)
    e = tl.floor(tl.log2(tl.maximum(ax, 2.0**-6)))  # exponent; subnormals share the step of 2**-6
    ulp = tl.exp2(e - 3.0)  # 3 mantissa bits
    y = ax / ulp
    r = tl.floor(y + 0.5)
    half_odd = ((r - y) == 0.5) & ((r - 2.0 * tl.floor(r * 0.5)) == 1.0)
    r = tl.where(half_odd, r - 1.0, r)
    return tl.where(x < 0, -r * ulp, r * ulp)


@triton.jit
def _act(g, alpha, ACT: tl.constexpr):
    """act(g) in fp32. ACT: 0 silu (g * sigmoid(alpha * g)), 1 gelu (erf), 2 gelu (tanh), 3 relu, 4 relu^2."""
    if ACT == 0:
        y = g / (1.0 + tl.exp(-alpha * g))
    elif ACT == 1:
        y = 0.5 * g * (1.0 + tl.erf(g * 0.7071067811865476))
    elif ACT == 2:
        inner = tl.clamp(0.7978845608028654 * (g + 0.044715 * g * g * g), -20.0, 20.0)  # tanh is +-1 there
        # tanh(z) = 2 * sigmoid(2z) - 1, written with exp so the interpreter and every backend agree
        y = 0.5 * g * (1.0 + (2.0 / (1.0 + tl.exp(-2.0 * inner)) - 1.0))
    elif ACT == 3:
        y = tl.maximum(g, 0.0)
    else:
        r = tl.maximum(g, 0.0)
        y = r * r
    return y


@triton.jit
def _act_epilogue(g, u, alpha, limit, up_offset, ACT: tl.constexpr, GATED: tl.constexpr, HAS_LIMIT: tl.constexpr,
                  INTERP: tl.constexpr):
    """The expert activation of fp32 ``g`` (and ``u``): ``act(g) * (u + up_offset)`` gated, ``act(g)`` not,
    after the clamp (gate <= limit, |up| <= limit; |h| <= limit). Shared by the activation kernel and
    the GEMM epilogue, so both compute the same function."""
    if not INTERP:  # Inductor passes Python floats as fp64: keep the math in fp32.
        # tl.cast, not .to: torch 2.11's analysis of which buffers a kernel writes compiles it with the
        # floats as Python constants, which have no .to (the analysis then assumes every buffer written).
        alpha = tl.cast(alpha, tl.float32)
        limit = tl.cast(limit, tl.float32)
        up_offset = tl.cast(up_offset, tl.float32)
    if GATED:
        if HAS_LIMIT:
            g = tl.minimum(g, limit)
            u = tl.clamp(u, -limit, limit)
        v = _act(g, alpha, ACT) * (u + up_offset)
    else:
        if HAS_LIMIT:
            g = tl.clamp(g, -limit, limit)
        v = _act(g, alpha, ACT)
    return v


@triton.jit
def activation_kernel(
    x_ptr,
    y_ptr,
    ys_ptr,
    masked_m_ptr,
    bias_ptr,
    E,
    M,
    I,
    s_xg,
    s_xm,
    s_xn,
    s_yg,
    s_ym,
    s_yn,
    s_sg,
    s_sm,
    s_sn,
    s_bg,
    s_bn,
    alpha,
    limit,
    up_offset,
    mm_off,
    ACT: tl.constexpr,
    GATED: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    HAS_LIMIT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    QUANT: tl.constexpr,
    INTERP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    E_POW2: tl.constexpr,
):
    """The expert activation between the GEMMs, on valid rows of the masked layout.

    Gated (``x [G, M, 2I]``): ``y = act(gate) * (up + up_offset)`` with gate/up as halves (columns
    ``j`` and ``I + j``) or interleaved (``2j`` and ``2j + 1``); not gated (``x [G, M, I]``): ``act(h)``.
    ``bias [G, N1]`` is added to x first; HAS_LIMIT clamps gate <= limit, |up| <= limit (|h| <= limit).
    With QUANT: fp8 output with one scale per 1xBLOCK_N group (BLOCK_N = 128), written through ys's strides.
    """
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    offs_e = tl.arange(0, E_POW2)
    rows, tiles, cum = _valid_tiles(tl.load(masked_m_ptr + mm_off + offs_e, mask=offs_e < E, other=0), M, BLOCK_M)
    num_n = (I + BLOCK_N - 1) // BLOCK_N
    total = tl.reduce(tiles, 0, _add) * num_n
    for t in range(pid, total, nprog):
        e, m_e, pid_m, pid_n = _tile_coords(t, offs_e, rows, tiles, cum, num_n, 1)
        e64 = e.to(tl.int64)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = offs_n < I
        mask = (offs_m < m_e)[:, None] & mask_n[None, :]
        if INTERLEAVED:
            col_g = 2 * offs_n
        else:
            col_g = offs_n
        row_ptrs = x_ptr + e64 * s_xg + offs_m[:, None] * s_xm
        g = tl.load(row_ptrs + col_g[None, :] * s_xn, mask=mask, other=0.0).to(tl.float32)
        if HAS_BIAS:
            g += tl.load(bias_ptr + e64 * s_bg + col_g * s_bn, mask=mask_n, other=0.0).to(tl.float32)[None, :]
        if GATED:
            if INTERLEAVED:
                col_u = col_g + 1
            else:
                col_u = col_g + I
            u = tl.load(row_ptrs + col_u[None, :] * s_xn, mask=mask, other=0.0).to(tl.float32)
            if HAS_BIAS:
                u += tl.load(bias_ptr + e64 * s_bg + col_u * s_bn, mask=mask_n, other=0.0).to(tl.float32)[None, :]
            v = _act_epilogue(g, u, alpha, limit, up_offset, ACT, True, HAS_LIMIT, INTERP)
        else:
            v = _act_epilogue(g, g, alpha, limit, up_offset, ACT, False, HAS_LIMIT, INTERP)
        v = tl.where(mask, v, 0.0)
        y_ptrs = y_ptr + e64 * s_yg + offs_m[:, None] * s_ym + offs_n[None, :] * s_yn
        if QUANT:  # BLOCK_N = 128: one group per row
            q, scale = _quant_groups(v, BLOCK_M, BLOCK_N, INTERP)
            tl.store(y_ptrs, q.to(y_ptr.dtype.element_ty), mask=mask)
            s_ptrs = ys_ptr + e64 * s_sg + offs_m * s_sm + pid_n * s_sn
            tl.store(s_ptrs, tl.reshape(scale, (BLOCK_M,)), mask=offs_m < m_e)
        else:
            tl.store(y_ptrs, v.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def permute_kernel(
    h_ptr,
    ids_ptr,
    w_ptr,
    counts_ptr,
    x_ptr,
    xs_ptr,
    pos_ptr,
    T,
    K,
    H,
    E,
    max_m,
    s_ht,
    s_hh,
    s_it,
    s_ik,
    s_wt,
    s_wk,
    s_xg,
    s_xm,
    s_xh,
    s_sg,
    s_sm,
    s_sh,
    K_POW2: tl.constexpr,
    BLOCK_H: tl.constexpr,
    WEIGHTS_ON_INPUT: tl.constexpr,
    DEDUPE: tl.constexpr,
    QUANT: tl.constexpr,
    INTERP: tl.constexpr,
):
    """One program per token: claim a row in each of its experts, then copy the token into them.

    Rows are claimed with an atomic increment of ``counts[e]``, so the order of rows inside an
    expert is not deterministic; results are, because rows are independent in the GEMMs and the
    unpermute gathers each token's K rows in k order. ``pos[t * K + k] = e * max_m + row`` (-1 for
    ids outside ``[0, E)`` and rows past ``max_m``). DEDUPE (routing weights applied after the
    expert): a token naming one expert several times sends ONE row, and every such slot points at
    it, so an expert never gets more than T rows. With QUANT the token is quantised to fp8 with one
    scale per 1x128 group (``_quant_groups``; BLOCK_H a multiple of 128, several groups a step).
    """
    t = tl.program_id(0)
    t64 = t.to(tl.int64)
    offs_k = tl.arange(0, K_POW2)
    kmask = offs_k < K
    e = tl.load(ids_ptr + t64 * s_it + offs_k * s_ik, mask=kmask, other=-1).to(tl.int32)
    valid = kmask & (e >= 0) & (e < E)
    e_safe = tl.where(valid, e, 0)
    if DEDUPE:
        # first[k] = the smallest k' with the same expert (k itself when none comes earlier)
        same = (e[:, None] == e[None, :]) & valid[:, None] & valid[None, :]
        earlier = same & (offs_k[None, :] < offs_k[:, None])
        dup = tl.reduce(earlier.to(tl.int32), 1, _add) > 0
        first = tl.reduce(tl.where(same, offs_k[None, :], K_POW2), 1, _minf)
        claim = valid & (dup == 0)
    else:
        claim = valid
    row = tl.atomic_add(counts_ptr + e_safe, tl.full((K_POW2,), 1, tl.int32), mask=claim)
    ok = claim & (row < max_m)
    row = tl.where(ok, row, 0)
    pos = tl.where(ok, e_safe.to(tl.int64) * max_m + row, -1)
    if DEDUPE:
        # a duplicate slot takes the position its first occurrence claimed
        pos_first = tl.reduce(tl.where(offs_k[None, :] == first[:, None], pos[None, :], 0), 1, _add)
        pos = tl.where(valid, pos_first, -1)
    tl.store(pos_ptr + t64 * K + offs_k, pos, mask=kmask)
    if WEIGHTS_ON_INPUT:
        w = tl.load(w_ptr + t64 * s_wt + offs_k * s_wk, mask=kmask, other=0.0).to(tl.float32)
    else:
        w = tl.full((K_POW2,), 1.0, tl.float32)  # unread: the quantising helper's argument
    dst = e_safe.to(tl.int64) * s_xg + row.to(tl.int64) * s_xm
    for h0 in range(0, H, BLOCK_H):
        offs_h = h0 + tl.arange(0, BLOCK_H)
        hmask = offs_h < H
        v = tl.load(h_ptr + t64 * s_ht + offs_h * s_hh, mask=hmask, other=0.0)
        if QUANT:  # BLOCK_H // 128 groups a step
            vals, s_val = _quant_token_slots(v, w, x_ptr.dtype.element_ty, K_POW2, BLOCK_H, WEIGHTS_ON_INPUT, INTERP)
            offs_g = h0 // 128 + tl.arange(0, BLOCK_H // 128)
            s_dst = e_safe.to(tl.int64) * s_sg + row.to(tl.int64) * s_sm
            tl.store(xs_ptr + s_dst[:, None] + offs_g[None, :] * s_sh, s_val,
                     mask=ok[:, None] & (offs_g < (H + 127) // 128)[None, :])
        else:
            if WEIGHTS_ON_INPUT:
                vals = (v.to(tl.float32)[None, :] * w[:, None]).to(x_ptr.dtype.element_ty)
            else:
                vals = tl.broadcast_to(v[None, :], (K_POW2, BLOCK_H))
        tl.store(x_ptr + dst[:, None] + offs_h[None, :] * s_xh, vals, mask=ok[:, None] & hmask[None, :])


@triton.jit
def unpermute_kernel(
    y_ptr,
    pos_ptr,
    w_ptr,
    out_ptr,
    ids_ptr,
    h_ptr,
    K,
    H,
    E,
    E_IDENTITY,
    s_yr,
    s_yh,
    s_wt,
    s_wk,
    s_ot,
    s_oh,
    s_it,
    s_ik,
    s_ht,
    s_hh,
    K_POW2: tl.constexpr,
    BLOCK_H: tl.constexpr,
    HAS_W: tl.constexpr,
    IDENTITY: tl.constexpr,
    SLOT_ROWS: tl.constexpr = False,
):
    """out[t] = sum_k w[t, k] * y_rows[pos[t, k]] in fp32 (grid: (T, cdiv(H, BLOCK_H))); pos -1 skipped.

    SLOT_ROWS: slot ``t * K + k`` wrote row ``t * K + k`` if its id lies in ``[0, E)`` (``pos`` is not read).

    IDENTITY: slots whose id lies in ``[E, E + E_IDENTITY)`` are zero-computation experts and add
    ``w[t, k] * hidden[t]`` (HAS_W false: routing weights were applied to the input, ``hidden[t]``
    is then scaled here by the weight all the same, as the expert's input would have been).
    """
    t = tl.program_id(0)
    t64 = t.to(tl.int64)
    offs_k = tl.arange(0, K_POW2)
    kmask = offs_k < K
    if SLOT_ROWS:
        ids = tl.load(ids_ptr + t64 * s_it + offs_k * s_ik, mask=kmask, other=-1)
        pos = tl.where((ids >= 0) & (ids < E), t64 * K + offs_k, -1)
    else:
        pos = tl.load(pos_ptr + t64 * K + offs_k, mask=kmask, other=-1)
    ok = kmask & (pos >= 0)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = offs_h < H
    y = tl.load(
        y_ptr + tl.where(ok, pos, 0)[:, None] * s_yr + offs_h[None, :] * s_yh,
        mask=ok[:, None] & hmask[None, :],
        other=0.0,
    ).to(tl.float32)
    if HAS_W or IDENTITY:
        w = tl.load(w_ptr + t64 * s_wt + offs_k * s_wk, mask=kmask, other=0.0).to(tl.float32)
    if HAS_W:
        y = y * w[:, None]
    acc = tl.reduce(y, 0, _add)
    if IDENTITY:
        if not SLOT_ROWS:
            ids = tl.load(ids_ptr + t64 * s_it + offs_k * s_ik, mask=kmask, other=-1)
        ident = kmask & (ids >= E) & (ids < E + E_IDENTITY)
        w_id = tl.reduce(tl.where(ident, w, 0.0), 0, _add)
        x = tl.load(h_ptr + t64 * s_ht + offs_h * s_hh, mask=hmask, other=0.0).to(tl.float32)
        acc += w_id * x
    tl.store(out_ptr + t64 * s_ot + offs_h * s_oh, acc.to(out_ptr.dtype.element_ty), mask=hmask)


@triton.jit
def slot_down_combine_kernel(
    a_ptr,
    b_ptr,
    out_ptr,
    ids_ptr,
    w_ptr,
    h_ptr,
    bias_ptr,
    N,
    K,
    E,
    E_IDENTITY,
    s_am,
    s_ak,
    s_bg,
    s_bn,
    s_bk,
    s_ot,
    s_on,
    s_it,
    s_ik,
    s_wt,
    s_wk,
    s_ht,
    s_hh,
    s_biasg,
    TOPK: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr,
    IEEE: tl.constexpr,
    HAS_W: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    IDENTITY: tl.constexpr,
):
    """GEMM2 and the combine of rows in slot order in one launch (grid ``(cdiv(N, BLOCK_N), T)``):
    ``out[t, n] = sum_k w[t, k] * (a[t * TOPK + k] @ b[ids[t, k]][n]^T + bias[ids[t, k]][n])`` in fp32 over the slots
    whose id lies in ``[0, E)``, plus ``w[t, k] * h[t, n]`` for identity experts (ids in ``[E, E + E_IDENTITY)``).
    HAS_W false: the weights were applied to the experts' input, the rows are summed unweighted (identity experts
    are scaled all the same, as in :func:`unpermute_kernel`). TOPK is at most 16.

    A program walks its token's slots in one loop of (slot, k step): each step multiplies the slot's expert's
    ``[BLOCK_N, BLOCK_K]`` weight tile by a ``[BLOCK_K, 16]`` tile whose column ``k`` holds slot ``k``'s row (the other
    columns load as zeros), so column ``k`` of the accumulator ends as slot ``k``'s product, unrounded, and the
    weighted sum over the columns is the combine. Tensor-core tiles, as the decode GEMMs': multiply-and-reduce
    GEMVs did not keep the weight loads streaming (docs/triton.md, the decode path).
    """
    pid_n = tl.program_id(0)
    t64 = tl.program_id(1).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    col = tl.arange(0, 16)  # the MMA's 16 columns: column k is slot k of the token
    ids = tl.load(ids_ptr + t64 * s_it + col * s_ik, mask=col < TOPK, other=-1)
    has = (col < TOPK) & (ids >= 0) & (ids < E)
    e64 = tl.where(has, ids, 0).to(tl.int64)
    nk = (K + BLOCK_K - 1) // BLOCK_K
    acc = tl.full((BLOCK_N, 16), 0.0, tl.float32)
    for step in range(TOPK * nk):
        k = step // nk
        k0 = (step - k * nk) * BLOCK_K
        # the slot's expert (a scalar picked from the ids in registers: no load the pipeline would wait on)
        e = tl.reduce(tl.where(col == k, e64, 0), 0, _add)
        on = tl.reduce(tl.where(col == k, has.to(tl.int32), 0), 0, _add)
        a_ptrs = a_ptr + (t64 * TOPK + col[None, :]) * s_am + (k0 + offs_k)[:, None] * s_ak
        b_ptrs = b_ptr + e * s_bg + offs_n[:, None] * s_bn + (k0 + offs_k)[None, :] * s_bk
        # 2-D masks of the tiles' shapes (the slot's column; no columns or rows where the slot has no expert)
        a_mask = (col[None, :] == k) & (offs_k[:, None] < (K - k0) * on)
        b_mask = mask_n[:, None] & (offs_k[None, :] < (K - k0) * on)
        a = tl.load(a_ptrs, mask=a_mask, other=0.0)
        b = tl.load(b_ptrs, mask=b_mask, other=0.0)
        if UPCAST:  # the CPU interpreter's dot mis-reads bf16 operands; fp32 is exact there
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = _mma(acc, b, a, False, IEEE or UPCAST)
    if HAS_BIAS:  # each slot's expert bias, in its column
        acc += tl.load(bias_ptr + e64[None, :] * s_biasg + offs_n[:, None], mask=mask_n[:, None] & has[None, :],
                       other=0.0).to(tl.float32)
    if HAS_W or IDENTITY:
        w = tl.load(w_ptr + t64 * s_wt + col * s_wk, mask=col < TOPK, other=0.0).to(tl.float32)
    if HAS_W:
        acc = acc * w[None, :]
    out = tl.reduce(tl.where(has[None, :], acc, 0.0), 1, _add)
    if IDENTITY:
        ident = (col < TOPK) & (ids >= E) & (ids < E + E_IDENTITY)
        w_id = tl.reduce(tl.where(ident, w, 0.0), 0, _add)
        x = tl.load(h_ptr + t64 * s_ht + offs_n * s_hh, mask=mask_n, other=0.0).to(tl.float32)
        out += w_id * x
    tl.store(out_ptr + t64 * s_ot + offs_n * s_on, out.to(out_ptr.dtype.element_ty), mask=mask_n)


# --------------------------------------------------------------------------------------------------
# The contiguous ("sorted") layout: rows grouped by expert, no [E, max_m, H] buffer
# --------------------------------------------------------------------------------------------------


@triton.jit
def expert_counts_kernel(
    ids_ptr,
    counts_ptr,
    N,
    E,
    s_it,
    s_ik,
    TOPK: tl.constexpr,
    BLOCK: tl.constexpr,
    E_POW2: tl.constexpr,
):
    """``counts[e] +=`` this block's slots routed to expert ``e``; ``counts[E] +=`` all of them.

    ``counts`` (int32 ``[2E + 1]``, zeroed by the caller) is the sort's scratch: counts, total, then
    the cursors of :func:`sort_slots_kernel`. Slots naming no computed expert (``-1``, identity
    experts, out-of-range ids) are not counted. One histogram per program, then one atomic per
    expert: contention stays low when many tokens pick few experts (Mixtral: 8).
    """
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ids = tl.load(ids_ptr + _slot_offsets(offs, s_it, s_ik, TOPK), mask=offs < N, other=-1).to(tl.int32)
    valid = (offs < N) & (ids >= 0) & (ids < E)
    # invalid slots land in a bin past the experts (histogram's mask argument is newer than triton 3.6)
    hist = tl.histogram(tl.where(valid, ids, E_POW2), 2 * E_POW2)
    bins = tl.arange(0, 2 * E_POW2)
    tl.atomic_add(counts_ptr + bins, hist, mask=(bins < E) & (hist > 0))
    tl.atomic_add(counts_ptr + E, tl.reduce(valid.to(tl.int32), 0, _add))


@triton.jit
def sort_slots_kernel(
    ids_ptr,
    counts_ptr,
    sorted_ptr,
    pos_ptr,
    N,
    E,
    s_it,
    s_ik,
    TOPK: tl.constexpr,
    BLOCK: tl.constexpr,
    E_POW2: tl.constexpr,
):
    """Give every counted slot its row of the expert-sorted buffers: ``start[e] + rank``.

    ``start[e]`` is the exclusive sum of the counts below ``e``; the rank within the expert is
    claimed with an atomic on the cursors (``counts[E + 1 + e]``), so the order of rows inside an
    expert is not deterministic, while every result is: rows are independent in the GEMMs and the
    combine gathers each token's slots in k order. Writes ``sorted[row] = slot`` and
    ``pos[slot] = row`` (int64; -1 for slots that send no row).
    """
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    smask = offs < N
    ids = tl.load(ids_ptr + _slot_offsets(offs, s_it, s_ik, TOPK), mask=smask, other=-1).to(tl.int32)
    valid = smask & (ids >= 0) & (ids < E)
    offs_e = tl.arange(0, E_POW2)
    counts = tl.load(counts_ptr + offs_e, mask=offs_e < E, other=0)
    start = tl.reduce(tl.where(offs_e[None, :] < ids[:, None], counts[None, :], 0), 1, _add)
    rank = tl.atomic_add(counts_ptr + E + 1 + tl.where(valid, ids, 0), tl.full((BLOCK,), 1, tl.int32), mask=valid)
    row = start + rank
    tl.store(sorted_ptr + row, offs, mask=valid)
    tl.store(pos_ptr + offs, tl.where(valid, row, -1).to(tl.int64), mask=smask)


@triton.jit
def quantize_rows_kernel(
    x_ptr,
    q_ptr,
    s_ptr,
    T,
    H,
    s_xt,
    s_xh,
    s_qt,
    s_qh,
    s_st,
    s_sh,
    BLOCK_T: tl.constexpr,
    INTERP: tl.constexpr,
):
    """fp8 e4m3 codes of ``x [T, H]`` with one fp32 scale per 1x128 group (grid ``(cdiv(T, BLOCK_T), cdiv(H, 128))``).

    The sorted layout's GEMM1 reads tokens in place, so fp8 weights need the tokens quantised once
    (T rows, not T * K); ``scale = max(amax, floor) / 448`` as everywhere (moe_fx.ops.recipe).
    """
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_h = tl.program_id(1) * 128 + tl.arange(0, 128)
    t64 = offs_t.to(tl.int64)
    mask = (offs_t < T)[:, None] & (offs_h < H)[None, :]
    v = tl.load(x_ptr + t64[:, None] * s_xt + offs_h[None, :] * s_xh, mask=mask, other=0.0).to(tl.float32)
    q, scale = _quant_groups(v, BLOCK_T, 128, INTERP)
    tl.store(q_ptr + t64[:, None] * s_qt + offs_h[None, :] * s_qh, q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(s_ptr + t64 * s_st + tl.program_id(1) * s_sh, tl.reshape(scale, (BLOCK_T,)), mask=offs_t < T)


@triton.jit
def _bitonic_sort(x, LOG_N: tl.constexpr):
    """``x [2**LOG_N]`` in ascending order: a bitonic network of compare-exchanges at distance ``2**j``, each on a
    ``[pairs, 2, 2**j]`` view split into its two halves (``tl.sort`` is a compiled function of the triton package,
    which the interpreted copy of these kernels cannot call)."""
    N: tl.constexpr = x.shape[0]
    for s in tl.static_range(1, LOG_N + 1):  # sorted runs of 2**s: ascending and descending in turn
        for j in tl.static_range(s - 1, -1, -1):
            lo, hi = tl.split(tl.permute(tl.reshape(x, (N >> (j + 1), 2, 1 << j)), (0, 2, 1)))
            # the run of 2**s a pair belongs to, from its index: odd runs sort descending (none in the last stage)
            down = ((tl.arange(0, N >> (j + 1)) >> (s - j - 1)) & 1)[:, None] == 1
            small = tl.minimum(lo, hi)
            big = tl.maximum(lo, hi)
            x = tl.reshape(tl.permute(tl.join(tl.where(down, big, small), tl.where(down, small, big)), (0, 2, 1)),
                           (N,))
    return x


@triton.jit
def _store_pairwise_rows(ids, offs, N, E, offs_e, counts_ptr, sorted_ptr, pos_ptr):
    """The one-block sort of :func:`sort_small_kernel`: counts, total, and each slot's row from pairwise
    comparisons (the row of slot s = the valid slots of a smaller expert, or of its expert and before s).
    Only the pointers it writes are handed to it (see :func:`_slot_offsets`)."""
    smask = offs < N
    valid = smask & (ids >= 0) & (ids < E)
    counts = tl.reduce(((ids[:, None] == offs_e[None, :]) & valid[:, None]).to(tl.int32), 0, _add)
    tl.store(counts_ptr + offs_e, counts, mask=offs_e < E)
    tl.store(counts_ptr + E, tl.reduce(counts, 0, _add))
    ids_j = tl.where(valid, ids, E)
    before = (ids_j[None, :] < ids[:, None]) | ((ids_j[None, :] == ids[:, None]) & (offs[None, :] < offs[:, None]))
    row = tl.reduce(before.to(tl.int32), 1, _add)
    tl.store(sorted_ptr + row, offs, mask=valid)
    tl.store(pos_ptr + offs, tl.where(valid, row, -1).to(tl.int64), mask=smask)


@triton.jit
def sort_small_kernel(
    ids_ptr,
    counts_ptr,
    sorted_ptr,
    pos_ptr,
    N,
    E,
    s_it,
    s_ik,
    TOPK: tl.constexpr,
    CHUNK: tl.constexpr,
    E_POW2: tl.constexpr,
    DECODE_PAIRS: tl.constexpr,
    PAIRS: tl.constexpr,
    PAIRWISE: tl.constexpr = True,
    SORT_LOG: tl.constexpr = 0,
    x_ptr=None,
    q_ptr=None,
    qs_ptr=None,
    T=0,
    H=0,
    s_xt=0,
    s_xh=0,
    s_qt=0,
    s_qh=0,
    s_st=0,
    s_sh=0,
    sort_programs=1,
    QUANT: tl.constexpr = False,
    BLOCK_T: tl.constexpr = 8,
    INTERP: tl.constexpr = False,
):
    """:func:`expert_counts_kernel` + :func:`sort_slots_kernel` in one launch, for decode-sized batches.

    No atomics, so no zeroed scratch: the counts are written, not accumulated (one memset and one
    launch fewer, which is what a decode step pays for). Each slot's row is ``start[e] + rank`` with its
    rank among earlier slots of the same expert (a stable counting sort: the row order is deterministic).
    When every slot fits in one block of ``DECODE_PAIRS`` or ``PAIRS`` (a decode step) one program
    compares the slots pairwise: one load, no scan over the experts (the scan of a ``[CHUNK, E_POW2]``
    tile is most of the two passes' time at large E). With more slots the grid has one program per
    ``PAIRS`` slots (``cdiv(N, PAIRS)``): each counts all slots and ranks its own pairwise against the
    earlier ones, unless they fit ``2**SORT_LOG`` slots (0: never): then program 0 sorts them alone,
    keys ``(expert, slot)`` in one bitonic sort and the counts from a histogram. ``PAIRWISE=False`` makes
    program 0 run two passes over the slots in chunks (the counts, then the ranks by a scan) for every N,
    the same rows: the A/B of ``bench/kernel_breakdown.py --sort-ab``.

    QUANT: the programs after the sort's first ``sort_programs`` quantise the tokens ``x [T, H]`` as
    :func:`quantize_rows_kernel` does (one ``[BLOCK_T, 128]`` block each: fp8 codes to ``q``, fp32 1x128
    scales to ``qs``), beside the sort instead of in a launch of their own after it.
    """
    if QUANT:
        # written out, not shared with quantize_rows_kernel through a helper: a pointer handed to a helper
        # counts as written in Inductor's mutation analysis, which would then copy the tokens before the launch
        q_blk = tl.program_id(0) - sort_programs
        if q_blk >= 0:
            q_groups = (H + 127) // 128
            q_t = (q_blk // q_groups) * BLOCK_T + tl.arange(0, BLOCK_T)
            q_h = (q_blk % q_groups) * 128 + tl.arange(0, 128)
            q_t64 = q_t.to(tl.int64)
            q_mask = (q_t < T)[:, None] & (q_h < H)[None, :]
            q_v = tl.load(x_ptr + q_t64[:, None] * s_xt + q_h[None, :] * s_xh, mask=q_mask, other=0.0).to(tl.float32)
            q_codes, q_scale = _quant_groups(q_v, BLOCK_T, 128, INTERP)
            tl.store(q_ptr + q_t64[:, None] * s_qt + q_h[None, :] * s_qh, q_codes.to(q_ptr.dtype.element_ty),
                     mask=q_mask)
            tl.store(qs_ptr + q_t64 * s_st + (q_blk % q_groups) * s_sh, tl.reshape(q_scale, (BLOCK_T,)), mask=q_t < T)
            return
    offs_e = tl.arange(0, E_POW2)
    # Each block's tensors have names of their own: triton 3.6 carries a name bound in an `if` that returns
    # into the loops below, and a tile of another size there fails to compile ("Loop-carried variable offs has
    # initial type <[64]> but is re-assigned to <[32]>": DeepSeek-V3's 256 experts, 64 pairs, 32-slot chunks).
    if PAIRWISE:
        # two tile sizes, picked from N at run time: the tiles' size is most of the time of a small sort
        if N <= DECODE_PAIRS:
            d_offs = tl.arange(0, DECODE_PAIRS)
            d_ids = tl.load(ids_ptr + _slot_offsets(d_offs, s_it, s_ik, TOPK), mask=d_offs < N, other=-1).to(tl.int32)
            _store_pairwise_rows(d_ids, d_offs, N, E, offs_e, counts_ptr, sorted_ptr, pos_ptr)
            return
        if N <= PAIRS:
            p_offs = tl.arange(0, PAIRS)
            p_ids = tl.load(ids_ptr + _slot_offsets(p_offs, s_it, s_ik, TOPK), mask=p_offs < N, other=-1).to(tl.int32)
            _store_pairwise_rows(p_ids, p_offs, N, E, offs_e, counts_ptr, sorted_ptr, pos_ptr)
            return
        if SORT_LOG > 0:
            SORT_SLOTS: tl.constexpr = 1 << SORT_LOG
            if N <= SORT_SLOTS:
                # one program sorts keys (expert, slot) in registers (a bitonic network: log2(SORT_SLOTS)^2 / 2
                # compare-exchange steps) and counts with a histogram: no [slots, slots] or [slots, E_POW2]
                # tiles, which make most of the time of the blocks below at 128+ experts
                if tl.program_id(0) > 0:
                    return
                k_offs = tl.arange(0, SORT_SLOTS)
                k_mask = k_offs < N
                k_ids = tl.load(ids_ptr + _slot_offsets(k_offs, s_it, s_ik, TOPK), mask=k_mask, other=-1).to(tl.int32)
                k_valid = k_mask & (k_ids >= 0) & (k_ids < E)
                k_counts = tl.histogram(tl.where(k_valid, k_ids, 0), E_POW2, mask=k_valid)
                tl.store(counts_ptr + offs_e, k_counts, mask=offs_e < E)
                tl.store(counts_ptr + E, tl.reduce(k_counts, 0, _add))
                # slots of no expert and the tile's padding sort after every valid one; the slot in the low bits
                # keeps the order inside an expert the slots' (the pairwise rows, exactly)
                k_keys = _bitonic_sort(tl.where(k_valid, k_ids, E) * SORT_SLOTS + k_offs, SORT_LOG)
                k_slot = k_keys % SORT_SLOTS
                k_rows = k_keys < E * SORT_SLOTS
                tl.store(sorted_ptr + k_offs, k_slot, mask=k_rows)
                tl.store(pos_ptr + k_slot, k_offs.to(tl.int64), mask=k_rows)
                tl.store(pos_ptr + k_offs, tl.full((SORT_SLOTS,), -1, tl.int64), mask=k_mask & ~k_valid)
                return
        # More slots than one tile: one program per PAIRS slots (the grid's). Each counts every expert's slots
        # (a [PAIRS, E_POW2] tile per block of slots), then ranks its own slots pairwise among the earlier
        # ones: the two passes' rows, from programs that run side by side instead of one program's chunks.
        b_offs = tl.arange(0, PAIRS)
        b_counts = tl.full((E_POW2,), 0, tl.int32)
        for b0 in range(0, N, PAIRS):
            b_all = b0 + b_offs
            b_ids = tl.load(ids_ptr + _slot_offsets(b_all, s_it, s_ik, TOPK), mask=b_all < N, other=-1).to(tl.int32)
            b_hit = (b_ids[:, None] == offs_e[None, :]) & ((b_ids >= 0) & (b_ids < E))[:, None]
            b_counts += tl.reduce(b_hit.to(tl.int32), 0, _add)
        pid = tl.program_id(0)
        if pid == 0:
            tl.store(counts_ptr + offs_e, b_counts, mask=offs_e < E)
            tl.store(counts_ptr + E, tl.reduce(b_counts, 0, _add))
        b_starts = tl.associative_scan(b_counts, 0, _add) - b_counts
        m_offs = pid * PAIRS + b_offs
        m_mask = m_offs < N
        m_ids = tl.load(ids_ptr + _slot_offsets(m_offs, s_it, s_ik, TOPK), mask=m_mask, other=-1).to(tl.int32)
        m_valid = m_mask & (m_ids >= 0) & (m_ids < E)
        # a slot's rank: earlier slots of its expert inside its block, then in every block before it
        m_rank = tl.reduce(((m_ids[:, None] == m_ids[None, :]) & (b_offs[None, :] < b_offs[:, None])).to(tl.int32),
                           1, _add)
        for r0 in range(0, pid * PAIRS, PAIRS):
            r_ids = tl.load(ids_ptr + _slot_offsets(r0 + b_offs, s_it, s_ik, TOPK)).to(tl.int32)  # all below N
            m_rank += tl.reduce((m_ids[:, None] == r_ids[None, :]).to(tl.int32), 1, _add)
        m_row = tl.reduce(tl.where(m_ids[:, None] == offs_e[None, :], b_starts[None, :], 0), 1, _add) + m_rank
        tl.store(sorted_ptr + m_row, m_offs, mask=m_valid)
        tl.store(pos_ptr + m_offs, tl.where(m_valid, m_row, -1).to(tl.int64), mask=m_mask)
        return
    if tl.program_id(0) > 0:  # the two passes run in one program (the grid is sized for the pairwise blocks)
        return
    counts = tl.full((E_POW2,), 0, tl.int32)
    for c0 in range(0, N, CHUNK):
        offs = c0 + tl.arange(0, CHUNK)
        ids = tl.load(ids_ptr + _slot_offsets(offs, s_it, s_ik, TOPK), mask=offs < N, other=-1).to(tl.int32)
        hit = (ids[:, None] == offs_e[None, :]) & ((offs < N) & (ids >= 0) & (ids < E))[:, None]
        counts += tl.reduce(hit.to(tl.int32), 0, _add)
    tl.store(counts_ptr + offs_e, counts, mask=offs_e < E)
    tl.store(counts_ptr + E, tl.reduce(counts, 0, _add))
    seen = tl.associative_scan(counts, 0, _add) - counts  # start[e], then start[e] + slots placed so far
    for c0 in range(0, N, CHUNK):
        offs = c0 + tl.arange(0, CHUNK)
        smask = offs < N
        ids = tl.load(ids_ptr + _slot_offsets(offs, s_it, s_ik, TOPK), mask=smask, other=-1).to(tl.int32)
        valid = smask & (ids >= 0) & (ids < E)
        hit = ((ids[:, None] == offs_e[None, :]) & valid[:, None]).to(tl.int32)
        before = tl.associative_scan(hit, 0, _add) - hit  # earlier slots of the chunk with the same expert
        row = tl.reduce(hit * (seen[None, :] + before), 1, _add)
        tl.store(sorted_ptr + row, offs, mask=valid)
        tl.store(pos_ptr + offs, tl.where(valid, row, -1).to(tl.int64), mask=smask)
        seen += tl.reduce(hit, 0, _add)


# --------------------------------------------------------------------------------------------------
# Decode: one program per (slot, slice of I) runs the whole expert MLP on its slice; no sort, no layout
# --------------------------------------------------------------------------------------------------


@triton.jit
def decode_experts_kernel(
    x_ptr,
    ids_ptr,
    rw_ptr,
    w13_ptr,
    w2_ptr,
    s13_ptr,
    s2_ptr,
    b13_ptr,
    part_ptr,
    H,
    I,
    E,
    num_slices,
    s_xt,
    s_xh,
    s_it,
    s_ik,
    s_rt,
    s_rk,
    s_ae,
    s_an,
    s_ah,
    s_ce,
    s_ch,
    s_ci,
    s_13e,
    s_13n,
    s_13k,
    s_2e,
    s_2n,
    s_2k,
    s_be,
    s_bn,
    alpha,
    limit,
    up_offset,
    TOPK: tl.constexpr,
    BLOCK_I: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_H: tl.constexpr,
    ACT: tl.constexpr,
    GATED: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    HAS_LIMIT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    ROUTE_ON_INPUT: tl.constexpr,
    FP8: tl.constexpr,
    INTERP: tl.constexpr,
    USE_DOT: tl.constexpr,
    IEEE: tl.constexpr,
):
    """part[p, s] = W2[e][:, slice s] @ act(W13[e][slice s rows] @ x_t) for slot p = (t, k), e = ids[t, k].

    Grid ``(T * K, num_slices)``. Every slot reads its expert's weights itself (decode: few slots, hardly
    two on one expert), GEMM1's rows of slice ``s`` (gate and up) as a GEMV over H, the activation in
    registers, then GEMM2's columns of the slice over H in ``BLOCK_H`` chunks: the ``[*, 2I]`` and ``[*, I]``
    products are never stored, only the fp32 partial ``[H]`` of each (slot, slice), which
    :func:`decode_combine_kernel` sums. Slots naming no computed expert (``-1``, identity experts) write
    nothing. FP8: e4m3 weights dequantised in registers with their 128x128 block scales (``s13 [E,
    N1/128, H/128]``, ``s2 [E, H/128, I/128]``; BLOCK_K divides 128); the tokens stay in their dtype.
    ROUTE_ON_INPUT: GEMM1's product is scaled by the slot's routing weight before the bias (``(w x) W^T``).
    USE_DOT: the products as tensor-core MMAs on 16-column tiles holding the slot in column 0 (the loads
    then pipeline as a GEMM's do; the activation is rounded to the weights' dtype for GEMM2, as the GEMM
    paths do), else as fp32 multiply-and-reduce GEMVs. IEEE: fp32 MMAs without TF32 (fp32 weights).
    """
    p = tl.program_id(0)
    s = tl.program_id(1)
    t = (p // TOPK).to(tl.int64)
    k = p % TOPK
    e = tl.load(ids_ptr + t * s_it + k * s_ik).to(tl.int64)
    if (e < 0) | (e >= E):
        return
    offs_i = s * BLOCK_I + tl.arange(0, BLOCK_I)
    imask = offs_i < I
    if INTERLEAVED:
        rows_g = 2 * offs_i
        rows_u = 2 * offs_i + 1
    else:
        rows_g = offs_i
        rows_u = I + offs_i
    w13_e = w13_ptr + e * s_ae
    if USE_DOT:
        # [BLOCK_I, 16] accumulators: W rows x the slot's token in column 0 (the other columns stay 0)
        if INTERP:  # the CPU interpreter's dot mis-reads bf16 / fp8 operands; fp32 is exact there
            cdt = tl.float32
        elif FP8:
            cdt = tl.bfloat16
        else:
            cdt = w13_ptr.dtype.element_ty
        col0 = tl.arange(0, 16) == 0
        acc_g = tl.full((BLOCK_I, 16), 0.0, tl.float32)
        acc_u = tl.full((BLOCK_I, 16), 0.0, tl.float32)
    else:
        acc_g = tl.full((BLOCK_I, BLOCK_K), 0.0, tl.float32)
        acc_u = tl.full((BLOCK_I, BLOCK_K), 0.0, tl.float32)
    for k0 in range(0, H, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        kmask = offs_k < H
        m2 = imask[:, None] & kmask[None, :]
        if USE_DOT:
            xt = tl.load(x_ptr + t * s_xt + offs_k[None, :] * s_xh + 0 * tl.arange(0, 16)[:, None],
                         mask=col0[:, None] & kmask[None, :], other=0.0).to(cdt)  # [16, BLOCK_K]
        else:
            xv = tl.load(x_ptr + t * s_xt + offs_k * s_xh, mask=kmask, other=0.0).to(tl.float32)
        wg = tl.load(w13_e + rows_g[:, None] * s_an + offs_k[None, :] * s_ah, mask=m2, other=0.0)
        if FP8:
            sg = tl.load(s13_ptr + e * s_13e + (rows_g // 128) * s_13n + (k0 // 128) * s_13k, mask=imask, other=0.0)
            wg = wg.to(tl.float32) * sg[:, None]
        if USE_DOT:
            acc_g = _mma(acc_g, wg.to(cdt), tl.trans(xt), False, IEEE or INTERP)
        else:
            acc_g += wg.to(tl.float32) * xv[None, :]
        if GATED:
            wu = tl.load(w13_e + rows_u[:, None] * s_an + offs_k[None, :] * s_ah, mask=m2, other=0.0)
            if FP8:
                su = tl.load(s13_ptr + e * s_13e + (rows_u // 128) * s_13n + (k0 // 128) * s_13k, mask=imask,
                             other=0.0)
                wu = wu.to(tl.float32) * su[:, None]
            if USE_DOT:
                acc_u = _mma(acc_u, wu.to(cdt), tl.trans(xt), False, IEEE or INTERP)
            else:
                acc_u += wu.to(tl.float32) * xv[None, :]
    g = tl.reduce(acc_g, 1, _add)
    u = tl.reduce(acc_u, 1, _add)
    if ROUTE_ON_INPUT:
        rw = tl.load(rw_ptr + t * s_rt + k * s_rk).to(tl.float32)
        g = g * rw
        u = u * rw
    if HAS_BIAS:
        g += tl.load(b13_ptr + e * s_be + rows_g * s_bn, mask=imask, other=0.0).to(tl.float32)
        if GATED:
            u += tl.load(b13_ptr + e * s_be + rows_u * s_bn, mask=imask, other=0.0).to(tl.float32)
    a = _act_epilogue(g, u, alpha, limit, up_offset, ACT, GATED, HAS_LIMIT, INTERP)
    a = tl.where(imask, a, 0.0)
    if USE_DOT:
        a2 = tl.where(col0[:, None], a[None, :], 0.0).to(cdt)  # [16, BLOCK_I], the slot in row 0
    w2_e = w2_ptr + e * s_ce
    part = part_ptr + (p.to(tl.int64) * num_slices + s) * H
    for h0 in range(0, H, BLOCK_H):
        offs_h = h0 + tl.arange(0, BLOCK_H)
        hmask = offs_h < H
        m2 = hmask[:, None] & imask[None, :]
        w2t = tl.load(w2_e + offs_h[:, None] * s_ch + offs_i[None, :] * s_ci, mask=m2, other=0.0)
        if FP8:
            sc = tl.load(s2_ptr + e * s_2e + (offs_h[:, None] // 128) * s_2n + (offs_i[None, :] // 128) * s_2k,
                         mask=m2, other=0.0)
            w2t = w2t.to(tl.float32) * sc
        if USE_DOT:
            prod = _mma(tl.full((BLOCK_H, 16), 0.0, tl.float32), w2t.to(cdt), tl.trans(a2), False, IEEE or INTERP)
            y = tl.reduce(prod, 1, _add)
        else:
            y = tl.reduce(w2t.to(tl.float32) * a[None, :], 1, _add)
        tl.store(part + offs_h, y, mask=hmask)


@triton.jit
def decode_combine_kernel(
    part_ptr,
    ids_ptr,
    w_ptr,
    x_ptr,
    b2_ptr,
    out_ptr,
    H,
    E,
    E_IDENTITY,
    num_slices,
    s_it,
    s_ik,
    s_wt,
    s_wk,
    s_xt,
    s_xh,
    s_be,
    s_bh,
    s_ot,
    s_oh,
    TOPK: tl.constexpr,
    BLOCK_H: tl.constexpr,
    HAS_W: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    IDENTITY: tl.constexpr,
):
    """out[t] = sum_k w[t, k] * (sum_s part[(t, k), s] + b2[e]) in fp32 (grid ``(T, cdiv(H, BLOCK_H))``).

    The combine of :func:`decode_experts_kernel`: ids outside ``[0, E)`` add nothing, except identity
    experts (``[E, E + E_IDENTITY)``), which add ``w[t, k] * x[t]``. HAS_W false: the routing weights
    were applied to the expert's input (identity experts still scale ``x[t]`` by theirs).
    """
    t = tl.program_id(0).to(tl.int64)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = offs_h < H
    acc = tl.full((BLOCK_H,), 0.0, tl.float32)
    for k in range(TOPK):
        e = tl.load(ids_ptr + t * s_it + k * s_ik).to(tl.int64)
        if HAS_W or IDENTITY:
            w = tl.load(w_ptr + t * s_wt + k * s_wk).to(tl.float32)
        if (e >= 0) & (e < E):
            y = tl.full((BLOCK_H,), 0.0, tl.float32)
            row = part_ptr + (t * TOPK + k) * num_slices * H
            for s in range(num_slices):
                y += tl.load(row + s * H + offs_h, mask=hmask, other=0.0)
            if HAS_BIAS:
                y += tl.load(b2_ptr + e * s_be + offs_h * s_bh, mask=hmask, other=0.0).to(tl.float32)
            if HAS_W:
                y = y * w
            acc += y
        if IDENTITY:
            if (e >= E) & (e < E + E_IDENTITY):
                acc += w * tl.load(x_ptr + t * s_xt + offs_h * s_xh, mask=hmask, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * s_ot + offs_h * s_oh, acc.to(out_ptr.dtype.element_ty), mask=hmask)


# --------------------------------------------------------------------------------------------------
# The contiguous layout with aligned expert segments (DeepGEMM's m-grouped contiguous GEMMs)
# --------------------------------------------------------------------------------------------------


@triton.jit
def contiguous_rows_kernel(
    x_ptr,
    xs_ptr,
    w_ptr,
    scratch_ptr,
    pos_ptr,
    ids_ptr,
    out_ptr,
    outs_ptr,
    m_idx_ptr,
    pos_out_ptr,
    E,
    H,
    NUM_SG,
    s_xt,
    s_xh,
    s_st,
    s_sg,
    s_wt,
    s_wk,
    s_it,
    s_ik,
    s_or,
    s_oh,
    s_sr,
    s_sc,
    TOPK: tl.constexpr,
    K_POW2: tl.constexpr,
    E_POW2: tl.constexpr,
    ALIGN: tl.constexpr,
    BLOCK_H: tl.constexpr,
    SG_POW2: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    QUANT: tl.constexpr,
    ROUTE_W: tl.constexpr,
    INTERP: tl.constexpr,
):
    """Token ``t``'s TOPK slots into their rows of the aligned contiguous layout (grid ``(T,)``).

    The sort gave slot ``p = t * TOPK + k`` (expert ``e``) row ``start[e] + rank``; here expert ``e``'s rows start
    at ``start_pad[e]``, the exclusive sum of the counts rounded up to ``ALIGN`` each, so every expert owns whole
    ``ALIGN``-row blocks. The token's row is read once, ``BLOCK_H`` columns a step, and written to each of its slots'
    rows (one program a token: the token is read from memory once and each program moves a whole row per slot,
    where a program per (slot, column block) read it TOPK times and spent most of its time being scheduled).
    HAS_SCALE: ``x`` holds fp8 codes and ``xs`` their 1x128 scales, copied with them. QUANT: ``x`` holds bf16 /
    fp16 / fp32 values, quantised here per 1x128 group as :func:`moe_fx.lowering.triton.sort.quantize_rows` does
    (``_quant_groups``: the same codes and scales), so the layout needs no quantised copy of the tokens first;
    ``BLOCK_H`` is then a multiple of 128. ``m_idx[row] = e`` and ``pos_out[p] = row`` (-1 for a slot that sends
    no row). ROUTE_W: the row is scaled by the slot's routing weight (weights on the input; fp8: its scales are).
    """
    t = tl.program_id(0).to(tl.int64)
    offs_k = tl.arange(0, K_POW2)
    kmask = offs_k < TOPK
    p = t * TOPK + offs_k
    row = tl.load(pos_ptr + p, mask=kmask, other=-1)
    valid = kmask & (row >= 0)
    e = tl.load(ids_ptr + t * s_it + offs_k * s_ik, mask=kmask, other=0).to(tl.int32)
    offs_e = tl.arange(0, E_POW2)
    counts = tl.load(scratch_ptr + offs_e, mask=offs_e < E, other=0)
    before = offs_e[None, :] < e[:, None]
    start = tl.reduce(tl.where(before, counts[None, :], 0), 1, _add)
    start_pad = tl.reduce(tl.where(before, ((counts + ALIGN - 1) // ALIGN * ALIGN)[None, :], 0), 1, _add)
    prow = tl.where(valid, row - start + start_pad, -1).to(tl.int64)
    tl.store(pos_out_ptr + p, prow, mask=kmask)
    tl.store(m_idx_ptr + prow, e, mask=valid)
    if ROUTE_W:
        w = tl.load(w_ptr + t * s_wt + offs_k * s_wk, mask=valid, other=0.0).to(tl.float32)
    else:
        w = tl.full((K_POW2,), 1.0, tl.float32)  # unread: the quantising helper's argument
    if HAS_SCALE:  # the token's scale row, copied (times the routing weight) to each slot's row
        offs_g = tl.arange(0, SG_POW2)
        gmask = offs_g < NUM_SG
        sc = tl.load(xs_ptr + t * s_st + offs_g * s_sg, mask=gmask, other=0.0)
        sc2 = tl.broadcast_to(sc[None, :], (K_POW2, SG_POW2))
        if ROUTE_W:
            sc2 = sc2 * w[:, None]
        tl.store(outs_ptr + prow[:, None] * s_sr + offs_g[None, :] * s_sc, sc2, mask=valid[:, None] & gmask[None, :])
    for h0 in range(0, H, BLOCK_H):
        offs_h = h0 + tl.arange(0, BLOCK_H)
        hmask = offs_h < H
        v = tl.load(x_ptr + t * s_xt + offs_h * s_xh, mask=hmask, other=0.0)
        if QUANT:
            v2, sc2 = _quant_token_slots(v, w, out_ptr.dtype.element_ty, K_POW2, BLOCK_H, ROUTE_W, INTERP)
            offs_g = h0 // 128 + tl.arange(0, BLOCK_H // 128)
            tl.store(outs_ptr + prow[:, None] * s_sr + offs_g[None, :] * s_sc, sc2,
                     mask=valid[:, None] & (offs_g < NUM_SG)[None, :])
        elif ROUTE_W and not HAS_SCALE:
            v2 = v.to(tl.float32)[None, :] * w[:, None]
        else:
            v2 = tl.broadcast_to(v[None, :], (K_POW2, BLOCK_H))
        tl.store(out_ptr + prow[:, None] * s_or + offs_h[None, :] * s_oh, v2.to(out_ptr.dtype.element_ty),
                 mask=valid[:, None] & hmask[None, :])


@triton.jit
def copy_scales_kernel(
    src_ptr,
    dst_ptr,
    R,
    G,
    s_sr,
    s_sg,
    s_dr,
    s_dg,
    BLOCK_R: tl.constexpr,
    BLOCK_G: tl.constexpr,
):
    """``dst[r, g] = src[r, g]`` for ``[R, G]`` scales, a ``BLOCK_R x BLOCK_G`` tile a program (grid
    ``(cdiv(R, BLOCK_R), cdiv(G, BLOCK_G))``): a row-major scratch (``s_sg == 1``) into DeepGEMM's MN-major layout
    (``s_dr == 1``). The tile is read along groups and written along rows, each side in whole sectors (Triton
    moves it between the two orders through shared memory), where the copy kernel that wrote the scratch would
    have stored one scale per sector."""
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    g = tl.program_id(1) * BLOCK_G + tl.arange(0, BLOCK_G)
    m = (r < R)[:, None] & (g < G)[None, :]
    r64 = r.to(tl.int64)[:, None]
    g64 = g.to(tl.int64)[None, :]
    v = tl.load(src_ptr + r64 * s_sr + g64 * s_sg, mask=m)
    tl.store(dst_ptr + r64 * s_dr + g64 * s_dg, v, mask=m)
