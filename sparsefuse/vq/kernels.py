"""Triton kernels for the VQ codebook ops, and the launchers that allocate and launch them.

Notation: L levels, B rows, K codes, D dims. The EMA state is float32 and contiguous, shaped
``[L, K, D]`` / ``[L, K]`` (a single codebook is L = 1); x is ``[L, B, D]`` in float32, bfloat16,
float16 or float64 (summed in float32). See ``reference.py`` for the exact semantics.

EMA update, two kernels (deterministic mode sorts the rows by code first and adds the chunk-sum
kernel of ``_segsum.py``; DDP adds a restart kernel), no B x K one-hot, no host sync:

* ``_vq_ema_accumulate_kernel`` (grid: row blocks x levels) adds each row of x into its code's
  fp32 sum and count with atomics; ``_vq_ema_segment_kernel`` (grid: codes x levels, rows sorted by
  code) is the deterministic alternative that writes every sum once in a fixed order. Both also copy
  the pre-update ``cluster_size`` and counters into a scratch area of the same buffer, so that the
  next kernel can read every code's old state while codes are being rewritten in place.
* ``_vq_ema_apply_kernel`` (grid: code blocks x levels) blends, refreshes and restarts. Each program
  first scans the level's [K] scalars (from L2) for the two level-wide facts its codes need: the
  Laplace total sum N and the number of dead codes before its block (the rank that picks a dead
  code's restart row). Then it rewrites its own rows of the codebook and both EMA buffers once.
* In eager mode the statistics buffer is a cached workspace (``EmaWorkspace``) that the apply
  kernel leaves zeroed for the next update, so an update allocates nothing and launches no memset.
* Under DDP, ``torch.distributed.all_reduce`` of the statistics sits between the two; the apply
  kernel then writes the restart rows this rank owns into a candidate buffer, which is summed over
  ranks and installed by ``_vq_ema_restart_kernel``. It reads every rank's B from a device tensor
  (ranks may differ in B), so the global row count and this rank's first row, and with them the
  Feistel width, are computed in the kernel.

Nearest-code search: ``_nearest_code_fwd_kernel`` keeps a block of rows on chip and walks the codebook
in tiles, computing ||c||^2 - 2 x.c with ``tl.dot`` and keeping a running (min, argmin) per row: the
B x K matrix never exists. A NaN score ranks first (as in ``torch.argmin``) and gives a NaN distance;
NaN scores are found from the norms of the rows and codes (a NaN entry makes its norm NaN).

Offsets: x ([L, B, D] or [B, D]) and the codebook may pass 2^31 elements, so every program index (and
every row or code index loaded from memory) is int64 before it multiplies a row length or stride; the
search's codebook tile offsets are int64 where K * stride may pass 2^31 (``OFF64``), int32
otherwise. The GPU tests ``test_gpu_*_offsets_past_2_31`` check rows past 2^31 elements.
"""

from __future__ import annotations

import functools
import threading

import torch
import triton
import triton.language as tl

from .._dtypes import acc_dtype, tl_dtype
from .._launch import _current_stream, cdiv, launch, launch_tuned, next_pow2
from .._registry import INTERPRET
from .._segsum import GATHER_STEP, chunk_partials, chunk_size, segment_sum
from .._validate import check_index_range
from . import reference

_MUL1 = tl.constexpr(reference.HASH_MUL1)
_MUL2 = tl.constexpr(reference.HASH_MUL2)
_HMASK = tl.constexpr(reference.HASH_MASK)
_LEVEL_MUL = tl.constexpr(reference.LEVEL_MUL)

# Launch heuristics, in one place.
_ACC_BLOCK_B, _ACC_WARPS = (16, 4) if INTERPRET else (32, 4)
_SEG_BLOCK_D = 64 if INTERPRET else 256
_SEG_WARPS = 2
_APPLY_WARPS = 4
_SCAN_BLOCK = 256 if INTERPRET else 1024
_NORM_BLOCK = 64 if INTERPRET else 128
_NORM_BLOCK_D, _NORM_WARPS = 64, 4
_Q_BLOCK_B, _Q_BLOCK_D = (16, 32) if INTERPRET else (16, 128)
_Q_WARPS = 4
_OFF64_FROM = 2**31  # the search's codebook offsets go int64 from K * stride = this (a test lowers it)
_WORLD_BLOCK = 64  # ranks per step of the apply kernel's sum over every rank's rows


