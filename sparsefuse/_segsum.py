"""Deterministic segmented sums of gathered rows that stay fast when a few segments hold most entries.

Several backward passes sum rows by key over entries sorted by key: the SAE weight gradient (rows of
the residual by feature), the deterministic VQ statistics (rows of x by code). One program per key
walks its segment in order, so every output row is written once, in a fixed order, with no atomics.
That program is also the whole critical path when one key owns a large share of the entries: a
dense SAE latent that fires on every row, a collapsed codebook. Its loads form a dependent chain
(sorted position -> entry id -> row), about 0.5 us per entry on an H100, so a latent used by all
4096 rows of a batch cost 2 ms where the whole step takes 1 ms (``scripts/probe_skew.py``).

The fix splits long segments at fixed positions. Sorted positions are cut into chunks of ``CHUNK``
entries (a power of two fixed by the caller from the shapes, never by the data):

* ``_segment_chunks_kernel`` (grid: chunks x D tiles x levels) sums each chunk whose entries all
  share one key into ``part[chunk]`` (other chunks exit after two loads). It gathers E rows per
  step (a [E, BLOCK_D] tile of at most 4096 elements, E from 4 to 32), so those loads overlap. (The
  per-key walk keeps one [BLOCK_D] row a step: most segments are a few entries long, and a 2-D
  tile there made every program pay for it; here only crowded chunks do work.)
* ``segment_sum`` (a device function the per-key kernels call) walks the entries of its segment
  before the first whole chunk, adds the partial sums of the whole chunks, then the entries after
  the last one. A segment shorter than a chunk takes the plain walk, as before.

Every key's sum is taken in an order fixed by the sorted keys and the shapes (CHUNK, and E from the
tile width), so results are bit-identical run to run. Partial sums cost ``cdiv(M, CHUNK) x D``
accumulator floats for M entries (:func:`chunk_size` keeps that count at most half the rows
buffer's element count).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._dtypes import tl_dtype
from ._launch import cdiv, launch, next_pow2

#: Smallest chunk (entries), a power of two. Tests lower it to reach the split paths with tiny inputs.
MIN_CHUNK = 64
GATHER_STEP = 4  # partial sums loaded per step of segment_sum
_TILE = 4096  # elements of the chunk kernel's [E, BLOCK_D] gather tile (E from 4 to 32 rows)
_WARPS = 2


def chunk_size(entries: int, rows: int) -> int:
    """Chunk length (a power of two) for ``entries`` sorted entries gathering from ``rows`` rows: at
    least twice the entries per row (so there are at most half as many partial sums as rows) and at
    least MIN_CHUNK."""
    return max(MIN_CHUNK, next_pow2(max(2 * cdiv(entries, max(rows, 1)), 1)))


@triton.jit
def _entry_row(order_ptr, w_ptr, rows_ptr, i_e, row_div, o_d, m_d, D, WEIGHTED: tl.constexpr, ACC: tl.constexpr):
    """(w * row [BLOCK_D], w) of sorted entry ``i_e``: entry id order[i_e], its row id // row_div."""
    i_ent = tl.load(order_ptr + i_e)
    b_x = tl.load(rows_ptr + (i_ent // row_div) * D + o_d, mask=m_d, other=0).to(ACC)
    b_w = tl.full([], 1.0, ACC)
    if WEIGHTED:
        b_w = tl.load(w_ptr + i_ent).to(ACC)
        b_x *= b_w
    return b_x, b_w


@triton.jit
def segment_sum(i_start, i_end, order_ptr, w_ptr, rows_ptr, part_ptr, wpart_ptr, row_div, o_d, m_d, D,
                CHUNK, WEIGHTED: tl.constexpr, HAS_WSUM: tl.constexpr, ACC: tl.constexpr, BLOCK_D: tl.constexpr,
                E: tl.constexpr):
    """Sum over sorted entries i_start .. i_end - 1 of w[ent] * rows[ent // row_div, o_d] (w = 1
    unless WEIGHTED), and of w when HAS_WSUM (which requires WEIGHTED: unweighted, the sum of w is the
    count i_end - i_start). Whole chunks come from ``part`` / ``wpart``, written by
    ``_segment_chunks_kernel``. Pointers are already offset to the level."""
    tl.static_assert(WEIGHTED or not HAS_WSUM, "HAS_WSUM needs WEIGHTED (an unweighted sum of w is the count)")
    c_lo = (i_start + CHUNK - 1) // CHUNK
    c_hi = i_end // CHUNK
    full = c_hi > c_lo  # the segment holds at least one whole chunk
    head_end = tl.where(full, c_lo * CHUNK, i_end)
    tail_start = tl.where(full, c_hi * CHUNK, i_end)
    b_acc = tl.zeros([BLOCK_D], dtype=ACC)
    b_wsum = tl.zeros([1], dtype=ACC)
    for i_e in range(i_start, head_end):
        b_x, b_w = _entry_row(order_ptr, w_ptr, rows_ptr, i_e, row_div, o_d, m_d, D, WEIGHTED, ACC)
        b_acc += b_x
        if HAS_WSUM:
            b_wsum += b_w
    for i_c in range(c_lo, c_hi, E):
        # E loads in flight a step; [BLOCK_D] rows in b_acc's own layout (a 2-D [E, BLOCK_D] tile would
        # convert layouts through shared memory in every program, 16% of the bf16 TopK weight gradient)
        for j in tl.static_range(E):
            m_c = i_c + j < c_hi
            b_acc += tl.load(part_ptr + (i_c + j) * D + o_d, mask=m_d & m_c, other=0)
            if HAS_WSUM:
                b_wsum += tl.load(wpart_ptr + i_c + j, mask=m_c, other=0)
    for i_e in range(tail_start, i_end):
        b_x, b_w = _entry_row(order_ptr, w_ptr, rows_ptr, i_e, row_div, o_d, m_d, D, WEIGHTED, ACC)
        b_acc += b_x
        if HAS_WSUM:
            b_wsum += b_w
    return b_acc, b_wsum


@triton.jit
def _segment_chunks_kernel(
    keys_ptr,  # [L, M] sorted keys of each level
    order_ptr,  # [L, M] int64 entry ids in that order
    w_ptr,  # [L, M] entry weights, indexed by entry id (WEIGHTED)
    rows_ptr,  # [L, R, D] rows; entry ent gathers row ent // row_div of its level
    part_ptr,  # [L, NC, D] ACC out: sums of the chunks that hold a single key (others untouched)
    wpart_ptr,  # [L, NC] ACC out: their sums of w (HAS_WSUM)
    M,
    R,
    D,
    NC,
    row_div,
    NKEYS,
    CHUNK: tl.constexpr,
    WEIGHTED: tl.constexpr,
    HAS_WSUM: tl.constexpr,
    ACC: tl.constexpr,
    BLOCK_D: tl.constexpr,
    E: tl.constexpr,
):
    tl.static_assert(WEIGHTED or not HAS_WSUM, "HAS_WSUM needs WEIGHTED")
    i_c = tl.program_id(0).to(tl.int64)
    i_l = tl.program_id(2).to(tl.int64)
    i_lo = i_c * CHUNK
    if i_lo + CHUNK > M:
        return
    keys_ptr += i_l * M
    key = tl.load(keys_ptr + i_lo)
    if (key != tl.load(keys_ptr + i_lo + CHUNK - 1)) | (key < 0) | (key >= NKEYS):
        return  # several keys, or one that owns no segment (entries left out of every sum)
    order_ptr += i_l * M
    rows_ptr += i_l * R * D
    o_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    m_d = o_d < D
    b_acc = tl.zeros([BLOCK_D], dtype=ACC)
    b_wsum = tl.zeros([E], dtype=ACC)
    for i_e in range(0, CHUNK, E):
        b_ent = tl.load(order_ptr + i_lo + i_e + tl.arange(0, E))  # [E]
        b_x = tl.load(rows_ptr + (b_ent // row_div)[:, None] * D + o_d[None, :], mask=m_d[None, :], other=0).to(ACC)
        if WEIGHTED:
            b_w = tl.load(w_ptr + i_l * M + b_ent).to(ACC)
            b_x *= b_w[:, None]
            b_wsum += b_w
        b_acc += tl.sum(b_x, axis=0)
    tl.store(part_ptr + (i_l * NC + i_c) * D + o_d, b_acc, mask=m_d)
    if HAS_WSUM:
        tl.store(wpart_ptr + i_l * NC + i_c + tl.arange(0, 1), tl.sum(b_wsum, axis=0)[None],
                 mask=tl.program_id(1) == 0)


def chunk_partials(sorted_keys, order, weights, rows, row_div, chunk, acc, block_d, want_wsum, nkeys):
    """Launch ``_segment_chunks_kernel``: (part [L, NC, D], wpart [L, NC] or None), NC = cdiv(M, chunk).

    ``sorted_keys`` / ``order`` are [M] or [L, M]; ``rows`` is [R, D] or [L, R, D] (contiguous);
    ``weights`` is None or indexed by entry id (contiguous, M per level); ``acc`` a torch dtype.
    Keys outside [0, nkeys) own no segment: their chunks are not summed."""
    M = sorted_keys.shape[-1]
    L = sorted_keys.shape[0] if sorted_keys.dim() == 2 else 1
    R, D = rows.shape[-2], rows.shape[-1]
    NC = cdiv(M, chunk)
    part = torch.empty(L, NC, D, device=rows.device, dtype=acc)
    wpart = torch.empty(L, NC, device=rows.device, dtype=acc) if want_wsum else None
    if NC:  # D = 0 still needs the weight sums
        e = min(chunk, max(4, min(32, _TILE // block_d)))
        launch(_segment_chunks_kernel, (NC, max(cdiv(D, block_d), 1), L),
               (sorted_keys, order, weights, rows, part, wpart, M, R, D, NC, row_div, nkeys),
               dict(CHUNK=chunk, WEIGHTED=weights is not None, HAS_WSUM=want_wsum,
                    ACC=tl_dtype(acc), BLOCK_D=block_d, E=e), _WARPS)
    return part, wpart
