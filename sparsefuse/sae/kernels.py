"""Triton kernels for the SAE decoder ops, and the launchers that check, allocate and launch them.

Notation: B rows, K active latents per row, F dictionary size, D model width. ``ACC`` is the
accumulation dtype (float32, or float64 for float64 inputs).

Data flow of the two losses (see ``ops.py`` for how autograd strings them together):

* TopK: one gather pass (``_sae_decode_fwd_kernel`` with ``IS_LOSS``) reads each active decoder row
  once and produces the loss, the residual r = recon - target [B, D] and gv[b, k] = <r_b, w_idx>
  (on a (row, column group) grid whose programs in flight share one slice of the decoder in L2,
  each group writing its own part of gv; see ``_decode_config`` and ``topk_gv_parts``). The
  backward's ``_grads_finish_kernel`` sums the parts into grad_vals, scales the bias gradient and
  writes the sort keys of the weight gradient. The backward never touches the decoder again: the
  weight gradient is a segmented sum of residual rows (``_sae_weight_grad_kernel``) over entries
  sorted by feature. The residual is B*D floats, so those reads hit L2, and every gradient row is
  written exactly once: no atomics, no zero-fill, deterministic.
* Hierarchical: the gradient of row (b, j) is c * v_j * E_j with E_j = sum_{k>=j} e_k, the suffix
  sum of the prefix errors: a different vector for every (b, j), so it cannot be rebuilt from
  O(B*D) data and must be scattered. The forward sweeps the latents once and saves E_0 [B, D]; the
  backward sweeps them again from E_0, producing gv and scattering g * c * v_j * E_j with fp32
  atomics. Both run one program per (rows, D tile) with the D tile as the slow grid axis, so the
  programs in flight share one F x BLOCK_D slice of the decoder and of its gradient, and the
  gathers and atomics hit L2 (the whole F x D gradient is far larger than L2). Deterministic mode
  stages the B*K rows and reuses the segmented sum instead. So do bf16 weights when their B*K rows
  fit in the bytes of the F x D fp32 buffer (B*K <= 2F), staged in bf16; otherwise a 16-bit weight's
  gradient is accumulated in that fp32 buffer and converted at the end (``hierarchical_plan``).
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from .._dtypes import acc_dtype, tl_dtype
from .._launch import cdiv, launch, next_pow2
from .._registry import INTERPRET
from .._segsum import GATHER_STEP, chunk_partials, chunk_size, segment_sum
from .._validate import check_index_range
from .reference import shifted

# Launch heuristics, in one place (H200 sweeps: scripts/tune_sae.py, numbers in benchmarks/NOTES.md).
# A gather tile holds BLOCK_K x BLOCK_D <= _GATHER_TILE elements in registers (BLOCK_D stops at 16, so
# K > 512 goes over); the row dot products (_gather_config) take two warps a row, best at every K.
_GATHER_TILE = 8192
_ROW_DOT_WARPS = 2
# Rows of many latents. The row dot products (_sae_row_dot_kernel) take blocks of at most
# _MAX_BLOCK_K latents, one program per (row, block). The decode gather keeps all K latents of a row
# in one tile up to _DECODE_TILE_MAX_K, where the tile spills but the fused TopK loss still reads
# each decoder row once; past it the decode sums blocks of _MAX_BLOCK_K latents in launches of their
# own (_decode_blocks) and the loss takes gv from the row dots. One tile for every latent had asked
# for 64 warps at K > 8192 (the launch failed) and compiled for 38 s at K = 8192. Full fp32 steps on
# one H200 (scripts/probe_many_latents.py, B = 512, F = 65536, D = 2304, ms at K = 1024 / 2048 /
# 4096, one tile against blocks): TopK 1.96 / 3.94 / 49.1 against 3.30 / 6.43 / 12.4; decode 3.24 /
# 6.80 / 18.3 against 3.28 / 6.42 / 12.4; sparse_linear 2.08 / 3.80 / 13.5 against 2.07 / 3.82 / 7.04.
_MAX_BLOCK_K = 512
_DECODE_TILE_MAX_K = 2048
_SEG_BLOCK_D, _SEG_WARPS = (128, 4) if INTERPRET else (512, 2)
# Elementwise passes: one row of D per program (unit rows), a flat block per program (the rest).
_UNIT_ROWS_MAX_D, _UNIT_ROWS_WARPS = 1024, 4
_FINISH_BLOCK, _FINISH_WARPS = 1024, 4
_KEYS_BLOCK, _KEYS_WARPS = 1024, 4
_SCALE_CAST_BLOCK, _SCALE_CAST_WARPS = (1024 if INTERPRET else 4096), 8
# Row top-k (_row_topk_kernel): one program per row holds at most _TOPK_MAX_BLOCKS block maxima and
# _TOPK_MAX_CANDIDATES entries of the chosen blocks, and reads the row _TOPK_STEP entries a step; 4
# warps, 8 from _TOPK_WIDE keys held at once (_row_topk_warps; H200 sweep, scripts/probe_row_topk.py,
# session 40: at F = 65536, K = 64 / 128 / 256, fp32, 0.60 / 1.24 / 1.45 ms with 4 warps, 0.68 / 0.78 /
# 0.71 with 8). Steps of 2048-16384 entries were within 5% of 4096 (session 41).
_TOPK_MAX_BLOCKS = 4096
_TOPK_MAX_CANDIDATES = 8192
_TOPK_STEP = 4096
_TOPK_WIDE = 4096
_TOPK_MAX_K = 512  # measured up to here (1.66 against torch.topk's 2.06 ms in bf16 at F = 65536)


def _gather_config(K: int, D: int, itemsize: int) -> dict:
    """BLOCK_K covers the K latents of a row, up to _MAX_BLOCK_K (more take several programs);
    BLOCK_D fills the rest of the register tile."""
    block_k = min(next_pow2(K), _MAX_BLOCK_K)
    cap = 128 if itemsize <= 2 else 256
    block_d = max(16, min(next_pow2(max(D, 1)), cap, _GATHER_TILE // block_k))
    return dict(BLOCK_K=block_k, BLOCK_D=block_d, num_warps=_ROW_DOT_WARPS)


def _decode_config(K: int, D: int, itemsize: int, loss: bool) -> dict:
    """The gather of ``_sae_decode_fwd_kernel``: BLOCK_K covers all K latents; tiles of 32 columns
    (fewer for K > 256, keeping the tile within _GATHER_TILE up to K = 512) on a (row, column group)
    grid, so the gathers hit L2. The loss groups GROUP * BLOCK_D >= max(K, 128) columns per program,
    which keeps its per-group gv parts (P * B * K floats, P = cdiv(D, GROUP * BLOCK_D)) within
    B * (D + K) at any K.

    Full TopK steps on one H200 run (F = 65536, D = 2304, B = 4096, ms at K = 32 / 64 / 128,
    ``scripts/tune_sae.py``, ``benchmarks/logs/tune_sae_session10_run3.json``): fp32 0.741 / 0.867 /
    1.501 with 32 columns against 0.705 / 0.939 / 1.601 a row a program (as before session 10) and
    0.746 / 0.921 / 1.652 with 64; bf16 0.740 / 0.856 / 1.294 against 0.745 / 0.883 / 1.366 a row a
    program and 0.738 / 0.907 / 1.440 with 64. K = 32 is host-bound.

    At least 128 columns a program for the loss (session 11; GPU time of a step, K = 32 / 64,
    ``scripts/probe_topk_host.py``, ``benchmarks/logs/probe_topk_host_session11.json``): fp32
    0.588 / 0.846 ms against 0.632 / 0.861 with K columns, bf16 0.517 / 0.724 against 0.560 / 0.743;
    256 columns no better. Fewer, longer programs load each row's K ids and values fewer times.

    ``itemsize`` is not read by this heuristic (32 columns won in both widths); it stays in the
    signature for the variants ``scripts/tune_sae.py`` swaps in, which size tiles in bytes."""
    block_k = next_pow2(K)
    block_d = max(16, min(next_pow2(max(D, 1)), 32, _GATHER_TILE // block_k))
    group = cdiv(max(block_k, 128), block_d) if loss else 1
    return dict(BLOCK_K=block_k, BLOCK_D=block_d, GROUP=group, num_warps=max(1, min(8, block_k * block_d // 4096)))


def _decode_launch(D: int, cfg: dict) -> tuple:
    """(column groups P, columns per program, launch meta) of a ``_decode_config``."""
    meta = dict(cfg)
    cols = meta.pop("GROUP") * meta["BLOCK_D"]
    return cdiv(D, cols), cols, meta


# Hierarchical sweeps (H200; scripts/tune_hier.py, scripts/probe_hier_chunk.py, numbers in
# benchmarks/NOTES.md): one warp per program. The forward covers two fp32 rows or one 16-bit row of
# 128 columns, one latent a step. The backward covers one row of 64 columns, 8 latents a step (their
# rows gathered together: full steps 5-15% faster than one at a time); VEC caps a thread's column
# vector so the chunk stays in few lanes (16-bit tiles would otherwise spread it over four). Wider
# tiles, more rows or more warps per program were slower.
_HIER_FWD = {4: dict(BLOCK_B=2, BLOCK_D=64), 2: dict(BLOCK_B=1, BLOCK_D=128)}
_HIER_BWD = {4: dict(BLOCK_D=64, CHUNK=8, VEC=4), 2: dict(BLOCK_D=64, CHUNK=8, VEC=2)}
# The fp32 atomic backward on an H100 (scripts/ab_hier_narrow.py, session 25): 32 columns took whole
# steps 6.5-10% under 64 columns from B * K = 2^18 entries (B = 4096 with K = 64 or 128, B = 2048 with
# K = 128, F = 131072 with D = 4096) and 2-2.5% over them below (K = 32, or B = 1024). The programs in
# flight share the F x BLOCK_D slices of the decoder and of its gradient in L2; narrower slices miss
# less, and the H100's HBM (3.35 TB/s) makes a miss cost more than the H200's (4.8 TB/s), where 64
# columns stay best at the benchmark shape (1-5%; session 22). Only this path: its atomics already
# sum in no fixed order, while the deterministic and staged paths keep one width, so their bits do
# not depend on the GPU model.
_NARROW_ATOMIC_BWD = ("H100",)
_NARROW_MIN_ENTRIES = 1 << 18
_narrow_by_device: dict = {}


def _narrow_atomic_bwd(device: torch.device) -> bool:
    """Whether the fp32 atomic hierarchical backward takes 32-column tiles on ``device``."""
    if device.type != "cuda":
        return False
    idx = device.index if device.index is not None else torch.cuda.current_device()
    hit = _narrow_by_device.get(idx)
    if hit is None:
        name = torch.cuda.get_device_name(idx)
        hit = _narrow_by_device[idx] = any(part in name for part in _NARROW_ATOMIC_BWD)
    return hit


def _hier_config(D: int, itemsize: int, backward: bool) -> dict:
    """Launch configuration of the hierarchical sweeps for a weight of ``itemsize`` bytes (float64
    takes float32's); BLOCK_D shrinks to cover a narrow D."""
    table = _HIER_BWD if backward else _HIER_FWD
    cfg = dict(table.get(itemsize, table[4]), num_warps=1)
    cfg["BLOCK_D"] = min(cfg["BLOCK_D"], max(16, next_pow2(max(D, 1))))
    return cfg




@triton.jit
def _load_row_latents(idx_ptr, vals_ptr, i_b, K, F, ACC: tl.constexpr, BLOCK_K: tl.constexpr):
    """Indices and values of row ``i_b``; an out-of-range index gets value NaN (never dereferenced)."""
    o_k = tl.arange(0, BLOCK_K)
    m_k = o_k < K
    b_idx = tl.load(idx_ptr + i_b * K + o_k, mask=m_k, other=0).to(tl.int64)  # [BLOCK_K]
    m_ok = m_k & (b_idx >= 0) & (b_idx < F)
    b_v = tl.load(vals_ptr + i_b * K + o_k, mask=m_k, other=0).to(ACC)  # [BLOCK_K]
    b_v = tl.where(m_ok | ~m_k, b_v, float("nan"))
    return o_k, m_k, m_ok, b_idx, b_v


@triton.jit
def _sae_decode_fwd_kernel(
    idx_ptr,  # [B, K] int32 | int64
    vals_ptr,  # [B, K]
    w_ptr,  # [F, D], strides (stride_wf, stride_wd)
    bias_ptr,  # [D] (HAS_BIAS)
    tgt_ptr,  # [B, D] (IS_LOSS)
    out_ptr,  # [B, D]: recon in the output dtype, or the ACC residual recon - target (IS_LOSS)
    gv_ptr,  # [P, B, K] ACC: column group p's part of <resid_b, w_idx[b, k]> (IS_LOSS)
    loss_ptr,  # [P, B] ACC: column group p's part of sum_d resid[b, d]^2 / numel (IS_LOSS)
    numel,  # B * D: the loss is a mean (IS_LOSS; an integer, so float64 gets an exact divisor)
    B,
    K,
    D,
    F,
    stride_wf,
    stride_wd,
    cols,  # columns per program (a multiple of BLOCK_D): program (b, g) covers columns g * cols ..
    HAS_BIAS: tl.constexpr,
    IS_LOSS: tl.constexpr,
    ACC: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """One program per (row, group of ``cols`` columns), the row on the fast grid axis: the programs
    in flight gather from one F x cols slice of the decoder, which L2 holds, so each decoder element
    comes from DRAM about once however many rows use it. Each tile holds the columns of all K
    latents [BLOCK_K, BLOCK_D]: the residual tile and its dot products with the same rows come out
    of one load. See ``_decode_config``."""
    i_b = tl.program_id(0).to(tl.int64)
    i_g = tl.program_id(1)
    o_k, m_k, m_ok, b_idx, b_v = _load_row_latents(idx_ptr, vals_ptr, i_b, K, F, ACC, BLOCK_K)
    p_rows = w_ptr + b_idx * stride_wf  # [BLOCK_K]
    b_gv = tl.zeros([BLOCK_K], dtype=ACC)
    b_loss = tl.zeros([BLOCK_D], dtype=ACC)
    d0 = i_g * cols
    # runtime loop bounds: a constexpr trip count (GROUP) made this loop 15% slower on an H200
    for i_d in range(d0, tl.minimum(d0 + cols, D), BLOCK_D):
        o_d = i_d + tl.arange(0, BLOCK_D)
        m_d = o_d < D
        m_w = m_ok[:, None] & m_d[None, :]
        b_w = tl.load(p_rows[:, None] + o_d[None, :].to(tl.int64) * stride_wd, mask=m_w, other=0).to(ACC)
        b_r = tl.sum(b_v[:, None] * b_w, axis=0)  # [BLOCK_D]
        if HAS_BIAS:
            b_r += tl.load(bias_ptr + o_d, mask=m_d, other=0).to(ACC)
        if IS_LOSS:
            b_r -= tl.load(tgt_ptr + i_b * D + o_d, mask=m_d, other=0).to(ACC)
            # columns past D hold 0 * v: NaN for an infinite v, which must not reach the sums
            b_r = tl.where(m_d, b_r, 0.0)
            b_loss += b_r * b_r
            b_gv += tl.sum(b_w * b_r[None, :], axis=1)
        tl.store(out_ptr + i_b * D + o_d, b_r.to(out_ptr.dtype.element_ty), mask=m_d)
    if IS_LOSS:
        tl.store(gv_ptr + (i_g * B + i_b) * K + o_k, b_gv, mask=m_k)
        tl.store(loss_ptr + i_g * B + i_b, tl.sum(b_loss, axis=0) / numel)


@triton.jit
def _sae_row_dot_kernel(
    idx_ptr,  # [B, K] int32 | int64
    w_ptr,  # [F, D], strides (stride_wf, stride_wd)
    rows_ptr,  # [B, D] contiguous
    fbias_ptr,  # [F] per-feature bias (HAS_BIAS)
    out_ptr,  # [B, K] out: <rows_b, w_idx[b, k]> (+ fbias[idx[b, k]]); NaN for an out-of-range index
    K,
    D,
    F,
    stride_wf,
    stride_wd,
    HAS_BIAS: tl.constexpr,
    ACC: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """The gather-dot shared by the decode's vals gradient and ``sparse_linear``'s forward: one program
    per (row, block of BLOCK_K latents)."""
    i_b = tl.program_id(0).to(tl.int64)
    o_k = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    m_k = o_k < K
    b_idx = tl.load(idx_ptr + i_b * K + o_k, mask=m_k, other=0).to(tl.int64)  # [BLOCK_K]
    m_ok = m_k & (b_idx >= 0) & (b_idx < F)
    p_rows = w_ptr + b_idx * stride_wf  # [BLOCK_K]
    b_out = tl.zeros([BLOCK_K], dtype=ACC)
    for i_d in range(0, D, BLOCK_D):
        o_d = i_d + tl.arange(0, BLOCK_D)
        m_d = o_d < D
        b_w = tl.load(p_rows[:, None] + o_d[None, :].to(tl.int64) * stride_wd, mask=m_ok[:, None] & m_d[None, :], other=0).to(ACC)
        b_x = tl.load(rows_ptr + i_b * D + o_d, mask=m_d, other=0).to(ACC)  # [BLOCK_D]
        b_out += tl.sum(b_w * b_x[None, :], axis=1)
    if HAS_BIAS:
        b_out += tl.load(fbias_ptr + b_idx, mask=m_ok, other=0).to(ACC)
    b_out = tl.where(m_ok, b_out, float("nan"))
    tl.store(out_ptr + i_b * K + o_k, b_out.to(out_ptr.dtype.element_ty), mask=m_k)


@triton.jit
def _hierarchical_offset(tgt_ptr, bias_ptr, o_b, o_d, m_bd, m_d, D, HAS_BIAS: tl.constexpr, ACC: tl.constexpr):
    """bias - target on a [BLOCK_B, BLOCK_D] tile: the prefix error before any latent is added."""
    b_off = -tl.load(tgt_ptr + o_b[:, None] * D + o_d[None, :], mask=m_bd, other=0).to(ACC)
    if HAS_BIAS:
        b_off += tl.load(bias_ptr + o_d, mask=m_d, other=0).to(ACC)[None, :]
    return b_off


@triton.jit
def _load_latent_rows(idx_ptr, vals_ptr, w_ptr, o_b, m_b, i_k, o_d, m_d, K, F, stride_wf, stride_wd,
                      ACC: tl.constexpr):
    """Latent k of rows o_b: (values [BLOCK_B], decoder tile [BLOCK_B, BLOCK_D]).
    An out-of-range id is never dereferenced; its value becomes NaN."""
    i_f = tl.load(idx_ptr + o_b * K + i_k, mask=m_b, other=0).to(tl.int64)  # [BLOCK_B]
    ok = (i_f >= 0) & (i_f < F)
    v = tl.where(ok, tl.load(vals_ptr + o_b * K + i_k, mask=m_b, other=0).to(ACC), float("nan"))
    m_w = (m_b & ok)[:, None] & m_d[None, :]
    b_w = tl.load(w_ptr + i_f[:, None] * stride_wf + o_d[None, :].to(tl.int64) * stride_wd, mask=m_w,
                  other=0).to(ACC)
    return v, b_w


@triton.jit
def _load_latent_chunk(idx_ptr, vals_ptr, w_ptr, i_b, o_k, m_k, o_d, m_d, K, F, stride_wf, stride_wd,
                       ACC: tl.constexpr):
    """Latents o_k of row i_b: (feature ids, valid ids, values [CHUNK], decoder tile [CHUNK, BLOCK_D]).
    An out-of-range id is never dereferenced; its value becomes NaN. Latents past K get value 0."""
    i_f = tl.load(idx_ptr + i_b * K + o_k, mask=m_k, other=0).to(tl.int64)  # [CHUNK]
    ok = (i_f >= 0) & (i_f < F)
    v = tl.where(ok, tl.load(vals_ptr + i_b * K + o_k, mask=m_k, other=0).to(ACC), float("nan"))
    b_w = tl.load(w_ptr + i_f[:, None] * stride_wf + o_d[None, :].to(tl.int64) * stride_wd,
                  mask=(m_k & ok)[:, None] & m_d[None, :], other=0).to(ACC)
    return i_f, ok, v, b_w


@triton.jit
def _hierarchical_loss_sweep(idx_ptr, vals_ptr, w_ptr, etot_ptr, loss_ptr, numel, b_off, i_t, o_b, m_b, o_d, m_d,
                             m_bd, B, K, D, F, stride_wf, stride_wd, ACC: tl.constexpr):
    """One sweep over the latents in order from the offset ``b_off`` (bias - target): the prefix
    errors e_k, their squares summed into this tile's loss partials (divided by ``numel``, so the
    loss is their plain sum) and their sum E_0 stored; returns E_0."""
    b_e = b_off
    b_tot = tl.zeros(b_off.shape, dtype=ACC)
    b_loss = tl.zeros(b_off.shape, dtype=ACC)
    for i_k in range(0, K):
        v, b_w = _load_latent_rows(idx_ptr, vals_ptr, w_ptr, o_b, m_b, i_k, o_d, m_d, K, F, stride_wf, stride_wd,
                                   ACC)
        b_e += v[:, None] * b_w
        b_loss += b_e * b_e
        b_tot += b_e
    tl.store(etot_ptr + o_b[:, None] * D + o_d[None, :], b_tot, mask=m_bd)
    tl.store(loss_ptr + i_t * B + o_b, tl.sum(tl.where(m_bd, b_loss, 0.0), axis=1) / numel, mask=m_b)
    return b_tot


@triton.jit
def _hierarchical_sae_fwd_kernel(
    idx_ptr,  # [B, K] int32 | int64
    vals_ptr,  # [B, K]
    w_ptr,  # [F, D], strides (stride_wf, stride_wd)
    bias_ptr,  # [D] (HAS_BIAS)
    tgt_ptr,  # [B, D]
    etot_ptr,  # [B, D] ACC out: E_0 = sum_k e_k
    loss_ptr,  # [cdiv(D, BLOCK_D), B] ACC out: sum over the tile's columns and all k of e_k^2 / numel
    numel,  # B * K * D: the loss is a mean (an integer, so float64 gets an exact divisor)
    B,
    K,
    D,
    F,
    stride_wf,
    stride_wd,
    HAS_BIAS: tl.constexpr,
    ACC: tl.constexpr,
    BLOCK_B: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """One program per (BLOCK_B rows, D tile); one sweep over the latents in order builds the prefix
    errors e_k = bias + sum_{j<=k} v_j w_j - target, their squares and their sum E_0.

    The D tile is the slow grid axis, so the programs resident at any moment read the same
    F x BLOCK_D slice of the decoder, which fits in L2: the B*K gathered rows come from L2, and each
    decoder element is read from HBM about once. A running recurrence keeps every thread on its own
    columns (a tl.cumsum over a [K, D] tile was 4x slower)."""
    i_t = tl.program_id(1)
    o_b = (tl.program_id(0) * BLOCK_B + tl.arange(0, BLOCK_B)).to(tl.int64)
    o_d = i_t * BLOCK_D + tl.arange(0, BLOCK_D)
    m_b, m_d = o_b < B, o_d < D
    m_bd = m_b[:, None] & m_d[None, :]
    b_off = _hierarchical_offset(tgt_ptr, bias_ptr, o_b, o_d, m_bd, m_d, D, HAS_BIAS, ACC)
    _hierarchical_loss_sweep(idx_ptr, vals_ptr, w_ptr, etot_ptr, loss_ptr, numel, b_off, i_t, o_b, m_b, o_d, m_d, m_bd,
                             B, K, D, F, stride_wf, stride_wd, ACC)


@triton.jit
def _hierarchical_sae_bwd_kernel(
    idx_ptr,  # [B, K] int32 | int64
    vals_ptr,  # [B, K]
    w_ptr,  # [F, D], strides (stride_wf, stride_wd)
    bias_ptr,  # [D] (HAS_BIAS)
    tgt_ptr,  # [B, D]
    etot_ptr,  # [B, D] ACC: E_0 from the forward (FUSED: out)
    g_ptr,  # [] g * c: the incoming gradient of the loss times c, in ACC (not FUSED)
    gw_ptr,  # WEIGHT_GRAD 1: [F, D] ACC, atomically accumulated; 2: [B * K, D] ACC staged rows;
    #          3: [B * K, DC] staged rows of this launch's column chunk, unscaled, in the weight's dtype
    gv_ptr,  # STAGED_GV: [cdiv(D, BLOCK_D), B, K] ACC per-tile partials; else [B, K] ACC zeroed, atomic
    loss_ptr,  # FUSED: [cdiv(D, BLOCK_D), B] ACC out, as in the forward kernel
    numel,  # FUSED: B * K * D, as in the forward kernel
    B,
    K,
    D,
    F,
    stride_wf,
    stride_wd,
    T0,  # first D tile of this launch (grid axis 1 counts from it)
    DC,  # WEIGHT_GRAD 3: columns per staged row (the chunk's width)
    HAS_BIAS: tl.constexpr,
    WEIGHT_GRAD: tl.constexpr,  # 0: none, 1: atomic scatter into [F, D], 2 and 3: staged rows
    STAGED_GV: tl.constexpr,
    FUSED: tl.constexpr,  # run the forward sweep first (etot_ptr, loss_ptr out) and leave g * c out
    ACC: tl.constexpr,
    BLOCK_D: tl.constexpr,
    CHUNK: tl.constexpr,  # latents per step
    VEC: tl.constexpr,  # widest column vector a thread takes (fewer lanes across the columns, more per chunk)
):
    """The gradient of the loss with respect to v_j w_j is g * c * E_j, E_j = sum_{k>=j} e_k. Starting
    from the saved E_0, a forward sweep walks E_j = E_{j-1} - e_{j-1} while rebuilding e_j.

    One program per (row, D tile), with the forward's axis order (rows fast, D tiles slow; the forward
    takes BLOCK_B rows a program): the programs resident together share one D tile, so both the
    decoder reads and the atomics into the F x BLOCK_D slice of the gradient stay in L2. Each step
    takes CHUNK latents: their decoder rows are gathered together (CHUNK loads in flight rather than
    one), and the recurrence inside the chunk is two in-thread prefix sums,
    e_j = e_{j0-1} + cumsum(v w)_j and E_j = E_{j0} - (cumsum(e)_j - e_j).

    WEIGHT_GRAD 3 keeps the sweep unscaled (s = 1 below) and stores v_j E_j rows, which a 16-bit dtype
    holds without underflow; g c is applied by the segmented sum that reduces them.

    FUSED: the loss's forward and backward in one launch, for when the gradient is wanted. The
    program first sweeps the latents as ``_hierarchical_sae_fwd_kernel`` does (loss partials and E_0
    out), then runs the sweep below over the same rows, which its first sweep left in L1 / L2. The
    incoming gradient is not known yet, so everything stays unscaled (g = 1, c = 1): gv and the
    weight-gradient rows get g * c from the pass that finishes them (``hierarchical_grads_finish``)."""
    i_b = tl.program_id(0).to(tl.int64)
    i_t = T0 + tl.program_id(1)
    o_b = i_b + tl.arange(0, 1)  # the row as a 1-vector, for the helpers shared with the forward
    o_d = tl.max_contiguous(i_t * BLOCK_D + tl.arange(0, BLOCK_D), VEC)
    m_b, m_d = o_b < B, o_d < D
    m_bd = m_b[:, None] & m_d[None, :]
    b_off = _hierarchical_offset(tgt_ptr, bias_ptr, o_b, o_d, m_bd, m_d, D, HAS_BIAS, ACC)  # [1, BLOCK_D]
    if FUSED:
        b_s = _hierarchical_loss_sweep(idx_ptr, vals_ptr, w_ptr, etot_ptr, loss_ptr, numel, b_off, i_t, o_b, m_b, o_d,
                                       m_d, m_bd, B, K, D, F, stride_wf, stride_wd, ACC)  # E_0
        gc = tl.full([], 1.0, ACC)
        gs = gc
    else:
        gc = tl.load(g_ptr).to(ACC)
        gs = gc if WEIGHT_GRAD != 3 else tl.full([], 1.0, ACC)
        b_s = tl.load(etot_ptr + o_b[:, None] * D + o_d[None, :], mask=m_bd, other=0) * gs
    b_s = tl.sum(b_s, axis=0)  # [BLOCK_D] s E_j, from j = 0
    b_e = tl.sum(b_off, axis=0) * gs  # [BLOCK_D] s e_{j-1}, from j = 0
    for i_k in range(0, K, CHUNK):
        o_k = i_k + tl.arange(0, CHUNK)
        m_k = o_k < K
        i_f, ok, v, b_w = _load_latent_chunk(idx_ptr, vals_ptr, w_ptr, i_b, o_k, m_k, o_d, m_d, K, F, stride_wf,
                                             stride_wd, ACC)
        b_u = (v * gs)[:, None] * b_w  # [CHUNK, BLOCK_D]
        b_ec = tl.where(m_k[:, None], b_e[None, :] + tl.cumsum(b_u, axis=0), 0.0)  # s e_j
        b_sc = b_s[None, :] - (tl.cumsum(b_ec, axis=0) - b_ec)  # s E_j
        b_dot = tl.where(ok, tl.sum(b_sc * b_w, axis=1), float("nan"))  # [CHUNK]
        if WEIGHT_GRAD == 3:
            b_dot *= gc
        if STAGED_GV:
            tl.store(gv_ptr + (i_t * B + i_b) * K + o_k, b_dot, mask=m_k)
        else:
            tl.atomic_add(gv_ptr + i_b * K + o_k, b_dot, mask=m_k, sem="relaxed")
        b_g = v[:, None] * b_sc  # [CHUNK, BLOCK_D]
        m_kd = m_k[:, None] & m_d[None, :]
        if WEIGHT_GRAD == 1:
            # A latent whose value is 0 adds +-0 unless its s E_j tile holds a non-finite entry, and
            # then b_dot is not finite either: skipping the other adds changes no bit of the sum
            # (it starts at +0), and spares L2 a crowded row. Rows padded with zero values at one
            # index put B * pad adds on one feature: 12x the unpadded step at B = 4096, K = 64, half
            # padded, before this (README, "Rows with fewer active latents").
            add = ok & ((v != 0) | ~(tl.abs(b_dot) < float("inf")))
            tl.atomic_add(gw_ptr + i_f[:, None] * D + o_d[None, :], b_g, mask=m_kd & add[:, None], sem="relaxed")
        elif WEIGHT_GRAD == 2:
            tl.store(gw_ptr + (i_b * K + o_k)[:, None] * D + o_d[None, :], b_g, mask=m_kd)
        elif WEIGHT_GRAD == 3:
            p_st = gw_ptr + (i_b * K + o_k)[:, None] * DC + (o_d - T0 * BLOCK_D)[None, :]
            tl.store(p_st, b_g.to(gw_ptr.dtype.element_ty), mask=m_kd)
        b_e += tl.sum(b_u, axis=0)
        b_s -= tl.sum(b_ec, axis=0)


@triton.jit
def _sae_weight_grad_kernel(
    seg_ptr,  # [F + 1] int64: feature f owns sorted entries seg[f] .. seg[f + 1] - 1
    order_ptr,  # [B * K] int64: flat entry ids b * K + k, sorted by feature
    vals_ptr,  # [B * K] per-entry weights (WEIGHTED)
    rows_ptr,  # [B, D], or [B * K, D] when ROW_PER_ENTRY
    part_ptr,  # [NC, D] ACC: sums of the whole single-feature chunks of CHUNK sorted entries (_segsum)
    wpart_ptr,  # [NC] ACC: their sums of vals (HAS_WSUM and WEIGHTED)
    scale_ptr,  # [] device scalar factor (HAS_SCALE)
    gw_ptr,  # [F, D] out, row stride stride_gw
    wsum_ptr,  # [F] out: sum over entries of feature f of vals[e] (HAS_WSUM; written by the first D tile)
    K,
    D,
    stride_gw,
    WEIGHTED: tl.constexpr,
    ROW_PER_ENTRY: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    HAS_WSUM: tl.constexpr,
    ACC: tl.constexpr,
    BLOCK_D: tl.constexpr,
    CHUNK: tl.constexpr,
    E: tl.constexpr,
):
    """gw[f, d] = scale * sum over entries e of feature f of vals[e] * rows[row(e), d].

    One program per (feature, D tile); every output element is written exactly once, in a fixed
    summation order. Entries go one at a time: wide [BLOCK_D] rows keep the loads 16 bytes per
    thread, and a 2-D [entries, BLOCK_D] tile was 8x slower on an H200 (64-bit pointers per element,
    in every program; most features have a few entries). A feature with whole chunks of sorted entries
    (a dense latent) takes their sums from ``part`` instead of walking them: the chunk kernel that
    writes them does use 2-D tiles, but only its crowded chunks do any work (``sparsefuse/_segsum.py``).
    """
    i_f = tl.program_id(0).to(tl.int64)
    o_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    m_d = o_d < D
    i_start = tl.load(seg_ptr + i_f)
    i_end = tl.load(seg_ptr + i_f + 1)
    b_acc, b_wsum = segment_sum(i_start, i_end, order_ptr, vals_ptr, rows_ptr, part_ptr, wpart_ptr,
                                1 if ROW_PER_ENTRY else K, o_d, m_d, D, CHUNK, WEIGHTED, HAS_WSUM and WEIGHTED, ACC,
                                BLOCK_D, E)
    if not WEIGHTED:
        b_wsum += (i_end - i_start).to(ACC)  # weight 1 an entry: the count
    if HAS_SCALE:
        b_acc *= tl.load(scale_ptr).to(ACC)
    tl.store(gw_ptr + i_f * stride_gw + o_d, b_acc.to(gw_ptr.dtype.element_ty), mask=m_d)
    if HAS_WSUM:
        tl.store(wsum_ptr + i_f + tl.arange(0, 1), b_wsum, mask=tl.program_id(1) == 0)


@triton.jit
def _unit_rows_kernel(
    w_ptr,  # [F, D] rows, strides (stride_wf, stride_wd); normalised in place unless PROJECT
    g_ptr,  # [F, D] gradient, strides (stride_gf, stride_gd); projected in place (PROJECT)
    D,
    stride_wf,
    stride_wd,
    stride_gf,
    stride_gd,
    eps: tl.float64,  # the norm's floor (typed: Triton would make a plain float argument fp32)
    PROJECT: tl.constexpr,
    ACC: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """One row per program. Not PROJECT: w /= max(|w|, eps). PROJECT: g -= (g . w) / max(|w|, eps)^2 * w,
    the component of g along the row removed. Two sweeps: the reductions, then the update."""
    i_f = tl.program_id(0).to(tl.int64)
    p_w = w_ptr + i_f * stride_wf
    p_g = g_ptr + i_f * stride_gf
    b_ww = tl.zeros([BLOCK_D], dtype=ACC)
    b_gw = tl.zeros([BLOCK_D], dtype=ACC)
    for i_d in range(0, D, BLOCK_D):
        o_d = i_d + tl.arange(0, BLOCK_D)
        m_d = o_d < D
        b_w = tl.load(p_w + o_d.to(tl.int64) * stride_wd, mask=m_d, other=0).to(ACC)
        b_ww += b_w * b_w
        if PROJECT:
            b_gw += tl.load(p_g + o_d.to(tl.int64) * stride_gd, mask=m_d, other=0).to(ACC) * b_w
    inv = 1 / tl.maximum(tl.sqrt(tl.sum(b_ww, axis=0)), tl.full([], eps, ACC))
    coef = tl.sum(b_gw, axis=0) * inv * inv
    for i_d in range(0, D, BLOCK_D):
        o_d = i_d + tl.arange(0, BLOCK_D)
        m_d = o_d < D
        b_w = tl.load(p_w + o_d.to(tl.int64) * stride_wd, mask=m_d, other=0).to(ACC)
        if PROJECT:
            b_g = tl.load(p_g + o_d.to(tl.int64) * stride_gd, mask=m_d, other=0).to(ACC)
            tl.store(p_g + o_d.to(tl.int64) * stride_gd, (b_g - coef * b_w).to(g_ptr.dtype.element_ty), mask=m_d)
        else:
            tl.store(p_w + o_d.to(tl.int64) * stride_wd, (b_w * inv).to(w_ptr.dtype.element_ty), mask=m_d)


@triton.jit
def _scale_cast_kernel(
    src_ptr,  # [N] ACC, contiguous
    dst_ptr,  # [N] out, contiguous
    g_ptr,  # [] device scalar
    N,
    ACC: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """dst = g * src, converted to dst's dtype on the store: one read and one write."""
    o = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = o < N
    gs = tl.load(g_ptr).to(ACC)
    tl.store(dst_ptr + o, (tl.load(src_ptr + o, mask=m, other=0) * gs).to(dst_ptr.dtype.element_ty), mask=m)


@triton.jit
def _store_segment_key(idx_ptr, vals_ptr, keys_ptr, o, m, F, finite, SKIP: tl.constexpr):
    """keys[o] = indices.flat[o] clamped to [-1, F] (an out-of-range id, index checks off, stays out of
    every feature's segment instead of wrapping onto one), in keys' dtype; with SKIP, F (which owns
    no segment) where vals.flat[o] is 0 and ``finite`` (the entry's gv parts are all finite): see
    :func:`feature_segments`."""
    key = tl.minimum(tl.maximum(tl.load(idx_ptr + o, mask=m, other=0), -1), F)
    if SKIP:
        key = tl.where((tl.load(vals_ptr + o, mask=m, other=1) == 0) & finite, F, key)
    tl.store(keys_ptr + o, key.to(keys_ptr.dtype.element_ty), mask=m)


@triton.jit
def _grads_finish_kernel(
    gv_ptr,  # [P, BK] ACC: parts of gv (TopK's column groups, or the hierarchical sweep's D tiles)
    gvals_ptr,  # [BK] out, vals dtype
    colsum_ptr,  # [D] ACC: sum_b resid[b] (TopK) or sum_b E_0[b] (hierarchical)
    gbias_ptr,  # [D] out, bias dtype
    gc_ptr,  # [] ACC: g * c (c = 2 / (B * D) for TopK, 2 / (B * K * D) for the hierarchical loss)
    idx_ptr,  # [BK] indices (KEYS)
    vals_ptr,  # [BK] vals (KEYS)
    keys_ptr,  # [BK] out: the weight gradient's sort keys (KEYS)
    P,
    BK,
    D,
    F,
    n_vals,  # programs 0 .. n_vals - 1 write grad_vals (and the keys), the rest grad_bias
    KEYS: tl.constexpr,
    ACC: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """grad_vals = gc * sum_p gv[p] and grad_bias = gc * colsum, each cast to its parameter's dtype,
    and with KEYS the segmented sum's keys, zero-value entries left out (``_segment_keys_kernel`` with
    SKIP, from the gv parts this kernel reads anyway): one launch for what would be five or six small
    ops a step (host time at small K)."""
    i_p = tl.program_id(0)
    gc = tl.load(gc_ptr).to(ACC)
    if i_p < n_vals:
        o_e = i_p.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        m_e = o_e < BK
        b_acc = tl.zeros([BLOCK], dtype=ACC)
        b_finite = tl.full([BLOCK], True, tl.int1)
        p_gv = gv_ptr + o_e
        for _ in range(P):
            b_part = tl.load(p_gv, mask=m_e, other=0)
            b_acc += b_part
            b_finite &= tl.abs(b_part) < float("inf")
            p_gv += BK
        tl.store(gvals_ptr + o_e, (b_acc * gc).to(gvals_ptr.dtype.element_ty), mask=m_e)
        if KEYS:
            _store_segment_key(idx_ptr, vals_ptr, keys_ptr, o_e, m_e, F, b_finite, SKIP=True)
    else:
        o_d = (i_p - n_vals) * BLOCK + tl.arange(0, BLOCK)
        m_d = o_d < D
        b_s = tl.load(colsum_ptr + o_d, mask=m_d, other=0)
        tl.store(gbias_ptr + o_d, (b_s * gc).to(gbias_ptr.dtype.element_ty), mask=m_d)


# ---------------------------------------------------------------------------------------------
# Launchers. Inputs are already shape/dtype-checked by the public functions (ops.py); these make
# the small operands contiguous (the weight is used through its strides, never copied, but with its
# negative bit resolved: see _readable), check the index range, allocate, and launch.


def _launch(fn, grid, *args, num_warps, **meta):
    """``fn[grid](*args, **meta)`` through the shared low-overhead launcher (``sparsefuse/_launch.py``)."""
    launch(fn, grid, args, meta, num_warps)


def _contiguous(t):
    """``t.contiguous()``, or None: the kernels index a bias with unit stride."""
    return None if t is None else t.contiguous()


def _readable(t):
    """``t`` for a kernel that reads it in place through its strides: a lazily negated view (negative
    bit set, as ``z.conj().imag`` of a complex tensor has) holds its values un-negated in storage, so
    it is materialised; any other tensor comes back as it is (no copy)."""
    return t.resolve_neg()


def _weight_strides(weight: torch.Tensor):
    return weight.stride(0), weight.stride(1)


def decode_fwd(indices, vals, weight, bias):
    """recon [B, D] in promote(vals, weight) dtype."""
    B, K = indices.shape
    F, D = weight.shape
    check_index_range("indices", indices, F)
    weight = _readable(weight)
    out = torch.empty(B, D, device=vals.device, dtype=torch.promote_types(vals.dtype, weight.dtype))
    if B == 0 or D == 0:
        return out.zero_()
    acc = acc_dtype(vals, weight, bias)
    if K > _DECODE_TILE_MAX_K:
        return out.copy_(_decode_blocks(indices, vals, weight, bias, acc))
    _decode_launch_into(out, indices.contiguous(), vals.contiguous(), weight, _contiguous(bias), acc)
    return out


def _decode_launch_into(out, idx, v, weight, bias, acc):
    """One ``_sae_decode_fwd_kernel`` launch (no loss): out [B, D] = bias + the decode of contiguous
    ``idx``, ``v`` [B, K <= _DECODE_TILE_MAX_K]."""
    (B, K), (F, D) = idx.shape, weight.shape
    P, cols, meta = _decode_launch(D, _decode_config(K, D, weight.element_size(), loss=False))
    _launch(_sae_decode_fwd_kernel, (B, P),
        idx, v, weight, bias, None, out, None, None, 1, B, K, D, F, *_weight_strides(weight), cols,
        HAS_BIAS=bias is not None, IS_LOSS=False, ACC=tl_dtype(acc), **meta,
    )


def _decode_blocks(indices, vals, weight, bias, acc):
    """bias + sum_k vals[b, k] * weight[indices[b, k]] as [B, D] in ``acc``, for K > _DECODE_TILE_MAX_K:
    one launch per block of _MAX_BLOCK_K latents, the blocks summed in ``acc`` (B > 0, D > 0)."""
    (B, K), D = indices.shape, weight.shape[1]
    out, part = (torch.empty(B, D, device=vals.device, dtype=acc) for _ in range(2))
    for k0 in range(0, K, _MAX_BLOCK_K):
        idx, v = (t[:, k0:k0 + _MAX_BLOCK_K].contiguous() for t in (indices, vals))
        _decode_launch_into(out if k0 == 0 else part, idx, v, weight, _contiguous(bias) if k0 == 0 else None, acc)
        if k0:
            out.add_(part)
    return out


@functools.lru_cache(maxsize=16)
def _feature_range(n: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """0 .. n-1, cached: it is the same every step (one launch and one allocation fewer)."""
    return torch.arange(n, device=device, dtype=dtype)


@triton.jit
def _segment_keys_kernel(idx_ptr, vals_ptr, gv_ptr, keys_ptr, M, F, P, SKIP: tl.constexpr, BLOCK: tl.constexpr):
    """The sort keys of :func:`feature_segments` (``_store_segment_key``); SKIP reads gv's P parts
    ([P, M]) for the zero-value test. ``_grads_finish_kernel`` writes the same keys where it runs."""
    o = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = o < M
    finite = tl.full([BLOCK], True, tl.int1)
    if SKIP:
        for p in range(P):
            finite &= tl.abs(tl.load(gv_ptr + p * M + o, mask=m, other=0)) < float("inf")
    _store_segment_key(idx_ptr, vals_ptr, keys_ptr, o, m, F, finite, SKIP)


def _keys_dtype(indices, num_features) -> torch.dtype:
    """4-byte keys where the ids fit (a radix sort over them takes half the time)."""
    return torch.int32 if num_features < 2**31 - 1 else indices.dtype


def feature_segments(indices, num_features, skip=None):
    """(seg [F + 1], order [B * K], sorted keys [B * K]): entries sorted stably by feature; feature f
    owns the sorted entries seg[f] .. seg[f + 1] - 1 (out-of-range ids, index checks off, fall in no
    segment).

    ``skip = (vals [B, K], gv [P, B, K] or [B, K])`` also leaves out every entry whose value is 0 and whose gv
    parts are finite. gv[., b, k] is a dot product of latent (b, k)'s decoder row with the error its
    weight-gradient row is v[b, k] times (TopK's residual row; a Hierarchical suffix error), so where
    it is finite that error is finite, and the row adds only +-0 to a sum that starts at +0 (never
    -0): leaving it out changes no sum, beyond where a long segment's chunks begin (still fixed by
    the inputs, so still deterministic). Where the error holds an inf or a NaN the entry stays, and
    0 * inf = NaN reaches the gradient as in the reference. Rows padded with zero values (BatchTopK,
    JumpReLU) then cost only their real entries, and padding at one index makes no crowded feature
    (README, "Rows with fewer active latents")."""
    keys = indices.reshape(-1)
    if skip is not None or keys.dtype != _keys_dtype(indices, num_features):
        # one pass writes the keys: 4-byte keys where they fit, clamped (session 11 tried narrowing
        # without the clamp, the weight-gradient kernel checking each entry's id instead: one host op
        # fewer a step, but 9% more time in that kernel at K = 64), F for the skipped entries
        src = keys.contiguous()
        keys = torch.empty(src.numel(), device=src.device, dtype=_keys_dtype(indices, num_features))
        vals, gv = (None, None) if skip is None else (skip[0].contiguous(), skip[1].contiguous())
        if src.numel():
            parts = 0 if gv is None else gv.numel() // src.numel()  # gv is [P, B, K] or [B, K]
            _launch(_segment_keys_kernel, (cdiv(src.numel(), _KEYS_BLOCK),), src, vals, gv, keys, src.numel(),
                    num_features, parts, SKIP=skip is not None, BLOCK=_KEYS_BLOCK, num_warps=_KEYS_WARPS)
    return sorted_segments(keys, num_features)


def sorted_segments(keys, num_features):
    """:func:`feature_segments` from keys already written (flat, in [-1, F])."""
    sorted_keys, order = torch.sort(keys, stable=True)
    seg = torch.searchsorted(sorted_keys, _feature_range(num_features + 1, keys.device, keys.dtype))
    return seg, order, sorted_keys


def weight_grad(indices, rows, entry_weights, num_features, out_dtype, *, scale=None,
                row_per_entry=False, wsum=None, out=None, segments=None, skip=None):
    """Segmented sum: out[f] = scale * sum_{e: indices.flat[e] == f} w[e] * rows[row(e)].

    ``row(e) = e // K`` (rows is [B, D]) or ``e`` (``row_per_entry``, rows is [B * K, D]).
    ``entry_weights`` is ``vals`` ([B, K]) or None for weight 1. ``scale`` is an optional device scalar.
    ``wsum``: optional [F] output that receives sum_{e: indices.flat[e] == f} w[e] (unscaled) in the
    same pass. ``out``: an [F, D] destination with unit column stride (a column slice of a wider
    gradient) instead of a new tensor; ``segments``: :func:`feature_segments` of ``indices``, when the
    caller reduces several column chunks; ``skip``: its (vals, gv), to leave out the entries whose
    value is 0 and whose gv is finite (they add nothing). Entries are sorted stably by feature, so the
    sum order, and the result, is fixed run to run.
    """
    B, K = indices.shape
    D = rows.shape[-1]
    if out is None:
        out = torch.empty(num_features, D, device=rows.device, dtype=out_dtype)
    if num_features == 0 or (D == 0 and wsum is None):
        return out
    seg, order, sorted_keys = feature_segments(indices, num_features, skip) if segments is None else segments
    rows = rows.contiguous()
    weights = None if entry_weights is None else entry_weights.contiguous()
    acc = acc_dtype(rows, entry_weights)
    chunk = chunk_size(B * K, rows.shape[0])
    part, wpart = chunk_partials(sorted_keys, order, weights, rows, 1 if row_per_entry else K, chunk, acc,
                                 _SEG_BLOCK_D, wsum is not None and weights is not None, num_features)
    grid = (num_features, max(cdiv(D, _SEG_BLOCK_D), 1))
    _launch(_sae_weight_grad_kernel, grid,
        seg, order, weights, rows, part, wpart, scale, out, wsum, K, D, out.stride(0),
        WEIGHTED=weights is not None, ROW_PER_ENTRY=row_per_entry, HAS_SCALE=scale is not None,
        HAS_WSUM=wsum is not None, ACC=tl_dtype(acc), BLOCK_D=_SEG_BLOCK_D, CHUNK=chunk, E=GATHER_STEP,
        num_warps=_SEG_WARPS,
    )
    return out


def row_dot(indices, weight, rows, fbias, out_dtype, acc):
    """out[b, k] = <rows[b], weight[indices[b, k]]> (+ fbias[indices[b, k]]), [B, K] in ``out_dtype``."""
    B, K = indices.shape
    F, D = weight.shape
    weight = _readable(weight)
    out = torch.empty(B, K, device=rows.device, dtype=out_dtype)
    if B > 0:
        cfg = _gather_config(K, D, weight.element_size())
        _launch(_sae_row_dot_kernel, (B, cdiv(K, cfg["BLOCK_K"])),
            indices.contiguous(), weight, rows.contiguous(), fbias, out, K, D, F, *_weight_strides(weight),
            HAS_BIAS=fbias is not None, ACC=tl_dtype(acc), **cfg,
        )
    return out


def sparse_linear_fwd(x, weight, indices, bias, x_shift, values):
    """[B, K] in promote(x, weight, bias, x_shift): the selected entries of F.linear(x - x_shift, weight,
    bias); a copy of ``values`` when the caller already has them."""
    check_index_range("indices", indices, weight.shape[0])
    out_dtype = torch.promote_types(x.dtype, weight.dtype)
    for t in (bias, x_shift):
        if t is not None:
            out_dtype = torch.promote_types(out_dtype, t.dtype)
    if values is not None:
        return values.to(out_dtype, memory_format=torch.contiguous_format, copy=True)
    bias = _contiguous(bias)
    acc = acc_dtype(x, weight, bias, x_shift)
    return row_dot(indices, weight, shifted(x, x_shift, acc), bias, out_dtype, acc)


def sparse_linear_bwd(grad, x, indices, weight, x_shift, need_x, need_weight, need_bias, need_shift):
    """(grad_x [B, D] x dtype, grad_weight [F, D] weight dtype, grad_bias [F] ACC, grad_shift [D] ACC),
    each [0] when not needed.

    grad_x is the sparse embedding bag of ``grad`` over ``weight``; grad_weight[f] = sum over the
    entries of feature f of grad[b, k] * (x[b] - x_shift), and grad_bias[f] the sum of those
    grad[b, k], both from one segmented pass over the entries sorted by feature (deterministic, no
    atomics). grad_shift = -sum_b grad_x[b] = -(grad_bias @ weight): one matrix-vector product
    when grad_x itself is not wanted."""
    F, D = weight.shape
    check_index_range("indices", indices, F)
    acc = acc_dtype(grad, x, weight, x_shift)
    grad_x, grad_shift = x.new_empty(0), x.new_empty(0, dtype=acc)
    if need_x:
        gx = decode_fwd(indices, grad, weight, None)
        grad_x = gx.to(x.dtype)
        if need_shift:
            grad_shift = gx.sum(0, dtype=acc).neg_()
    need_sums = need_bias or (need_shift and not need_x)
    sums = torch.empty(F if need_sums else 0, device=x.device, dtype=acc)
    grad_weight = weight.new_empty(0)
    segments = None
    if need_weight or need_sums:
        segments = feature_segments(indices, F)
        rows = shifted(x, x_shift, acc) if need_weight else x[:, :0]  # sums alone: the same pass with no columns
        gw = weight_grad(indices, rows, grad, F, weight.dtype, wsum=sums if need_sums else None, segments=segments)
        if need_weight:
            grad_weight = gw
    if need_shift and not need_x:  # in the weight's dtype, or float64 (a float64 copy of the weight) when asked
        mv_dtype = acc if acc == torch.float64 else weight.dtype
        with torch.autocast(x.device.type, enabled=False):  # CUDA autocast runs mv in its 16-bit dtype
            if mv_dtype == torch.float16:
                # float16's range: the per-feature sums can pass 65504 where the gradient fits, so
                # they enter the product scaled to a largest magnitude of 1 (no host sync)
                top = sums.abs().amax()
                top = torch.where(top > 0, top, torch.ones_like(top))
                grad_shift = torch.mv(weight.t(), (sums / top).to(mv_dtype)).to(acc).mul_(top).neg_()
            else:
                grad_shift = torch.mv(weight.t().to(mv_dtype), sums.to(mv_dtype)).to(acc).neg_()
        # an out-of-range index (index checks off) falls in no feature's segment, so the sums leave
        # it out; grad_shift depends on it (its row of grad_x is NaN), so it is NaN, as when x
        # requires grad. Read from the segment bounds on the device: no host sync.
        seg = segments[0]
        grad_shift = torch.where(seg[F] - seg[0] == indices.numel(), grad_shift, math.nan)
    grad_bias = sums if need_bias else x.new_empty(0, dtype=acc)
    return grad_x, grad_weight, grad_bias, grad_shift


def unit_rows_(weight, grad, eps):
    """In place: ``weight`` rows scaled to unit norm (grad None), or the component of each ``grad``
    row along its ``weight`` row removed."""
    F, D = weight.shape
    if F == 0 or D == 0:
        return
    g = weight if grad is None else grad
    _launch(_unit_rows_kernel, (F,), weight, g, D, *_weight_strides(weight), *_weight_strides(g), float(eps),
            PROJECT=grad is not None, ACC=tl_dtype(acc_dtype(weight, grad)),
            BLOCK_D=min(next_pow2(D), _UNIT_ROWS_MAX_D), num_warps=_UNIT_ROWS_WARPS)


def decode_bwd(grad, indices, vals, weight, need_weight_grad):
    """(grad_vals [B, K] vals dtype, grad_weight [F, D] weight dtype or [0], grad_bias [D] ACC)."""
    F = weight.shape[0]
    check_index_range("indices", indices, F)
    acc = acc_dtype(vals, weight, grad)
    grad = grad.contiguous()
    grad_vals = row_dot(indices, weight, grad, None, vals.dtype, acc)
    grad_bias = grad.to(acc).sum(0)
    grad_weight = (weight_grad(indices, grad, vals, F, weight.dtype) if need_weight_grad
                   else weight.new_empty(0))
    return grad_vals, grad_weight, grad_bias


def topk_gv_parts(K: int, D: int, itemsize: int) -> int:
    """How many [B, K] parts of gv the TopK forward hands to the backward. Each of the gather's P
    column groups writes its own part; the backward's finishing launch sums them, one host op a step
    fewer than a sum in the forward. Where the parts would outweigh half a residual (P * K > D / 2:
    large K, where the step is GPU-bound anyway) the forward sums them instead, so the memory held
    between forward and backward stays flat in K. Rows of more than _DECODE_TILE_MAX_K latents get
    one part (see topk_loss_fwd)."""
    if K > _DECODE_TILE_MAX_K:
        return 1
    return _gv_parts_kept(_decode_launch(D, _decode_config(K, D, itemsize, loss=True))[0], K, D)


def _gv_parts_kept(P: int, K: int, D: int) -> int:
    return P if 2 * P * K <= D else 1


def topk_loss_fwd(indices, weight, vals, bias, target):
    """(loss [] ACC, resid [B, D] ACC, gv [topk_gv_parts, B, K] ACC): parts of gv for the backward to sum."""
    B, K = indices.shape
    F, D = weight.shape
    check_index_range("indices", indices, F)
    weight = _readable(weight)
    acc = acc_dtype(weight, vals, bias, target)
    P, cols, meta = _decode_launch(D, _decode_config(K, D, weight.element_size(), loss=True))
    parts = 1 if K > _DECODE_TILE_MAX_K else _gv_parts_kept(P, K, D)  # topk_gv_parts, from this P
    if B == 0 or D == 0:
        zeros = functools.partial(torch.zeros, device=vals.device, dtype=acc)
        return zeros(()), zeros(B, D), zeros(parts, B, K)
    if K > _DECODE_TILE_MAX_K:
        # the residual from the decode's blocks of latents, then gv from the row dot products (which
        # take blocks of latents too): the decoder rows are read twice instead of once
        resid = _decode_blocks(indices, vals, weight, bias, acc).sub_(target)
        gv = row_dot(indices, weight, resid, None, acc, acc)
        return resid.square().sum() / (B * D), resid, gv[None]
    resid = torch.empty(B, D, device=vals.device, dtype=acc)
    gv = torch.empty(P, B, K, device=vals.device, dtype=acc)
    row_loss = torch.empty(P, B, device=vals.device, dtype=acc)
    _launch(_sae_decode_fwd_kernel, (B, P),
        indices.contiguous(), vals.contiguous(), weight, _contiguous(bias), target.contiguous(), resid, gv, row_loss,
        B * D, B, K, D, F, *_weight_strides(weight), cols,
        HAS_BIAS=bias is not None, IS_LOSS=True, ACC=tl_dtype(acc), **meta,
    )
    if parts < P:
        gv = gv.sum(0, keepdim=True)
    return row_loss.sum(), resid, gv


def _finish_grads(gv, colsum, gc, vals, bias_dtype, indices=None, num_features=0):
    """(grad_vals [B, K] in vals' dtype, grad_bias [D] in ``bias_dtype``, segments) = (gc * the sum of
    gv's parts, gc * colsum, ...) in one ``_grads_finish_kernel`` launch (gv is [P, B, K] ACC, colsum
    [D] ACC). With ``indices``, the same launch writes the sort keys of the weight gradient's
    segmented sum, and ``segments`` is ``feature_segments(indices, num_features, skip=(vals, gv))``;
    else None."""
    P, B, K = gv.shape
    D = colsum.shape[0]
    grad_vals = torch.empty(B, K, device=gv.device, dtype=vals.dtype)
    grad_bias = torch.empty(D, device=gv.device, dtype=bias_dtype)
    keys = None if indices is None else torch.empty(B * K, device=gv.device, dtype=_keys_dtype(indices, num_features))
    n_vals = cdiv(B * K, _FINISH_BLOCK)
    grid = n_vals + cdiv(D, _FINISH_BLOCK)
    if grid:
        _launch(_grads_finish_kernel, (grid,), gv, grad_vals, colsum, grad_bias, gc,
                None if keys is None else indices.contiguous(), None if keys is None else vals.contiguous(), keys,
                P, B * K, D, num_features, n_vals,
                KEYS=keys is not None, ACC=tl_dtype(colsum.dtype), BLOCK=_FINISH_BLOCK, num_warps=_FINISH_WARPS)
    return grad_vals, grad_bias, None if keys is None else sorted_segments(keys, num_features)


def topk_loss_bwd(grad_loss, indices, vals, weight, resid, gv, need_weight_grad, bias_dtype):
    """Gradients of the TopK loss scaled by grad_loss (a device scalar: no host sync): grad_vals in
    vals' dtype, grad_weight in weight's, grad_bias in ``bias_dtype``."""
    B, D = resid.shape
    F = weight.shape[0]
    gc = grad_loss.to(resid.dtype) * (2.0 / max(B * D, 1))
    # the column sum first, while no F x D gradient exists: PyTorch's sum over rows can hold a
    # transient of about 2 B*D floats (72 MiB at B = 4096, D = 2304), which would add to the peak
    colsum = resid.sum(0)
    # the finishing launch also writes the weight gradient's sort keys (one launch fewer than a key
    # pass of its own, which reads gv's parts again), so it goes first
    grad_vals, grad_bias, segments = _finish_grads(gv, colsum, gc, vals, bias_dtype,
                                                   indices if need_weight_grad else None, F)
    grad_weight = (weight_grad(indices, resid, vals, F, weight.dtype, scale=gc, segments=segments)
                   if need_weight_grad else weight.new_empty(0))
    return grad_vals, grad_weight, grad_bias


def _hier_grid(B: int, D: int, cfg: dict) -> tuple:
    """Row blocks on the fast grid axis, D tiles on the slow one (see _hierarchical_sae_fwd_kernel)."""
    return cdiv(B, cfg.get("BLOCK_B", 1)), cdiv(D, cfg["BLOCK_D"])


def hierarchical_loss_fwd(indices, weight, vals, bias, target):
    """(loss [] ACC, etot [B, D] ACC) with etot[b] = sum_k of the prefix errors of row b."""
    B, K = indices.shape
    F, D = weight.shape
    check_index_range("indices", indices, F)
    weight = _readable(weight)
    acc = acc_dtype(weight, vals, bias, target)
    etot = torch.empty(B, D, device=vals.device, dtype=acc)
    if B == 0 or D == 0:
        return vals.new_zeros((), dtype=acc), etot.zero_()
    cfg = _hier_config(D, weight.element_size(), backward=False)
    grid = _hier_grid(B, D, cfg)
    row_loss = torch.empty(grid[1], B, device=vals.device, dtype=acc)
    _launch(_hierarchical_sae_fwd_kernel, grid,
        indices.contiguous(), vals.contiguous(), weight, _contiguous(bias), target.contiguous(), etot, row_loss,
        B * K * D, B, K, D, F, *_weight_strides(weight),
        HAS_BIAS=bias is not None, ACC=tl_dtype(acc), **cfg,
    )
    return row_loss.sum(), etot


def _stage_tiles(F: int, D: int, BK: int, itemsize: int, block_d: int) -> int:
    """D tiles per staged chunk: the [B * K, chunk] staging buffer stays within the F x D fp32
    buffer the atomic path would zero (at least one tile; all of them when all the rows fit)."""
    if BK * itemsize * D <= F * D * 4:
        return cdiv(D, block_d)
    return max(1, min(cdiv(D, block_d), (F * D * 4) // max(BK * itemsize * block_d, 1)))


_STAGE_DTYPES = (torch.bfloat16,)  # see hierarchical_plan


def hierarchical_plan(B, K, F, D, weight_dtype, need_weight_grad, deterministic):
    """(mode, tiles per launch, tiles): how the hierarchical backward gets the weight gradient.

    mode 0, no weight gradient; 1, fp32 atomics into a zeroed F x D ACC buffer (the output itself
    for fp32 weights, converted to fp16 / bf16 after); 2, ``deterministic`` fp32 / fp64 / fp16
    weights: B*K ACC rows staged and reduced in a fixed order; 3, bf16 weights when
    ``deterministic``, or when B*K bf16 rows fit in that fp32 buffer's bytes (B*K <= 2F): rows
    v_j E_j staged in bf16, in column chunks within the buffer's bytes, each chunk reduced by the
    segmented sum in fp32 straight into the output. At F = 65536, D = 2304, K = 32 on an H200 mode 3
    is 0.09 ms faster than zeroing and converting the buffer (0.13 + 0.2 ms); with two chunks or
    more (K >= 64) it is 0.13-0.7 ms slower, so atomics stay. fp16 is never staged in its own dtype:
    unscaled rows v_j E_j can exceed its range (65504), and scaled ones underflow.
    """
    itemsize = weight_dtype.itemsize
    block_d = _hier_config(D, itemsize, backward=True)["BLOCK_D"]
    n_tiles = cdiv(D, block_d)
    stage16 = weight_dtype in _STAGE_DTYPES and (deterministic or B * K * itemsize <= 4 * F)
    mode = 0 if not need_weight_grad else 3 if stage16 else 2 if deterministic else 1
    per_launch = _stage_tiles(F, D, B * K, itemsize, block_d) if mode == 3 else n_tiles
    return mode, per_launch, n_tiles


def hierarchical_fusable(B, K, F, D, weight_dtype, acc, need_weight_grad, deterministic) -> bool:
    """Whether the forward may run the backward's sweep too (``hierarchical_loss_fwd_grads``).

    It leaves every gradient unscaled, so it pays off only where the backward has a pass that can
    apply g * c on the way: the gv [B, K] scaling, the conversion of a 16-bit weight's fp32
    buffer, or the segmented sum of staged rows in one column chunk. Weights in the accumulation
    dtype on the atomic path (fp32, and fp64) have none: their atomics land in the output, and
    scaling it would cost a read and a write of F x D and a second F x D buffer, more than the
    forward sweep it saves. fp32 weights with an fp64 input do have one (their fp64 buffer is
    converted), so they fuse."""
    mode, per_launch, n_tiles = hierarchical_plan(B, K, F, D, weight_dtype, need_weight_grad, deterministic)
    return per_launch >= n_tiles and not (mode == 1 and weight_dtype == acc)


def hierarchical_gv_tiles(D, weight_dtype, deterministic) -> int:
    """Leading size of the fused forward's gv: one slot per D tile when ``deterministic`` (partials
    summed in a fixed order), else one slot taking atomics; at least one, so D = 0 gives zeros."""
    if not deterministic:
        return 1
    return max(1, cdiv(D, _hier_config(D, weight_dtype.itemsize, backward=True)["BLOCK_D"]))


def hierarchical_stage_shape(B, K, F, D, weight_dtype, acc, mode):
    """(shape, dtype) of the unscaled weight-gradient data the fused forward hands the backward."""
    return {0: ((0,), acc), 1: ((F, D), acc), 2: ((B * K, D), acc), 3: ((B * K, D), weight_dtype)}[mode]


def hierarchical_loss_fwd_grads(indices, weight, vals, bias, target, need_weight_grad, deterministic):
    """(loss [] ACC, etot [B, D] ACC, gv [T, B, K] ACC, stage): the loss and its unscaled gradients in
    one launch (``FUSED`` sweep); :func:`hierarchical_grads_finish` applies the incoming gradient.

    gv holds T per-tile partials when ``deterministic``, else T = 1 (atomics); see
    :func:`hierarchical_gv_tiles`.
    ``stage`` is mode 1's F x D ACC buffer, modes 2 and 3's [B * K, D] rows v_j E_j, or empty (mode
    0; see :func:`hierarchical_plan`)."""
    B, K = indices.shape
    F, D = weight.shape
    check_index_range("indices", indices, F)
    weight = _readable(weight)
    acc = acc_dtype(weight, vals, bias, target)
    mode, _, n_tiles = hierarchical_plan(B, K, F, D, weight.dtype, need_weight_grad, deterministic)
    shape, st_dtype = hierarchical_stage_shape(B, K, F, D, weight.dtype, acc, mode)
    stage = (torch.zeros if mode == 1 else torch.empty)(shape, device=vals.device, dtype=st_dtype)
    etot = torch.empty(B, D, device=vals.device, dtype=acc)
    gv = (torch.empty if deterministic else torch.zeros)(hierarchical_gv_tiles(D, weight.dtype, deterministic), B, K,
                                                        device=vals.device, dtype=acc)
    if B == 0 or D == 0:
        for t in (stage, etot, gv):
            t.zero_()
        return vals.new_zeros((), dtype=acc), etot, gv, stage
    cfg = _hier_config(D, weight.element_size(), backward=True)
    grid = _hier_grid(B, D, cfg)
    row_loss = torch.empty(grid[1], B, device=vals.device, dtype=acc)
    _launch(_hierarchical_sae_bwd_kernel, grid,
        indices.contiguous(), vals.contiguous(), weight, _contiguous(bias), target.contiguous(), etot, None, stage, gv,
        row_loss, B * K * D, B, K, D, F, *_weight_strides(weight), 0, D,
        HAS_BIAS=bias is not None, WEIGHT_GRAD=mode, STAGED_GV=deterministic, FUSED=True, ACC=tl_dtype(acc), **cfg,
    )
    return row_loss.sum(), etot, gv, stage


def hierarchical_grads_finish(grad_loss, indices, vals, etot, gv, stage, num_features, weight_dtype, bias_dtype, mode):
    """(grad_vals vals dtype, grad_weight weight dtype or [0], grad_bias ``bias_dtype``) from the
    fused forward's unscaled results, scaled by g * c (g = grad_loss, a device scalar: no host sync).
    Reads ``gv`` and ``stage`` and writes new tensors (a second backward sees them unchanged)."""
    B, D = etot.shape
    K = gv.shape[-1]
    gc = grad_loss.to(etot.dtype) * (2.0 / max(B * K * D, 1))
    colsum = etot.sum(0)  # before the weight gradient is allocated, as in topk_loss_bwd
    if mode == 0:
        grad_weight = torch.empty(0, device=etot.device, dtype=weight_dtype)
    elif mode == 1:  # scale and convert in one pass (torch.mul with a bf16 out= was 0.25 ms slower)
        grad_weight = torch.empty(stage.shape, device=etot.device, dtype=weight_dtype)
        n = stage.numel()
        if n:
            _launch(_scale_cast_kernel, (cdiv(n, _SCALE_CAST_BLOCK),), stage, grad_weight, gc, n,
                    ACC=tl_dtype(etot.dtype), BLOCK=_SCALE_CAST_BLOCK, num_warps=_SCALE_CAST_WARPS)
    # modes 2 and 3 sum staged rows by feature: the finishing launch writes their sort keys too
    grad_vals, grad_bias, segments = _finish_grads(gv, colsum, gc, vals, bias_dtype,
                                                   indices if mode >= 2 else None, num_features)
    if mode >= 2:
        grad_weight = weight_grad(indices, stage, None, num_features, weight_dtype, scale=gc, row_per_entry=True,
                                  segments=segments)
    return grad_vals, grad_weight, grad_bias


def hierarchical_loss_bwd(grad_loss, indices, weight, vals, bias, target, etot, need_weight_grad, deterministic):
    """(grad_vals vals dtype, grad_weight weight dtype or [0], grad_bias ACC), all scaled by grad_loss.

    The weight gradient takes the path :func:`hierarchical_plan` picks. gv goes through atomics, or
    per-D-tile partials summed in a fixed order when ``deterministic``.
    """
    B, K = indices.shape
    F, D = weight.shape
    weight = _readable(weight)
    acc = etot.dtype
    c = 2.0 / max(B * K * D, 1)
    g = grad_loss.to(acc)
    gc = g * c  # a device scalar in ACC: a Python float reaches a kernel as fp32, too coarse for fp64
    grad_bias = etot.sum(0).mul_(gc)
    cfg = _hier_config(D, weight.element_size(), backward=True)
    mode, per_launch, n_tiles = hierarchical_plan(B, K, F, D, weight.dtype, need_weight_grad, deterministic)
    narrow = mode == 1 and weight.element_size() == 4 and B * K >= _NARROW_MIN_ENTRIES  # fp32 atomics
    if narrow and _narrow_atomic_bwd(weight.device):
        cfg = dict(cfg, BLOCK_D=min(cfg["BLOCK_D"], 32))
        n_tiles = per_launch = cdiv(D, cfg["BLOCK_D"])
    buf = grad_weight = None
    if mode == 1:
        buf = torch.zeros(F, D, device=vals.device, dtype=acc)
    elif mode == 2:
        buf = torch.empty(B * K, D, device=vals.device, dtype=acc)
    elif mode == 3:
        grad_weight = torch.empty(F, D, device=vals.device, dtype=weight.dtype)
        buf = torch.empty(B * K, min(per_launch * cfg["BLOCK_D"], D), device=vals.device, dtype=weight.dtype)
    gv = None
    if B == 0 or D == 0:
        if buf is not None:
            buf.zero_()
        if mode == 3:
            grad_weight.zero_()
        grad_vals = torch.zeros(B, K, device=vals.device, dtype=vals.dtype)
    else:
        gv = (torch.empty(n_tiles, B, K, device=vals.device, dtype=acc) if deterministic
              else torch.zeros(B, K, device=vals.device, dtype=acc))
        args = (indices.contiguous(), vals.contiguous(), weight, _contiguous(bias), target.contiguous(), etot, gc, buf,
                gv, None, 1, B, K, D, F, *_weight_strides(weight))
        meta = dict(HAS_BIAS=bias is not None, WEIGHT_GRAD=mode, STAGED_GV=deterministic, FUSED=False,
                    ACC=tl_dtype(acc), **cfg)
        segments = None
        for t0 in range(0, n_tiles, per_launch):
            tiles = min(per_launch, n_tiles - t0)
            d0, d1 = t0 * cfg["BLOCK_D"], min((t0 + tiles) * cfg["BLOCK_D"], D)
            _launch(_hierarchical_sae_bwd_kernel, (_hier_grid(B, D, cfg)[0], tiles), *args, t0,
                    d1 - d0 if mode == 3 else D, **meta)
            if mode == 3:  # the chunk's rows are packed [B * K, d1 - d0] at the start of buf
                if segments is None:  # gv is whole only in one chunk: zero values are skipped there
                    segments = feature_segments(indices, F, (vals, gv) if tiles == n_tiles else None)
                rows = buf.view(-1)[: B * K * (d1 - d0)].view(B * K, d1 - d0)
                weight_grad(indices, rows, None, F, weight.dtype, scale=gc, row_per_entry=True,
                            out=grad_weight[:, d0:d1], segments=segments)
        grad_vals = (gv.sum(0) if deterministic else gv).to(vals.dtype)
    if mode == 2:
        grad_weight = weight_grad(indices, buf, None, F, weight.dtype, row_per_entry=True,
                                  skip=None if gv is None else (vals, gv))
    elif mode == 1:
        grad_weight = buf.to(weight.dtype)  # no copy when ACC is the weight's dtype
    elif mode == 0:
        grad_weight = weight.new_empty(0)
    return grad_vals, grad_weight, grad_bias


# ---------------------------------------------------------------------------------------------
# Row top-k: the encoder's selection of the K largest pre-activations of each row
#
# torch.topk over a TopK SAE's [B, F] pre-activations (B = 4096, F = 65536, K = 64) takes 2.0 ms in
# bf16, for 512 MB that one read takes in 0.11 ms. One program per row takes the same K entries in
# three steps: (1) the maximum of each block of C columns (one read of the row); (2) the K blocks with
# the largest maxima; (3) the K largest entries of those K * C. Every one of the row's K largest
# values lies in a chosen block: a block left out has a maximum m no larger than any chosen block's,
# so the chosen blocks hold K values >= m, and the left-out block's values (all <= m) are not needed
# to make up the K largest. Steps (2) and (3) select by radix: on order-preserving integer keys of
# the floats (every NaN above +inf, as the CPU's torch.topk ranks it), the K-th largest key is set
# one bit at a time from the top, counting the keys above each candidate; entries above it are
# taken, then entries equal to it in order until there are K. The K winners are sorted by key, then
# column. The second selection's answer lies between the K-th largest block maximum and the row's
# maximum, so it counts only the bits below those two share (for Gaussian rows in bf16 at K = 64,
# about half of the 16).


@triton.jit
def _order_key(x, BITS: tl.constexpr, INF: tl.constexpr):
    """Unsigned sort key of a float (BITS = 32 for float32, 16 for float16 / bfloat16; INF the bits
    of +inf), as uint32 in [1, 2**BITS): ordered as the floats are, every NaN (whatever its sign bit)
    above +inf, -0 just below +0. Key 0 belongs to a NaN (all bits set), which takes the NaN key
    instead, so 0 is free to mark "no entry". NaN is told from the bits, not by x != x, which the
    interpreter does not see for 16-bit floats (it holds them as integers)."""
    if BITS == 32:
        u = x.to(tl.int32, bitcast=True)
    else:
        u = x.to(tl.int16, bitcast=True).to(tl.int32)
    key = u ^ ((u >> (BITS - 1)) & ((1 << (BITS - 1)) - 1))  # negative floats: reverse their order
    key = tl.where((u & ((1 << (BITS - 1)) - 1)) > INF, (1 << (BITS - 1)) - 1, key)
    if BITS == 32:
        key = key ^ -2147483648  # the signed key, offset by 2**31 (as bits)
    else:
        key = key + (1 << (BITS - 1))
    return key.to(tl.uint32, bitcast=True)


@triton.jit
def _radix_round(ukey, k, t, bit):
    """One counting round: t with ``bit`` set if at least k keys are >= that, else t."""
    c = t | bit
    return tl.where(tl.sum((ukey >= c).to(tl.int32), axis=0) >= k, c, t)


@triton.jit
def _kth_largest(ukey, k, BITS: tl.constexpr):
    """The k-th largest of ``ukey`` (a 1-D uint32 block of keys below 2**BITS; 0 marks no entry):
    the largest t with at least k keys >= t, set one bit at a time from the top."""
    t = tl.zeros([], dtype=tl.uint32)
    for i in tl.static_range(BITS):
        t = _radix_round(ukey, k, t, 1 << (BITS - 1 - i))
    return t


@triton.jit
def _kth_largest_between(ukey, k, lo, hi, BITS: tl.constexpr):
    """_kth_largest for an answer known to lie in [lo, hi]: the bits lo and hi share are the
    answer's too, so only the bits below them take a counting round."""
    diff = lo ^ hi
    n = tl.zeros([], dtype=tl.int32)  # the bit length of diff
    for i in tl.static_range(BITS):
        n = tl.where((diff >> i) != 0, i + 1, n)
    one = tl.full([], 1, tl.uint32)
    low = tl.where(n > 0, ((one << tl.maximum(n - 1, 0).to(tl.uint32)) << 1) - 1, 0)
    t = lo - (lo & low)
    for j in range(0, n):
        t = _radix_round(ukey, k, t, one << (n - 1 - j).to(tl.uint32))
    return t


@triton.jit
def _take_k(ukey, t, k):
    """Mask of exactly k entries of ``ukey`` whose k-th largest is t: every key above t, then those
    equal to t in order until there are k."""
    above = ukey > t
    tie = ukey == t
    need = k - tl.sum(above.to(tl.int32), axis=0)
    return above | (tie & (tl.cumsum(tie.to(tl.int32), axis=0) <= need))


@triton.jit
def _row_topk_kernel(x_ptr, blk_ptr, pick_ptr, pack_ptr, out_ptr, F, stride_x, k,
                     C: tl.constexpr, NB: tl.constexpr, KP: tl.constexpr, STEP: tl.constexpr,
                     BITS: tl.constexpr, INF: tl.constexpr):
    """out[row, :k]: the columns of the k largest entries of x[row, :F], largest first (equal keys by
    column). Grid (rows,). Scratch per row: blk [NB] block maxima, pick [KP] chosen blocks, pack
    [KP] winners. C columns a block, NB >= cdiv(F, C) blocks (those past F empty), KP >= k."""
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    # 1. the largest key of each block, STEP entries a step
    o_r = tl.arange(0, STEP // C)
    o_c = tl.arange(0, C)
    for start in range(0, NB, STEP // C):
        cols = (start + o_r)[:, None] * C + o_c[None, :]
        u = tl.where(cols < F, _order_key(tl.load(x_row + cols, mask=cols < F, other=0), BITS, INF), 0)
        b_max = tl.max(u, axis=1).to(tl.int32, bitcast=True)
        tl.store(blk_ptr + row * NB + start + o_r, b_max, mask=start + o_r < NB)
    tl.debug_barrier()  # the maxima are read back below by other threads of this program
    # 2. the k blocks with the largest maxima, their ids into slots 0 .. k-1
    o_b = tl.arange(0, NB)
    ub = tl.load(blk_ptr + row * NB + o_b).to(tl.uint32, bitcast=True)
    t_blk = _kth_largest(ub, k, BITS)
    chosen = _take_k(ub, t_blk, k)
    tl.store(pick_ptr + row * KP + tl.cumsum(chosen.to(tl.int32), axis=0) - 1, o_b, mask=chosen)
    tl.debug_barrier()
    # 3. the k largest entries of the chosen blocks
    o_e = tl.arange(0, KP * C)
    blk = tl.load(pick_ptr + row * KP + o_e // C, mask=o_e // C < k, other=0)
    cols = blk * C + o_e % C
    ok = (o_e // C < k) & (cols < F)
    u = tl.where(ok, _order_key(tl.load(x_row + cols, mask=ok, other=0), BITS, INF), 0)
    # the k chosen blocks hold k keys >= t_blk, so the k-th largest entry lies in [t_blk, max]
    take = _take_k(u, _kth_largest_between(u, k, t_blk, tl.max(ub, axis=0), BITS), k)
    # sorted by key, then by column: the signed key in the high 32 bits, 2**32 - 1 - column below
    packed = ((u.to(tl.int64) - (1 << (BITS - 1))) << 32) + (4294967295 - cols.to(tl.int64))
    tl.store(pack_ptr + row * KP + tl.cumsum(take.to(tl.int32), axis=0) - 1, packed, mask=take)
    tl.debug_barrier()
    o_k = tl.arange(0, KP)
    p = tl.sort(tl.load(pack_ptr + row * KP + o_k, mask=o_k < k, other=-9223372036854775808), descending=True)
    tl.store(out_ptr + row * k + o_k, 4294967295 - (p & 4294967295), mask=o_k < k)


_TOPK_KEYS = {torch.float32: (32, 0x7F800000), torch.bfloat16: (16, 0x7F80), torch.float16: (16, 0x7C00)}  # bits, +inf


def row_topk_block(F: int, k: int) -> int:
    """Block width C (a power of two) for rows of F entries and k winners: the one with the fewest
    block maxima plus candidates (NB + KP * C) within the kernel's caps, with at least k blocks; 0
    when none fits or k is past _TOPK_MAX_K (the launcher then takes torch.topk)."""
    best, C = None, 1
    while k <= _TOPK_MAX_K and C <= F < 2**31 and cdiv(F, C) >= k:
        NB = next_pow2(cdiv(F, C))
        if NB <= _TOPK_MAX_BLOCKS and next_pow2(k) * C <= _TOPK_MAX_CANDIDATES:
            cost = NB + next_pow2(k) * C
            if best is None or cost < best[0]:
                best = (cost, C)
        C *= 2
    return 0 if best is None else best[1]


def _row_topk_warps(NB: int, NC: int, bits: int) -> int:
    """8 warps once a selection holds _TOPK_WIDE keys (NB block maxima or NC candidates), else 4;
    16-bit rows keep 4 while only the block maxima are that wide. One H200, session 42 (32-bit keys,
    the narrowed second selection): bf16 [4096, 65536] at k = 128 took 0.333 ms with 4 warps and
    0.371 with 8, and [2048, 131072] at k = 64 0.268 and 0.297; float32 [2048, 131072] at k = 64
    0.422 with 4 and 0.407 with 8, at k = 128 0.918 and 0.525. Of 16 SAE-sized shapes the rule
    missed the faster count once, by 5% (``benchmarks/logs/probe_topk_warps_session42_h200.jsonl``)."""
    return 8 if NC >= _TOPK_WIDE or (NB >= _TOPK_WIDE and bits == 32) else 4


def row_topk(x: torch.Tensor, k: int, block: int = 0, num_warps: int = 0) -> torch.Tensor:
    """int64 [N, k]: the columns of the k largest entries of each row of x [N, F], largest first.
    ``block`` and ``num_warps`` override the launch heuristics (tests and probes). float64 rows, and
    rows for which no block width fits the kernel's caps, take torch.topk."""
    N, F = x.shape
    C = block or row_topk_block(F, k)
    if x.dtype not in _TOPK_KEYS or C == 0 or N == 0:
        return x.topk(k, dim=-1, sorted=True).indices
    if C & (C - 1) or cdiv(F, C) < k:  # (an override) fewer than k blocks would leave pick slots unwritten
        raise ValueError(f"block must be a power of two leaving at least k = {k} blocks of {F} columns, got {C}")
    x = _readable(x)
    if x.stride(-1) != 1:
        x = x.contiguous()
    NB, KP = next_pow2(cdiv(F, C)), next_pow2(k)
    dev = x.device
    blk = torch.empty(N, NB, device=dev, dtype=torch.int32)  # uint32 keys, as bits
    pick = torch.empty(N, KP, device=dev, dtype=torch.int32)
    pack = torch.empty(N, KP, device=dev, dtype=torch.int64)
    out = torch.empty(N, k, device=dev, dtype=torch.int64)
    launch(_row_topk_kernel, (N,), (x, blk, pick, pack, out, F, x.stride(0), k),
           dict(C=C, NB=NB, KP=KP, STEP=max(min(_TOPK_STEP, NB * C), C), BITS=_TOPK_KEYS[x.dtype][0],
                INF=_TOPK_KEYS[x.dtype][1]),
           num_warps or _row_topk_warps(NB, KP * C, _TOPK_KEYS[x.dtype][0]))
    return out