def _apply_block_c(K: int) -> int:
    """Codes per apply program: about 256 programs a level (each also scans the level's [K] scalars)."""
    return 16 if INTERPRET else max(4, min(32, next_pow2(max(K // 256, 1))))


def _block_d(D: int, cap: int) -> int:
    return max(16, min(next_pow2(max(D, 1)), cap))


# --- EMA update ------------------------------------------------------------------------------------


@triton.jit
def _stats_ptrs(stats_ptr, K, D, parity):
    """Pointers to the parts of the flat statistics buffer (see stats_layout): sums, counts, scratch
    copies of the old cluster sizes and counters, and the spare counts slot that a reused workspace
    keeps after them (see EmaWorkspace: with ``parity`` 1 the two counts slots trade places).
    The grid's second axis is the level, so its size is L."""
    LK = tl.num_programs(1).to(tl.int64) * K
    LKD = LK * D
    sn_ptr = stats_ptr + LKD + LK
    n_ptr = stats_ptr + LKD + 3 * LK * parity
    return stats_ptr, n_ptr, sn_ptr, sn_ptr + LK, stats_ptr + LKD + 3 * LK * (1 - parity)


@triton.jit
def _copy_scratch(cs_ptr, cnt_ptr, sn_ptr, sc_ptr, o_k, m_k, HAS_COUNTERS: tl.constexpr):
    """Scratch copy of the old per-code scalars (counters as fp32, clamped to 2^24 to stay exact)."""
    tl.store(sn_ptr + o_k, tl.load(cs_ptr + o_k, mask=m_k, other=0), mask=m_k)
    if HAS_COUNTERS:
        b_c = tl.load(cnt_ptr + o_k, mask=m_k, other=0)
        b_c = tl.minimum(b_c, 16777216).to(tl.float32)
    else:
        b_c = tl.zeros(o_k.shape, dtype=tl.float32)
    tl.store(sc_ptr + o_k, b_c, mask=m_k)


@triton.jit(do_not_specialize=["parity"])
def _vq_ema_accumulate_kernel(
    x_ptr,  # [L, B, D] contiguous, storage dtype
    codes_ptr,  # [L, B] int32 | int64
    stats_ptr,  # flat fp32, zeroed (stats_layout): sums [L, K, D] and counts [L, K] by atomics, then scratch
    cs_ptr,  # [L, K] fp32 cluster_size (read only)
    cnt_ptr,  # [L, K] int counters (read only; HAS_COUNTERS)
    parity,  # which counts slot (0 | 1, see _stats_ptrs)
    B,
    K,
    D,
    HAS_COUNTERS: tl.constexpr,
    BLOCK_B: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SCAN: tl.constexpr,
):
    i_b = tl.program_id(0).to(tl.int64)
    i_l = tl.program_id(1).to(tl.int64)
    s_ptr, n_ptr, sn_ptr, sc_ptr, _ = _stats_ptrs(stats_ptr, K, D, parity)
    o_b = i_b * BLOCK_B + tl.arange(0, BLOCK_B)
    m_b = o_b < B
    b_code = tl.load(codes_ptr + i_l * B + o_b, mask=m_b, other=0).to(tl.int64)  # [BLOCK_B]
    m_ok = m_b & (b_code >= 0) & (b_code < K)
    # a code outside [0, K) (index checks off) poisons the nearest valid code: NaN count and sums
    b_code = tl.minimum(tl.maximum(b_code, 0), K - 1)
    p_s = s_ptr + (i_l * K + b_code) * D  # [BLOCK_B]
    p_x = x_ptr + (i_l * B + o_b) * D  # [BLOCK_B]
    for i_d in range(0, D, BLOCK_D):
        o_d = i_d + tl.arange(0, BLOCK_D)
        m_d = o_d < D
        m = m_b[:, None] & m_d[None, :]
        b_x = tl.load(p_x[:, None] + o_d[None, :], mask=m, other=0).to(tl.float32)  # [BLOCK_B, BLOCK_D]
        b_x = tl.where(m_ok[:, None], b_x, float("nan"))
        tl.atomic_add(p_s[:, None] + o_d[None, :], b_x, mask=m, sem="relaxed")
    b_one = tl.where(m_ok, 1.0, float("nan"))  # [BLOCK_B]
    tl.atomic_add(n_ptr + i_l * K + b_code, b_one, mask=m_b, sem="relaxed")
    if i_b == 0:
        for i_k in range(0, K, BLOCK_SCAN):
            o_k = i_k + tl.arange(0, BLOCK_SCAN)
            _copy_scratch(cs_ptr, cnt_ptr, sn_ptr, sc_ptr, i_l * K + o_k, o_k < K, HAS_COUNTERS)


@triton.jit
def _vq_ema_segment_kernel(
    x_ptr,  # [L, B, D] contiguous, storage dtype
    order_ptr,  # [L, B] int64: row ids of each level sorted by code
    seg_ptr,  # [L, K + 1] int64: code k owns sorted positions seg[k] .. seg[k + 1] - 1
    part_ptr,  # [L, NC, D] fp32: sums of the whole single-code chunks of CHUNK sorted rows (_segsum)
    stats_ptr,  # flat fp32 out (stats_layout): sums, counts, scratch
    cs_ptr,  # [L, K] fp32 cluster_size (read only)
    cnt_ptr,  # [L, K] int counters (HAS_COUNTERS)
    B,
    K,
    D,
    NC,
    HAS_COUNTERS: tl.constexpr,
    BLOCK_D: tl.constexpr,
    CHUNK: tl.constexpr,
    E: tl.constexpr,
):
    """Deterministic statistics: one program per (code, level), rows summed in a fixed order (sorted
    order, with whole chunks of a crowded code taken from their partial sums, see ``sparsefuse/_segsum.py``).

    Codes outside [0, K) (index checks off) sort before seg[0] or from seg[K] on; as in the atomic
    kernel they poison the nearest valid code (0 or K - 1): its count and sums are NaN."""
    i_k = tl.program_id(0).to(tl.int64)
    i_l = tl.program_id(1).to(tl.int64)
    s_ptr, n_ptr, sn_ptr, sc_ptr, _ = _stats_ptrs(stats_ptr, K, D, 0)
    i_start = tl.load(seg_ptr + i_l * (K + 1) + i_k)
    i_end = tl.load(seg_ptr + i_l * (K + 1) + i_k + 1)
    m_bad = ((i_k == 0) & (i_start > 0)) | ((i_k == K - 1) & (i_end < B))
    for i_d in range(0, D, BLOCK_D):
        o_d = i_d + tl.arange(0, BLOCK_D)
        m_d = o_d < D
        b_acc = segment_sum(i_start, i_end, order_ptr + i_l * B, None, x_ptr + i_l * B * D,
                            part_ptr + i_l * NC * D, None, 1, o_d, m_d, D, CHUNK, False, False, tl.float32,
                            BLOCK_D, E)[0]
        tl.store(s_ptr + (i_l * K + i_k) * D + o_d, tl.where(m_bad, float("nan"), b_acc), mask=m_d)
    tl.store(n_ptr + i_l * K + i_k, tl.where(m_bad, float("nan"), (i_end - i_start).to(tl.float32)))
    o_k = i_k + tl.arange(0, 1)
    _copy_scratch(cs_ptr, cnt_ptr, sn_ptr, sc_ptr, i_l * K + o_k, o_k < K, HAS_COUNTERS)


@triton.jit
def _hash_round(r, k, mask):
    t = (r * _MUL1 + k) & _HMASK
    t = t ^ (t >> 15)
    t = (t * _MUL2) & _HMASK
    t = t ^ (t >> 13)
    return t & mask


@triton.jit
def _feistel(i, k0, k1, k2, k3, half, mask):
    left = i >> half
    right = i & mask
    left, right = right, left ^ _hash_round(right, k0, mask)
    left, right = right, left ^ _hash_round(right, k1, mask)
    left, right = right, left ^ _hash_round(right, k2, mask)
    left, right = right, left ^ _hash_round(right, k3, mask)
    return (left << half) | right


@triton.jit
def _half_bits(n):
    """reference._half_bits: the smallest h >= 1 with 4^h >= n (n an int64 scalar)."""
    one = tl.full([], 1, tl.int64)
    half = one
    while (one << (2 * half)) < n:
        half += 1
    return half


@triton.jit
def _restart_rows(i, key_ptr, w0, w1, w2, w3, i_l, n, KEY_WORDS: tl.constexpr):
    """reference.restart_rows: keyed bijection of [0, n) with cycle walking. The level's keys come
    from ``key_ptr`` ([L, 4] int64) or, with KEY_WORDS, from reference.expand_words(w0..w3)."""
    half = _half_bits(n)
    if KEY_WORDS:
        lev = i_l * _LEVEL_MUL
        k0 = (w0 ^ lev) & _HMASK
        k1 = (w1 ^ lev) & _HMASK
        k2 = (w2 ^ lev) & _HMASK
        k3 = (w3 ^ lev) & _HMASK
    else:
        k0 = tl.load(key_ptr + i_l * 4 + 0)
        k1 = tl.load(key_ptr + i_l * 4 + 1)
        k2 = tl.load(key_ptr + i_l * 4 + 2)
        k3 = tl.load(key_ptr + i_l * 4 + 3)
    mask = (tl.full([], 1, tl.int64) << half) - 1
    v = _feistel(i, k0, k1, k2, k3, half, mask)
    while tl.max((v >= n).to(tl.int32), axis=0) > 0:
        v = tl.where(v >= n, _feistel(v, k0, k1, k2, k3, half, mask), v)
    return v


@triton.jit
def _global_rows(sizes_ptr, world, rank, BLOCK_W: tl.constexpr):
    """(rows of all ranks, rows of the ranks before ``rank``) from ``sizes_ptr`` ([world] int64)."""
    b_tot = tl.zeros([BLOCK_W], dtype=tl.int64)
    b_off = tl.zeros([BLOCK_W], dtype=tl.int64)
    for i_w in range(0, world, BLOCK_W):
        o_w = i_w + tl.arange(0, BLOCK_W)
        b_s = tl.load(sizes_ptr + o_w, mask=o_w < world, other=0)
        b_tot += b_s
        b_off += tl.where(o_w < rank, b_s, 0)
    return tl.sum(b_tot, axis=0), tl.sum(b_off, axis=0)


@triton.jit
def _code_state(b_n, b_cs, b_cnt, decay, omd, threshold, restart_after, n_rows, ACTIVE: tl.constexpr):
    """New cluster size, new counter and dead flag of a block of codes (none dead without rows:
    ``n_rows`` counts every rank's). A NaN count (a code poisoned by an out-of-range code) counts
    as used, so the NaN reaches the code's state."""
    m_used = (b_n > 0) | (b_n != b_n)
    b_new = decay * b_cs + omd * b_n
    if ACTIVE:
        b_new = tl.where(m_used, b_new, b_cs)
    b_cnt_new = tl.where(m_used, 0, b_cnt + 1)
    if ACTIVE:
        m_dead = (b_cnt_new >= restart_after) & (restart_after > 0)
    else:
        m_dead = b_new < threshold
    return b_new, b_cnt_new, tl.where(n_rows > 0, m_dead, False)


# ints that only enter scalar arithmetic are not specialised: fewer variants, cheaper launches
@triton.jit(do_not_specialize=["parity", "restart_after", "world", "rank", "w0", "w1", "w2", "w3"])
def _vq_ema_apply_kernel(
    x_ptr,  # [L, B, D] contiguous, storage dtype
    cb_ptr,  # [L, K, D] fp32 codebook (in place)
    cs_ptr,  # [L, K] fp32 cluster_size (in place)
    es_ptr,  # [L, K, D] fp32 embed_sum (in place)
    cnt_ptr,  # [L, K] int counters (in place; HAS_COUNTERS)
    stats_ptr,  # flat fp32 (stats_layout): batch sums and counts, scratch copies of the old scalars
    key_ptr,  # [L, 4] int64 round keys of the restart permutation (unless KEY_WORDS)
    sizes_ptr,  # [world] int64 rows of every rank (DIST)
    cand_ptr,  # [L, K, D] fp32 out: restart rows owned by this rank, zeros elsewhere (DIST)
    dead_ptr,  # [L, K] int8 out: dead flags (DIST)
    parity,  # which counts slot holds this update's counts (0 | 1, see _stats_ptrs)
    B,
    K,
    D,
    decay,
    omd,  # 1 - decay, rounded on the host as the reference rounds it
    eps,
    threshold,
    reset,
    restart_after,
    world,  # DIST: ranks, and this one's
    rank,
    w0,  # KEY_WORDS: the four key words (reference.key_words)
    w1,
    w2,
    w3,
    ACTIVE: tl.constexpr,
    HAS_COUNTERS: tl.constexpr,
    DIST: tl.constexpr,
    KEY_WORDS: tl.constexpr,
    ZERO_STATS: tl.constexpr,  # leave the sums and the spare counts zeroed for the next call
    BLOCK_C: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SCAN: tl.constexpr,
    BLOCK_W: tl.constexpr,
):
    i_c = tl.program_id(0).to(tl.int64)
    i_l = tl.program_id(1).to(tl.int64)
    s_ptr, n_ptr, sn_ptr, sc_ptr, nz_ptr = _stats_ptrs(stats_ptr, K, D, parity)
    i_start = i_c * BLOCK_C
    # restart rows come from the global batch: every rank's rows, this rank's starting at row_off
    if DIST:
        n_rows, row_off = _global_rows(sizes_ptr, world, rank, BLOCK_W)
    else:
        n_rows, row_off = tl.zeros([], dtype=tl.int64) + B, 0
    # level-wide facts from every code's old state: Laplace total and dead codes before this block
    b_tot = tl.zeros([BLOCK_SCAN], dtype=tl.float32)
    b_before = tl.zeros([BLOCK_SCAN], dtype=tl.int32)
    for i_k in range(0, K, BLOCK_SCAN):
        o_k = i_k + tl.arange(0, BLOCK_SCAN)
        m_k = o_k < K
        b_n = tl.load(n_ptr + i_l * K + o_k, mask=m_k, other=0)
        b_cs = tl.load(sn_ptr + i_l * K + o_k, mask=m_k, other=0)
        if HAS_COUNTERS:
            b_cnt = tl.load(sc_ptr + i_l * K + o_k, mask=m_k, other=0)
        else:
            b_cnt = tl.zeros([BLOCK_SCAN], dtype=tl.float32)
        b_new, _, m_dead = _code_state(b_n, b_cs, b_cnt, decay, omd, threshold, restart_after, n_rows, ACTIVE)
        b_tot += tl.where(m_k, b_new, 0.0)
        b_before += (m_k & m_dead & (o_k < i_start)).to(tl.int32)
    tot = tl.sum(b_tot, axis=0)
    n_before = tl.sum(b_before, axis=0)

    o_c = i_start + tl.arange(0, BLOCK_C)
    m_c = o_c < K
    o_lk = i_l * K + o_c  # [BLOCK_C]
    b_n = tl.load(n_ptr + o_lk, mask=m_c, other=0)
    b_cs = tl.load(cs_ptr + o_lk, mask=m_c, other=0)
    if HAS_COUNTERS:
        b_cnt = tl.load(cnt_ptr + o_lk, mask=m_c, other=0)
    else:
        b_cnt = tl.zeros([BLOCK_C], dtype=tl.int32)
    b_new, b_cnt_new, m_dead = _code_state(b_n, b_cs, b_cnt, decay, omd, threshold, restart_after, n_rows,
                                           ACTIVE)
    m_dead = m_dead & m_c
    m_used = (b_n > 0) | (b_n != b_n)  # as in _code_state
    if ACTIVE:
        m_refresh = m_used
        b_inv = 1.0 / tl.maximum(b_new, eps)
    else:
        b_sm = (b_new + eps) / (tot + K * eps) * tot
        m_refresh = (b_sm > 0) | (b_sm != b_sm)  # a NaN total (a poisoned code) reaches every code
        b_inv = 1.0 / tl.where(m_refresh, b_sm, 1.0)
    # restart rows: dead code number r takes global row perm(r mod n_rows)
    b_rank = n_before + tl.cumsum(m_dead.to(tl.int32), axis=0) - 1  # [BLOCK_C]
    n_rows = tl.maximum(n_rows, 1)
    b_rank = tl.where(m_dead, b_rank, 0).to(tl.int64) % n_rows
    b_row = _restart_rows(b_rank, key_ptr, w0, w1, w2, w3, i_l, n_rows, KEY_WORDS) - row_off
    m_own = m_dead & (b_row >= 0) & (b_row < B)
    b_row = tl.where(m_own, b_row, 0)
    if ACTIVE:
        r = 0.0
    else:
        r = reset

    p_x = x_ptr + (i_l * B + b_row) * D  # [BLOCK_C]
    for i_d in range(0, D, BLOCK_D):
        o_d = i_d + tl.arange(0, BLOCK_D)
        m_d = o_d < D
        m = m_c[:, None] & m_d[None, :]
        o_lkd = o_lk[:, None] * D + o_d[None, :]  # [BLOCK_C, BLOCK_D]
        b_es = tl.load(es_ptr + o_lkd, mask=m, other=0)
        b_s = tl.load(s_ptr + o_lkd, mask=m, other=0)
        b_cb = tl.load(cb_ptr + o_lkd, mask=m, other=0)
        b_es_new = decay * b_es + omd * b_s
        if ACTIVE:
            b_es_new = tl.where(m_used[:, None], b_es_new, b_es)
        b_cb = tl.where(m_refresh[:, None], b_es_new * b_inv[:, None], b_cb)
        b_v = tl.load(p_x[:, None] + o_d[None, :], mask=m_own[:, None] & m_d[None, :], other=0).to(tl.float32)
        if DIST:
            tl.store(cand_ptr + o_lkd, b_v, mask=m)
        else:
            b_cb = tl.where(m_dead[:, None], b_v, b_cb)
            b_es_new = tl.where(m_dead[:, None], b_v * r, b_es_new)
        tl.store(es_ptr + o_lkd, b_es_new, mask=m)
        tl.store(cb_ptr + o_lkd, b_cb, mask=m)
    tl.store(cs_ptr + o_lk, tl.where(m_dead, r, b_new), mask=m_c)
    if HAS_COUNTERS:
        tl.store(cnt_ptr + o_lk, tl.where(m_dead, 0, b_cnt_new).to(cnt_ptr.dtype.element_ty), mask=m_c)
    if DIST:
        tl.store(dead_ptr + o_lk, m_dead.to(tl.int8), mask=m_c)
    if ZERO_STATS:
        # Zero this block's sums (only this program reads them) once every thread of the program
        # has read its share: the compiler may give the zero store a different thread layout
        # than the load, and a store that does not depend on the loaded value could then overwrite
        # a sum before another thread of the program has read it (seen at D = 256 with bf16 x).
        tl.debug_barrier()
        for i_d in range(0, D, BLOCK_D):
            o_d = i_d + tl.arange(0, BLOCK_D)
            m = m_c[:, None] & (o_d < D)[None, :]
            tl.store(s_ptr + o_lk[:, None] * D + o_d[None, :], tl.zeros([BLOCK_C, BLOCK_D], dtype=tl.float32), mask=m)
        # the spare counts, which the next update adds into; not this update's: every program's
        # level scan reads all of those
        tl.store(nz_ptr + o_lk, tl.zeros([BLOCK_C], dtype=tl.float32), mask=m_c)


@triton.jit
def _vq_ema_restart_kernel(
    cb_ptr,  # [L, K, D] fp32 codebook (in place)
    es_ptr,  # [L, K, D] fp32 embed_sum (in place)
    cand_ptr,  # [L, K, D] fp32 restart rows, summed over ranks
    dead_ptr,  # [L, K] int8
    K,
    D,
    reset,
    BLOCK_C: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    i_c = tl.program_id(0).to(tl.int64)
    i_l = tl.program_id(1).to(tl.int64)
    o_c = i_c * BLOCK_C + tl.arange(0, BLOCK_C)
    o_lk = i_l * K + o_c
    m_dead = tl.load(dead_ptr + o_lk, mask=o_c < K, other=0) != 0  # [BLOCK_C]
    for i_d in range(0, D, BLOCK_D):
        o_d = i_d + tl.arange(0, BLOCK_D)
        m = m_dead[:, None] & (o_d < D)[None, :]
        o_lkd = o_lk[:, None] * D + o_d[None, :]
        b_v = tl.load(cand_ptr + o_lkd, mask=m, other=0)  # [BLOCK_C, BLOCK_D]
        tl.store(cb_ptr + o_lkd, b_v, mask=m)
        tl.store(es_ptr + o_lkd, b_v * reset, mask=m)


def _levels(t: torch.Tensor):
    """(L, rows, D) of a stacked [L, rows, D] tensor or of one unstacked [rows, D] level."""
    return tuple(t.shape) if t.dim() == 3 else (1, *t.shape)


def stats_layout(L: int, K: int, D: int):
    """Offsets in the flat fp32 statistics buffer: [s: L*K*D | n: L*K | old cs: L*K | old counters: L*K].
    The first L*K*(D+1) entries are what DDP all-reduces."""
    return L * K * D, L * K * (D + 1), L * K * (D + 2), L * K * (D + 3)


def split_stats(stats: torch.Tensor, L: int, K: int, D: int):
    a, b, c, e = stats_layout(L, K, D)
    return stats[:a].view(L, K, D), stats[a:b].view(L, K), stats[b:c].view(L, K), stats[c:e].view(L, K)


class EmaWorkspace:
    """Statistics buffer reused by consecutive eager updates of one shape on one stream, so that an
    update allocates and zeroes nothing (a torch.zeros is an allocation and a memset launch: ~10 us
    of host time, a fifth of a whole update on an H200's host).

    Layout: :func:`stats_layout` followed by a spare counts slot, ``L * K * (D + 4)`` fp32 in all.
    Between updates the sums and the counts slot picked by ``parity`` are zero. The accumulate
    kernel adds into them; the apply kernel zeroes each block of sums after reading it (only its
    program reads it) and zeroes the *other* counts slot, which no program reads in that launch
    (every program's level scan reads all of this update's counts, so those cannot be zeroed in the
    same launch); then ``parity`` flips. ``dirty`` is set before the accumulate launch and cleared
    once the apply launch is enqueued: an update interrupted in between (an exception, a
    KeyboardInterrupt) leaves it set, and the next update re-zeroes the buffer before using it.
    """

    __slots__ = ("buf", "parity", "dirty")

    def __init__(self, buf: torch.Tensor):
        self.buf, self.parity, self.dirty = buf, 0, False


class _PerThread(threading.local):
    def __init__(self):
        self.workspaces = {}


_PER_THREAD = _PerThread()


def ema_workspace(ref: torch.Tensor, L: int, K: int, D: int):
    """The calling thread's :class:`EmaWorkspace` for updates of shape (L, K, D) on ``ref``'s device
    and the current stream, or None while a CUDA graph is being captured.

    One per (thread, device, stream, shape): the updates that share one are enqueued one after the
    other on one stream, so each finds it zeroed by the previous one's apply kernel (a DDP update
    does not use it: its all-reduce wants the sums and counts adjacent). It holds
    ``L * K * (D + 4)`` fp32 (0.5 MiB at K = 1024, D = 128) until :func:`clear_ema_workspaces` or the
    thread's end. While a graph is captured the update allocates a fresh zeroed buffer instead: the
    memset is recorded in the graph and the buffer comes from the graph's private pool, whereas a
    cached workspace would be shared by the graph's replays (on whatever stream they run) and by
    eager updates.
    """
    if ref.is_cuda:
        if torch.cuda.is_current_stream_capturing():
            return None
        idx = ref.get_device()
        key = (idx, _current_stream(idx), L, K, D)
    else:  # CPU tensors under the Triton interpreter: no streams
        key = (-1, 0, L, K, D)
    cache = _PER_THREAD.workspaces
    ws = cache.get(key)
    if ws is None:
        with torch.inference_mode(False):  # an inference tensor could not be re-zeroed outside that mode
            buf = torch.zeros(L * K * (D + 4), device=ref.device, dtype=torch.float32)
        ws = cache[key] = EmaWorkspace(buf)
    return ws


def clear_ema_workspaces() -> None:
    """Release the calling thread's cached EMA statistics buffers."""
    _PER_THREAD.workspaces.clear()


@functools.lru_cache(maxsize=256)
def _accumulate_config(B: int, D: int, has_cnt: bool):
    """(row blocks, constexpr arguments) of the accumulate kernel; the dict is shared: read only."""
    return (max(cdiv(B, _ACC_BLOCK_B), 1),
            dict(HAS_COUNTERS=has_cnt, BLOCK_B=_ACC_BLOCK_B, BLOCK_D=_block_d(D, 128), BLOCK_SCAN=_SCAN_BLOCK))


@functools.lru_cache(maxsize=256)
def _apply_config(K: int, D: int, active: bool, has_cnt: bool, dist: bool, key_words: bool, zero: bool):
    """(code blocks, constexpr arguments) of the apply kernel; the dict is shared: read only."""
    block_c = _apply_block_c(K)
    return (cdiv(K, block_c),
            dict(ACTIVE=active, HAS_COUNTERS=has_cnt, DIST=dist, KEY_WORDS=key_words, ZERO_STATS=zero,
                 BLOCK_C=block_c, BLOCK_D=_block_d(D, 128), BLOCK_SCAN=_SCAN_BLOCK, BLOCK_W=_WORLD_BLOCK))


def ema_accumulate(x, codes, cluster_size, counters, deterministic, check_codes=True, workspace=None):
    """Flat fp32 statistics buffer (see :func:`stats_layout`) for x [L, B, D], codes [L, B] (or one
    level unstacked: x [B, D], codes [B], cluster_size [K]). With a ``workspace`` (eager, not
    deterministic) the statistics go into its buffer, and :func:`ema_apply` must get the same one."""
    L, B, D = _levels(x)
    K = cluster_size.shape[-1]
    if check_codes:
        check_index_range("codes", codes, K)
    x = x.contiguous()
    codes = codes.contiguous()
    if deterministic:
        stats = torch.empty(stats_layout(L, K, D)[3], device=x.device, dtype=torch.float32)
        sorted_codes, order = torch.sort(codes, dim=-1, stable=True)
        bounds = torch.arange(K + 1, device=x.device, dtype=sorted_codes.dtype)
        if codes.dim() == 2:
            bounds = bounds.expand(L, K + 1).contiguous()
        seg = torch.searchsorted(sorted_codes, bounds)
        block_d, chunk = _block_d(D, _SEG_BLOCK_D), chunk_size(B, B)
        part, _ = chunk_partials(sorted_codes, order, None, x, 1, chunk, torch.float32, block_d, False, K)
        launch(_vq_ema_segment_kernel, (K, L),
               (x, order, seg, part, stats, cluster_size, counters, B, K, D, part.shape[1]),
               dict(HAS_COUNTERS=counters is not None, BLOCK_D=block_d, CHUNK=chunk, E=GATHER_STEP), _SEG_WARPS)
        return stats
    if workspace is None:
        stats, parity = torch.zeros(stats_layout(L, K, D)[3], device=x.device, dtype=torch.float32), 0
    else:
        if workspace.dirty:  # the last update stopped between its launches: partial sums may remain
            workspace.buf.zero_()
            workspace.parity = 0
        workspace.dirty = True
        stats, parity = workspace.buf, workspace.parity
    blocks, meta = _accumulate_config(B, D, counters is not None)
    launch(_vq_ema_accumulate_kernel, (blocks, L), (x, codes, stats, cluster_size, counters, parity, B, K, D), meta,
           _ACC_WARPS)
    return stats


def ema_apply(x, codebook, cluster_size, embed_sum, counters, stats, key, decay, eps, threshold, reset,
              restart_after, active, sizes, rank, workspace=None):
    """In-place blend, refresh and restart. ``key``: [L, 4] int64 tensor, or the four key words of
    reference.key_words (the eager path: no key tensor, no launch to draw it). ``stats`` from
    :func:`ema_accumulate` with the same ``workspace``, which this leaves zeroed for the next update.
    ``sizes``: None for one process, or under DDP the [world] int64 row counts of every rank (read
    on the device: ranks may differ in B) with ``rank`` this one's.
    Returns (cand [L, K, D] fp32, dead [L, K] int8) under DDP, else (None, None)."""
    L, K, D = _levels(codebook)
    B = x.shape[-2]
    x = x.contiguous()
    dist = sizes is not None
    cand = dead = None
    if dist:
        cand = torch.empty((L, K, D), device=codebook.device, dtype=torch.float32)
        dead = torch.empty((L, K), device=codebook.device, dtype=torch.int8)
        sizes = sizes.contiguous()
    key_words = not isinstance(key, torch.Tensor)
    words, key = (key, None) if key_words else ((0, 0, 0, 0), key)
    blocks, meta = _apply_config(K, D, bool(active), counters is not None, dist, key_words, workspace is not None)
    launch(_vq_ema_apply_kernel, (blocks, L),
           (x, codebook, cluster_size, embed_sum, counters, stats, key, sizes, cand, dead,
            0 if workspace is None else workspace.parity, B, K, D, float(decay), float(1 - decay), float(eps),
            float(threshold), float(reset), int(restart_after), 0 if sizes is None else sizes.shape[0], int(rank),
            *words),
           meta, _APPLY_WARPS)
    if workspace is not None:
        workspace.parity ^= 1
        workspace.dirty = False
    return cand, dead


def ema_restart(codebook, embed_sum, cand, dead, reset):
    L, K, D = _levels(codebook)
    block_c = _apply_block_c(K)
    launch(_vq_ema_restart_kernel, (cdiv(K, block_c), L), (codebook, embed_sum, cand.contiguous(), dead.contiguous(), K, D,
           float(reset)), dict(BLOCK_C=block_c, BLOCK_D=_block_d(D, 128)), _APPLY_WARPS)


# --- nearest-code search ------------------------------------------------------------------------------


@triton.jit
def _row_sqnorm_kernel(
    c_ptr,  # [K, D], strides (stride_ck, 1)
    out_ptr,  # [K] fp32: sum_d c^2
    K,
    D,
    stride_ck,
    BLOCK_K: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    o_k = tl.program_id(0).to(tl.int64) * BLOCK_K + tl.arange(0, BLOCK_K)
    m_k = o_k < K
    b_acc = tl.zeros([BLOCK_K], dtype=tl.float32)
    for i_d in range(0, D, BLOCK_D):
        o_d = i_d + tl.arange(0, BLOCK_D)
        b_c = tl.load(c_ptr + o_k[:, None] * stride_ck + o_d[None, :], mask=m_k[:, None] & (o_d < D)[None, :],
                      other=0).to(tl.float32)  # [BLOCK_K, BLOCK_D]
        b_acc += tl.sum(b_c * b_c, axis=1)
    tl.store(out_ptr + o_k, b_acc, mask=m_k)


def _search_configs(tensor_core: bool):
    if INTERPRET:
        return [triton.Config(dict(BLOCK_B=16, BLOCK_K=16, BLOCK_D=16), num_warps=4)]
    if tensor_core:
        # (128, 128, 32, 4, 3): the best of 48 swept on an H200 for tf32 at D, K = 128, 1024 and 256, 4096
        shapes = [(128, 128, 32, 4, 3), (128, 128, 32, 8, 3), (128, 64, 32, 4, 3), (64, 128, 32, 4, 3),
                  (128, 128, 64, 8, 3)]
    else:
        shapes = [(64, 64, 16, 4, 2), (128, 64, 16, 8, 2), (64, 128, 16, 8, 2), (32, 64, 32, 4, 2)]
    return [triton.Config(dict(BLOCK_B=b, BLOCK_K=k, BLOCK_D=d), num_warps=w, num_stages=s) for b, k, d, w, s in shapes]


@triton.jit
def _nearest_code_fwd_kernel(
    x_ptr,  # [B, D], strides (stride_xb, 1)
    c_ptr,  # [K, D], strides (stride_ck, 1)
    cc_ptr,  # [K] fp32: ||c_k||^2
    codes_ptr,  # [B] int64 out
    dist_ptr,  # [B] fp32 out
    B,
    K,
    D,
    stride_xb,
    stride_ck,
    COSINE: tl.constexpr,
    PRECISION: tl.constexpr,  # "tf32x3" | "ieee" | "tf32" for fp32 inputs; None: native 16-bit dot
    OFF64: tl.constexpr,  # K * stride_ck >= 2^31: codebook offsets in int64
    DOT_DTYPE: tl.constexpr,
    BLOCK_B: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    o_b = tl.program_id(0).to(tl.int64) * BLOCK_B + tl.arange(0, BLOCK_B)
    m_b = o_b < B
    b_best = tl.full([BLOCK_B], float("inf"), dtype=tl.float32)
    b_arg = tl.zeros([BLOCK_B], dtype=tl.int64)
    b_xx = tl.zeros([BLOCK_B], dtype=tl.float32)
    for i_d in range(0, D, BLOCK_D):
        o_d = i_d + tl.arange(0, BLOCK_D)
        b_x = tl.load(x_ptr + o_b[:, None] * stride_xb + o_d[None, :], mask=m_b[:, None] & (o_d < D)[None, :],
                      other=0).to(DOT_DTYPE).to(tl.float32)  # [BLOCK_B, BLOCK_D]
        b_xx += tl.sum(b_x * b_x, axis=1)
    # NaN rule (reference.nearest_code: torch.argmin ranks a NaN score first). A NaN score comes from a
    # NaN in the row (its norm is NaN) or in a code (its norm is NaN), so it is settled from the norms:
    # a per-element test in the score tiles cost the bf16 / tf32 search 15-25% on an H200, and a
    # reduction over the codes' norms before the tiles (a serial step per program) 6-13%.
    b_nan = tl.full([BLOCK_K], K, dtype=tl.int32)  # per lane, the lowest code seen whose norm is NaN
    for i_k in range(0, K, BLOCK_K):
        o_k = i_k + tl.arange(0, BLOCK_K)
        m_k = o_k < K
        if OFF64:  # K * stride_ck may pass 2^31
            p_c = c_ptr + o_k.to(tl.int64)[:, None] * stride_ck
        else:
            p_c = c_ptr + o_k[:, None] * stride_ck
        b_dot = tl.zeros([BLOCK_B, BLOCK_K], dtype=tl.float32)
        for i_d in range(0, D, BLOCK_D):
            o_d = i_d + tl.arange(0, BLOCK_D)
            m_d = o_d < D
            b_x = tl.load(x_ptr + o_b[:, None] * stride_xb + o_d[None, :], mask=m_b[:, None] & m_d[None, :],
                          other=0).to(DOT_DTYPE)  # [BLOCK_B, BLOCK_D]
            b_c = tl.load(p_c + o_d[None, :], mask=m_k[:, None] & m_d[None, :],
                          other=0).to(DOT_DTYPE)  # [BLOCK_K, BLOCK_D]
            b_dot = tl.dot(b_x, tl.trans(b_c), b_dot, input_precision=PRECISION)
        b_cc = tl.load(cc_ptr + o_k, mask=m_k, other=1.0)  # [BLOCK_K]
        b_nan = tl.minimum(b_nan, tl.where(b_cc != b_cc, o_k, K))
        if COSINE:
            b_score = -b_dot / tl.sqrt(tl.maximum(b_cc, 1e-24))[None, :]
        else:
            b_score = b_cc[None, :] - 2.0 * b_dot
        b_score = tl.where(m_k[None, :], b_score, float("inf"))  # [BLOCK_B, BLOCK_K]
        b_tmin = tl.min(b_score, axis=1)
        b_targ = tl.argmin(b_score, axis=1).to(tl.int64) + i_k
        m_upd = b_tmin < b_best  # strict: an earlier tile keeps ties (lowest index)
        b_best = tl.where(m_upd, b_tmin, b_best)
        b_arg = tl.where(m_upd, b_targ, b_arg)
    if COSINE:
        b_dist = 2.0 + 2.0 * b_best / tl.maximum(tl.sqrt(b_xx), 1e-12)
    else:
        b_dist = b_xx + b_best
    # a squared distance: rounding can take it just below 0, and its square root would be NaN
    b_dist = tl.where(b_dist < 0.0, 0.0, b_dist)  # not tl.maximum: on a GPU it turns NaN into 0
    first_nan = tl.min(b_nan, axis=0)
    m_xnan = b_xx != b_xx
    b_arg = tl.where(m_xnan, 0, tl.where(first_nan < K, first_nan, b_arg))
    b_dist = tl.where(m_xnan | (first_nan < K), float("nan"), b_dist)
    tl.store(codes_ptr + o_b, b_arg, mask=m_b)
    tl.store(dist_ptr + o_b, b_dist, mask=m_b)


_KEY = ["K", "D", "COSINE", "PRECISION", "OFF64", "DOT_DTYPE"]
_nearest_code_tc = triton.autotune(configs=_search_configs(True), key=_KEY)(_nearest_code_fwd_kernel)
_nearest_code_fma = triton.autotune(configs=_search_configs(False), key=_KEY)(_nearest_code_fwd_kernel)

_DOT_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


def nearest_code(x, codebook, cosine, precision, deterministic=False):
    """(codes [B] int64, dist [B] fp32). ``precision``: "exact" (3xTF32) | "ieee" | "fast" (TF32).
    ``deterministic``: the first of the autotuner's configurations, always (its pick may differ from
    process to process, and with it the order of the dot products' sums)."""
    B, D = x.shape
    K = codebook.shape[0]
    dev = x.device
    x = x if x.stride(-1) == 1 else x.contiguous()
    codebook = codebook if codebook.stride(-1) == 1 else codebook.contiguous()
    codes = torch.empty(B, device=dev, dtype=torch.int64)
    dist = torch.empty(B, device=dev, dtype=torch.float32)
    if B == 0:
        return codes, dist
    cc = torch.empty(K, device=dev, dtype=torch.float32)
    launch(_row_sqnorm_kernel, (cdiv(K, _NORM_BLOCK),), (codebook, cc, K, D, codebook.stride(0)),
           dict(BLOCK_K=_NORM_BLOCK, BLOCK_D=_block_d(D, _NORM_BLOCK_D)), _NORM_WARPS)
    dot_dtype = torch.promote_types(x.dtype, codebook.dtype)
    if dot_dtype == torch.float32:
        prec = {"exact": "tf32x3", "ieee": "ieee", "fast": "tf32"}[precision]
    else:
        prec = None  # 16-bit dots: products are exact in fp32 and sums are fp32
    kernel = _nearest_code_fma if prec == "ieee" else _nearest_code_tc
    off64 = K * codebook.stride(0) >= _OFF64_FROM
    args = (x, codebook, cc, codes, dist, B, K, D, x.stride(0), codebook.stride(0))
    meta = dict(COSINE=bool(cosine), PRECISION=prec, OFF64=off64, DOT_DTYPE=_DOT_DTYPES[dot_dtype])
    if deterministic:
        cfg = kernel.configs[0]
        launch(kernel.fn, (cdiv(B, cfg.kwargs["BLOCK_B"]),), args, {**meta, **cfg.kwargs}, cfg.num_warps,
               cfg.num_stages)
    else:
        launch_tuned(kernel, lambda meta: (cdiv(B, meta["BLOCK_B"]),), args, meta,
                     (kernel, K, D, bool(cosine), prec, off64, x.dtype, codebook.dtype, x.device))
    return codes, dist


# --- straight-through quantisation with the commitment loss -----------------------------------------------


@triton.jit
def _vq_quantize_kernel(
    x_ptr,  # [B, D] contiguous
    codes_ptr,  # [B] int64 (FWD)
    cb_ptr,  # [K, D] contiguous (FWD)
    out_ptr,  # [B, D] x dtype: codebook[codes], written (FWD) or read back (BWD)
    loss_ptr,  # [B] ACC (FWD): sum_d (x - out)^2
    gout_ptr,  # [B, D] incoming gradient of out (BWD)
    gloss_ptr,  # [] incoming gradient of the loss (BWD)
    gx_ptr,  # [B, D] x dtype (BWD): gout + scale * gloss * (x - out)
    B,
    K,
    D,
    scale,
    FWD: tl.constexpr,
    ACC: tl.constexpr,
    BLOCK_B: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    o_b = tl.program_id(0).to(tl.int64) * BLOCK_B + tl.arange(0, BLOCK_B)
    m_b = o_b < B
    if FWD:
        b_code = tl.load(codes_ptr + o_b, mask=m_b, other=0)  # [BLOCK_B]
        # a code outside [0, K) (index checks off) is never dereferenced: its row of out is NaN
        m_ok = (b_code >= 0) & (b_code < K)
    b_loss = tl.zeros([BLOCK_B], dtype=ACC)
    if not FWD:
        b_gl = tl.load(gloss_ptr).to(ACC) * scale
    for i_d in range(0, D, BLOCK_D):
        o_d = i_d + tl.arange(0, BLOCK_D)
        m = m_b[:, None] & (o_d < D)[None, :]
        o_bd = o_b[:, None] * D + o_d[None, :]  # [BLOCK_B, BLOCK_D]
        if FWD:
            b_q = tl.load(cb_ptr + b_code[:, None] * D + o_d[None, :], mask=m & m_ok[:, None], other=0)
            # rounded to out's dtype first: the loss is that of the out the backward sees
            b_q = tl.where(m_ok[:, None], b_q.to(out_ptr.dtype.element_ty).to(ACC), float("nan"))
        else:
            b_q = tl.load(out_ptr + o_bd, mask=m, other=0).to(ACC)
        b_diff = tl.load(x_ptr + o_bd, mask=m, other=0).to(ACC) - b_q
        if FWD:
            tl.store(out_ptr + o_bd, b_q.to(out_ptr.dtype.element_ty), mask=m)
            b_loss += tl.sum(b_diff * b_diff, axis=1)
        else:
            b_g = b_diff * b_gl + tl.load(gout_ptr + o_bd, mask=m, other=0).to(ACC)
            tl.store(gx_ptr + o_bd, b_g.to(gx_ptr.dtype.element_ty), mask=m)
    if FWD:
        tl.store(loss_ptr + o_b, b_loss, mask=m_b)






def quantize_fwd(x, codes, codebook, beta):
    """(out [B, D] = codebook[codes] in x's dtype, loss [] = beta * mean((x - out)^2) in ACC).
    An unchecked code outside [0, K) makes its row of out, and the loss, NaN."""
    B, D = x.shape
    K = codebook.shape[0]
    check_index_range("codes", codes, K)
    acc = acc_dtype(x, codebook)
    out = torch.empty(B, D, device=x.device, dtype=x.dtype)
    rows = torch.empty(B, device=x.device, dtype=acc)
    if B and D:
        launch(_vq_quantize_kernel, (cdiv(B, _Q_BLOCK_B),),
               (x.contiguous(), codes.contiguous(), codebook.contiguous(), out, rows, None, None, None, B, K, D, 1.0),
               dict(FWD=True, ACC=tl_dtype(acc), BLOCK_B=_Q_BLOCK_B, BLOCK_D=_block_d(D, _Q_BLOCK_D)), _Q_WARPS)
    else:
        out.zero_()
        rows.zero_()
    return out, rows.sum() * (beta / max(B * D, 1))


def quantize_bwd(grad_out, grad_loss, x, q, beta):
    """grad_x = grad_out + grad_loss * 2 beta / (B D) * (x - q), q the forward's output (the codebook
    may have been updated in place since). Autograd hands both gradients as tensors (zeros for an
    unused output)."""
    B, D = x.shape
    gx = torch.empty_like(x, memory_format=torch.contiguous_format)
    scale = 2.0 * beta / max(B * D, 1)
    if torch.float64 in (x.dtype, q.dtype):  # a Python float reaches a kernel as fp32: fold it on the host
        grad_loss, scale = grad_loss.to(torch.float64) * scale, 1.0
    if B and D:
        launch(_vq_quantize_kernel, (cdiv(B, _Q_BLOCK_B),),
               (x.contiguous(), None, None, q.contiguous(), None, grad_out.contiguous(), grad_loss.contiguous(), gx,
                B, 0, D, scale),
               dict(FWD=False, ACC=tl_dtype(acc_dtype(x, q)), BLOCK_B=_Q_BLOCK_B, BLOCK_D=_block_d(D, _Q_BLOCK_D)), _Q_WARPS)
    else:
        gx.zero_()
    return gx
