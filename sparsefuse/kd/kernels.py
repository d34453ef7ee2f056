"""Triton kernels for the top-K distillation losses, and the launchers that check, allocate and launch.

Notation as in ``reference.py``: N tokens, V vocab, H hidden, K teacher slots per token, s = z / T.
``ACC`` is the accumulation dtype (float32, or float64 for float64 inputs).

One math core, ``_kd_slot_terms``, turns a token's gathered student logits, teacher log-probs and
mask (plus lse_V for "full", the logsumexp over the columns off the slots for "tail") into the
per-token loss, the dense gradient coefficient A and the per-slot values; every entry point calls it:

* gathered: ``_kd_topk_kernel`` on [N, K] tiles, forward (per-token loss) and backward (gradient).
* from logits: ``_kd_row_fwd_kernel`` (online logsumexp over V in tiles, then the K gathered
  terms; saves lse, A and the slot values, O(N*K); "tail" leaves out the slot columns that
  ``_kd_mark_slots_kernel`` set in a bit map) and ``_kd_row_bwd_kernel`` (one pass that
  writes dL/dz = c * T * A * q_j over the row, then the slot values: no [N, V] fp32 temporaries).
* from hidden: tokens in chunks; per chunk a cuBLAS matmul gives the logits, the same two row
  kernels compute the loss and overwrite the chunk's logits with their gradient in place, and two
  more matmuls accumulate grad_hidden and grad_weight (in the weight's dtype). "topk" without
  cross-entropy never touches V: ``_kd_hidden_topk_kernel`` gathers the K weight rows per token.
  Gradients are computed in the forward for an incoming gradient of 1 and rescaled in the backward
  (``_kd_rescale_kernel``, a no-op on the device when the incoming gradient is 1).

Offsets: logits [N, V], the LM head [V, H] and hidden states [N, H] can each pass 2^31 elements
(16384 x 152064 logits; a 152064 x 16384 head). Program indices are int32 and a row stride below
2^31 is an int32 argument, so every row or token index is made int64 before it is multiplied by a
row length (``program_id(..).to(tl.int64)``; ids, sort entries and labels are loaded or cast to
int64); tile offsets within a row (``o_v``, ``o_h``, ``o_k``) stay int32. The GPU tests
``test_gpu_*_past_2_32`` (tests/test_kd.py) cover each case past 2^31 and 2^32.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .._dtypes import acc_dtype, tl_dtype
from .._launch import cdiv, launch, launch_tuned, next_pow2
from .._registry import INTERPRET
from .reference import IGNORE_INDEX

# Launch heuristics, in one place. A row kernel streams BLOCK_V logits per iteration.
_ROW_BLOCK_V, _ROW_WARPS = (64, 1) if INTERPRET else (4096, 8)
_ROW_MIN_PROGRAMS = 4 if INTERPRET else 4096  # backward: split rows along V until this many programs
_TOPK_TILE = 512 if INTERPRET else 4096  # gathered kernel: BLOCK_N * BLOCK_K elements
_HID_BLOCK_H, _HID_WARPS = (32, 1) if INTERPRET else (128, 2)  # H200 sweep (kd/profile.py): 1.9 ms at N*K = 2^19
_WG_BLOCK_V = 16 if INTERPRET else 64  # vocab rows per weight-gradient program (fixed: the segments depend on it)
# Slots per step of the weight-gradient kernel, fixed like BLOCK_V: it sets the order in which a row's
# slots are summed, so an autotuned BLOCK_E would make the weight gradient differ between processes
# (an H200 run found BLOCK_E = 64 and 32 differing by up to 3e-5; configs sharing BLOCK_E agreed bitwise).
_WG_BLOCK_E = 16 if INTERPRET else 32
#: The weight-gradient kernel's GPU autotune configs: tile width and pipelining only (see _WG_BLOCK_E).
WG_GPU_CONFIGS = [triton.Config(dict(BLOCK_H=h), num_warps=w, num_stages=s)
                  for h, w, s in ((128, 4, 2), (256, 8, 2), (64, 4, 3), (128, 4, 3))]
_WG_CONFIGS = [triton.Config(dict(BLOCK_H=16), num_warps=1)] if INTERPRET else WG_GPU_CONFIGS
_REDUCE_BLOCK, _REDUCE_WARPS = (64 if INTERPRET else 1024), 4
_MARK_WARPS = 1  # slot marking: one program per row, K ids
_TOPK_WARPS = 4
_SCALE_BLOCK, _SCALE_WARPS = (1024 if INTERPRET else 8192), 4
#: Upper bound on one chunk of logits in the from-hidden path: chunk rows = the largest power of two
#: <= this / (V * itemsize): 128-256 MiB a chunk (less when all N rows fit, more when one row is larger).
CHUNK_BYTES = 256 * 2**20
IGNORE = tl.constexpr(IGNORE_INDEX)


@triton.jit
def _lse_step(b_m, b_l, b_x):
    """One tile of an online logsumexp: running max b_m and sum b_l of exp(x - b_m); -inf safe."""
    b_new = tl.maximum(b_m, tl.max(b_x, 0))
    b_ref = tl.where(b_new == float("-inf"), 0.0, b_new)
    return b_new, b_l * tl.exp(b_m - b_ref) + tl.sum(tl.exp(b_x - b_ref), 0)


@triton.jit
def _lse_finish(b_m, b_l):
    """The logsumexp from ``_lse_step``'s running max and sum: -inf when every column is -inf (or
    there is none), +inf when one is +inf, NaN when one is NaN. (Both of the last two leave b_l
    NaN; "b_l > 0 or -inf" had turned them into -inf, a finite "tail" loss.)"""
    b_lse = b_m + tl.log(tl.where(b_l > 0, b_l, 1.0))
    b_lse = tl.where(b_l > 0, b_lse, tl.where(b_l == 0, float("-inf"), float("nan")))
    return tl.where(b_m == float("inf"), float("inf"), b_lse)


@triton.jit
def _kd_slot_terms(b_s, b_t, m_valid, b_lse, NORMALIZE: tl.constexpr, ACC: tl.constexpr):
    """The math core, on [R, BLOCK_K] tiles of R tokens.

    b_s: student s = z / T at the slots; b_t: teacher log-probs; m_valid: unmasked, in-range slots;
    b_lse: [R] logsumexp of s over the vocab for "full", over the columns off the valid slots
    (lse_tail) for "tail", ignored for "topk"; ACC: their dtype. Returns (loss [R] without T**2,
    A [R], corr [R, BLOCK_K], lse_V [R]) as documented in reference.py ("tail": A multiplies
    exp(s_j - lse_tail), and corr holds the slot columns' whole value); zero for tokens with no valid slot.
    """
    b_p = tl.where(m_valid, tl.exp(b_t), 0.0)  # [R, BLOCK_K]
    b_P = tl.sum(b_p, 1)  # [R]
    b_cross = tl.sum(tl.where(b_p > 0, b_p * (b_t - b_s), 0.0), 1)
    m_has = tl.sum(m_valid.to(tl.int32), 1) > 0  # [R]
    b_sm = tl.where(m_valid, b_s, float("-inf"))
    b_mx = tl.where(m_has, tl.max(b_sm, 1), 0.0)
    b_e = tl.exp(b_sm - b_mx[:, None])  # [R, BLOCK_K], 0 on invalid slots
    b_se = tl.where(m_has, tl.sum(b_e, 1), 1.0)
    b_lse_k = b_mx + tl.log(b_se)
    if NORMALIZE == 2:  # lse_V = logaddexp(lse_K, lse_tail); lse_K is -inf without a valid slot
        b_tail = b_lse
        b_lk = tl.where(m_has, b_lse_k, float("-inf"))
        b_hi = tl.maximum(b_lk, b_tail)
        b_hr = tl.where(b_hi == float("-inf"), 0.0, b_hi)
        b_lse = b_hr + tl.log(tl.exp(b_lk - b_hr) + tl.exp(b_tail - b_hr))
    if NORMALIZE == 0:
        b_loss = b_cross + b_P * b_lse_k
        b_A = tl.zeros_like(b_P)  # not b_P * 0: a teacher p that overflows (inf) made it NaN
        b_corr = b_P[:, None] * b_e / b_se[:, None] - b_p
    else:
        b_loss = b_cross + b_P * b_lse
        if NORMALIZE == 1:
            b_A = b_P
            b_corr = -b_p
        else:
            # log(1 - Q) = lse_tail - lse_V, exact however small 1 - Q is. With no column off the
            # slots (K = V) 1 - Q = 0 is taken as the smallest normal number of ACC (finfo.tiny):
            # the tail term saturates and passes no gradient.
            if ACC == tl.float64:  # (tl.full: a bare float literal would be rounded to fp32)
                b_log_tiny = tl.full([], -708.3964185322641, ACC)
            else:
                b_log_tiny = tl.full([], -87.3365447505531, ACC)
            m_none = b_tail == float("-inf")
            b_log_omq = tl.where(m_none, b_log_tiny, b_tail - b_lse)
            b_omp = tl.maximum(1.0 - b_P, 0.0)
            b_log_omp = tl.log(tl.where(b_omp > 0, b_omp, 1.0))
            b_loss += tl.where(b_omp > 0, b_omp * (b_log_omp - b_log_omq), 0.0)
            # The gradient never forms r = (1 - P) / (1 - Q), which grows without bound as 1 - Q -> 0:
            # slot columns (P + (1 - P)) q_k - p_k, and off the slots A * exp(s_j - lse_tail) with
            # A = P (1 - Q) - (1 - P) Q (the tail bucket's q - p, spread as the student's softmax there).
            b_omp_g = tl.where(m_none, 0.0, b_omp)
            b_A = b_P * tl.exp(b_tail - b_lse) - b_omp_g * tl.exp(b_lse_k - b_lse)
            b_corr = (b_P + b_omp_g)[:, None] * tl.exp(b_s - b_lse[:, None]) - b_p
    b_corr = tl.where(m_valid, b_corr, 0.0)
    return tl.where(m_has, b_loss, 0.0), tl.where(m_has, b_A, 0.0), b_corr, b_lse


@triton.jit
def _load_slots(ids_ptr, t_ptr, m_ptr, i_n, K, V, ACC: tl.constexpr, BLOCK_K: tl.constexpr):
    """Slots of token i_n: (o_k, m_k, ids, t, valid, bad); an unmasked id outside [0, V) is bad."""
    o_k = tl.arange(0, BLOCK_K)
    m_k = o_k < K
    b_ids = tl.load(ids_ptr + i_n * K + o_k, mask=m_k, other=0).to(tl.int64)  # [BLOCK_K]
    b_t = tl.load(t_ptr + i_n * K + o_k, mask=m_k, other=0).to(ACC)  # [BLOCK_K]
    m_on = m_k & (tl.load(m_ptr + i_n * K + o_k, mask=m_k, other=0) != 0)
    m_in = (b_ids >= 0) & (b_ids < V)
    return o_k, m_k, b_ids, b_t, m_on & m_in, m_on & ~m_in


@triton.jit
def _kd_topk_kernel(
    z_ptr,  # [N, K] gathered student logits
    t_ptr,  # [N, K] teacher log-probs
    m_ptr,  # [N, K] uint8 mask
    tok_ptr,  # [N] ACC out: per-token loss (forward)
    flag_ptr,  # [N] ACC out: 1 if the token has an unmasked slot (forward)
    g_ptr,  # [N, K] out, logits dtype: gradient (IS_BWD)
    gl_ptr,  # [] incoming gradient of the loss (IS_BWD)
    gt_ptr,  # [N] incoming gradient of the per-token loss (HAS_GT)
    scale_ptr,  # [2] ACC: per-token weight of the reduction (IS_BWD)
    N,
    K,
    inv_t: tl.float64,  # 1 / T (typed: Triton would make a plain float argument fp32)
    temperature: tl.float64,
    IS_BWD: tl.constexpr,
    HAS_GT: tl.constexpr,
    ACC: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    inv_t, temperature = tl.full([], inv_t, ACC), tl.full([], temperature, ACC)
    o_n = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    o_k = tl.arange(0, BLOCK_K)
    m_n = o_n < N
    m_2 = m_n[:, None] & (o_k < K)[None, :]
    o_2 = o_n[:, None] * K + o_k[None, :]  # [BLOCK_N, BLOCK_K]
    b_s = tl.load(z_ptr + o_2, mask=m_2, other=0).to(ACC) * inv_t
    b_t = tl.load(t_ptr + o_2, mask=m_2, other=0).to(ACC)
    m_valid = m_2 & (tl.load(m_ptr + o_2, mask=m_2, other=0) != 0)
    b_loss, b_A, b_corr, _ = _kd_slot_terms(b_s, b_t, m_valid, tl.zeros([BLOCK_N], dtype=ACC), 0, ACC)
    if IS_BWD:
        b_f = tl.zeros([BLOCK_N], dtype=ACC) + tl.load(gl_ptr).to(ACC) * tl.load(scale_ptr).to(ACC)
        if HAS_GT:
            b_f += tl.load(gt_ptr + o_n, mask=m_n, other=0).to(ACC)
        tl.store(g_ptr + o_2, (b_corr * (b_f * temperature)[:, None]).to(g_ptr.dtype.element_ty), mask=m_2)
    else:
        tl.store(tok_ptr + o_n, b_loss * (temperature * temperature), mask=m_n)
        tl.store(flag_ptr + o_n, (tl.sum(m_valid.to(tl.int32), 1) > 0).to(ACC), mask=m_n)


@triton.jit
def _kd_mark_slots_kernel(ids_ptr, t_ptr, m_ptr, bit_ptr, K, V, stride_bn, ACC: tl.constexpr, BLOCK_K: tl.constexpr):
    """"tail": set token i_n's valid slot columns in its row of the zeroed bit map (``_slot_bits``), which
    the row forward's sweep tests (a word load and a mask per 32 columns) to leave the slots out of lse_tail.
    The word after the map (at stride_bn - 32) counts the slots whose column another slot had marked
    already: a valid id the token repeats (index checks off), which the row forward poisons."""
    i_n = tl.program_id(0).to(tl.int64)
    _, _, b_ids, _, m_valid, _ = _load_slots(ids_ptr, t_ptr, m_ptr, i_n, K, V, ACC, BLOCK_K)
    b_ids = b_ids.to(tl.int32)
    b_bit = tl.full([BLOCK_K], 1, tl.int32) << (b_ids & 31)
    b_old = tl.atomic_or(bit_ptr + i_n * stride_bn + (b_ids >> 5), b_bit, mask=m_valid, sem="relaxed")  # shared words
    m_rep = m_valid & ((b_old & b_bit) != 0)  # atomics on one word are ordered: one of two equal ids sees the other
    tl.store(bit_ptr + i_n * stride_bn + stride_bn - 32, tl.sum(m_rep.to(tl.int32), 0))


@triton.jit
def _kd_row_fwd_kernel(
    z_ptr,  # [N, V], row stride stride_zn
    ids_ptr,  # [N, K] int32 | int64
    t_ptr,  # [N, K]
    m_ptr,  # [N, K] uint8
    lab_ptr,  # [N] int labels (HAS_CE)
    tok_ptr,  # [N] ACC out: per-token KD loss (T**2 included)
    flag_ptr,  # [N] ACC out: 1 if the token has an unmasked slot
    lse_ptr,  # [N] ACC out: logsumexp_j s_j ("full"), over the columns off the valid slots ("tail")
    a_ptr,  # [N] ACC out: dense coefficient A
    corr_ptr,  # [N, K] ACC out: slot corrections ("tail": the slot columns' values)
    ce_ptr,  # [N] ACC out: per-token cross-entropy (HAS_CE)
    lse1_ptr,  # [N] ACC out: logsumexp_j z_j (HAS_CE)
    bit_ptr,  # [N, W] int32, row stride stride_bn: a bit per column, set at the valid slots ("tail")
    V,
    K,
    stride_zn,
    stride_bn,
    inv_t: tl.float64,  # 1 / T (typed: Triton would make a plain float argument fp32)
    temperature: tl.float64,
    NORMALIZE: tl.constexpr,
    HAS_CE: tl.constexpr,
    SEP_CE: tl.constexpr,  # the cross-entropy needs its own logsumexp (T != 1 or "topk")
    ACC: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    inv_t, temperature = tl.full([], inv_t, ACC), tl.full([], temperature, ACC)
    i_n = tl.program_id(0).to(tl.int64)
    p_z = z_ptr + i_n * stride_zn
    b_lse = 0.0
    b_lse1 = 0.0
    if NORMALIZE > 0 or SEP_CE:
        # Online logsumexp, one tile max per iteration: one exp per element (two with SEP_CE and KD).
        # "tail" sums only the columns off the valid slots (lse_V comes from it and lse_K after), so
        # that 1 - Q keeps its relative precision however confident the student is.
        b_m = tl.full([], float("-inf"), ACC)
        b_l = tl.zeros([], dtype=ACC)
        b_m1 = tl.full([], float("-inf"), ACC)
        b_l1 = tl.zeros([], dtype=ACC)
        for i_v in range(0, V, BLOCK_V):
            if NORMALIZE == 2:
                # The tile as [BLOCK_V / 32, 32], a row per word of the slot bit map (_kd_mark_slots_kernel),
                # so that the words load as one vector; the reductions below do not care about order
                # (can_reorder). "full" keeps the flat tile: 0.3% faster on an H100.
                o_w = i_v // 32 + tl.arange(0, BLOCK_V // 32)
                o_v = o_w[:, None] * 32 + tl.arange(0, 32)[None, :]
                b_z = tl.load(p_z + o_v, mask=o_v < V, other=float("-inf")).to(ACC)  # [BLOCK_V / 32, 32]
                b_word = tl.load(bit_ptr + i_n * stride_bn + o_w, mask=o_w * 32 < V, other=0)
                m_slot = ((b_word[:, None] >> tl.arange(0, 32)[None, :]) & 1) != 0
                b_x = tl.reshape(tl.where(m_slot, float("-inf"), b_z * inv_t), [BLOCK_V], can_reorder=True)
                b_z = tl.reshape(b_z, [BLOCK_V], can_reorder=True)
            else:
                o_v = i_v + tl.arange(0, BLOCK_V)
                b_z = tl.load(p_z + o_v, mask=o_v < V, other=float("-inf")).to(ACC)  # [BLOCK_V]
                b_x = b_z * inv_t
            if NORMALIZE > 0:
                b_m, b_l = _lse_step(b_m, b_l, b_x)
            if SEP_CE:
                b_m1, b_l1 = _lse_step(b_m1, b_l1, b_z)
        if NORMALIZE > 0:  # ("tail" with every column a slot sums nothing: -inf)
            b_lse = _lse_finish(b_m, b_l)
        if SEP_CE:
            b_lse1 = _lse_finish(b_m1, b_l1)
    # the slots after the sweep: loaded before it, they cost "full" 4% on an H100
    o_k, m_k, b_ids, b_t, m_valid, m_bad = _load_slots(ids_ptr, t_ptr, m_ptr, i_n, K, V, ACC, BLOCK_K)
    if NORMALIZE == 2:
        # A repeated valid id (index checks off; _kd_mark_slots_kernel counted them): the token's K + 1
        # outcomes are not distinct, so it is poisoned as for an id outside [0, V): its loss, A and
        # valid slots' values NaN (reference._slots). Counting marked columns in the sweep cost the
        # forward 42% on an H100, and a [K, K] comparison here 25%.
        m_dup = tl.load(bit_ptr + i_n * stride_bn + stride_bn - 32) != 0
        m_bad = m_bad | (m_valid & m_dup)
    b_s = tl.load(p_z + b_ids, mask=m_valid, other=0).to(ACC) * inv_t  # [BLOCK_K]
    b_lse_r = tl.zeros([1], dtype=ACC) + b_lse
    b_loss, b_A, b_corr, b_lse_v = _kd_slot_terms(b_s[None, :], b_t[None, :], m_valid[None, :], b_lse_r, NORMALIZE,
                                                  ACC)
    b_lse_v = tl.sum(b_lse_v, 0)
    if NORMALIZE == 1:
        tl.store(lse_ptr + i_n, b_lse_v)
    if NORMALIZE == 2:  # the backward's off-slot q_j divide by lse_tail (lse_V when no column is off the slots)
        tl.store(lse_ptr + i_n, tl.where(b_lse == float("-inf"), b_lse_v, b_lse))
    b_loss = tl.sum(b_loss, 0) * (temperature * temperature)
    b_loss = tl.where(tl.sum(m_bad.to(tl.int32), 0) > 0, float("nan"), b_loss)
    tl.store(tok_ptr + i_n, b_loss)
    tl.store(flag_ptr + i_n, (tl.sum(m_valid.to(tl.int32), 0) > 0).to(ACC))
    tl.store(a_ptr + i_n, tl.where(tl.sum(m_bad.to(tl.int32), 0) > 0, float("nan"), tl.sum(b_A, 0)))
    tl.store(corr_ptr + i_n * K + o_k, tl.where(m_bad, float("nan"), tl.sum(b_corr, 0)), mask=m_k)
    if HAS_CE:
        if not SEP_CE:
            b_lse1 = b_lse_v
        i_lab = tl.load(lab_ptr + i_n).to(tl.int64)
        has = i_lab != IGNORE
        ok = has & (i_lab >= 0) & (i_lab < V)
        b_zl = tl.load(p_z + i_lab, mask=ok, other=0).to(ACC)
        b_ce = tl.where(has, b_lse1 - b_zl, 0.0)
        tl.store(ce_ptr + i_n, tl.where(has & ~ok, float("nan"), b_ce))
        tl.store(lse1_ptr + i_n, b_lse1)


@triton.jit
def _kd_row_bwd_kernel(
    z_ptr,  # [N, V], row stride stride_zn
    g_ptr,  # [N, V] out, row stride stride_gn; may be z_ptr (the from-hidden path works in place)
    ids_ptr,  # [N, K]
    m_ptr,  # [N, K] uint8
    lab_ptr,  # [N] (HAS_CE)
    lse_ptr,  # [N] ACC (NORMALIZE > 0): the dense term is A * exp(s_j - lse)
    a_ptr,  # [N] ACC
    corr_ptr,  # [N, K] ACC
    lse1_ptr,  # [N] ACC (HAS_CE)
    gl_ptr,  # [] incoming gradient of the loss (HAS_GL; else 1)
    gt_ptr,  # [N] incoming gradient of the per-token loss (HAS_GT)
    scale_ptr,  # [2] ACC: per-token weights of the KD and cross-entropy terms
    V,
    K,
    stride_zn,
    stride_gn,
    inv_t: tl.float64,  # 1 / T (typed: Triton would make a plain float argument fp32)
    temperature: tl.float64,
    v_per_prog,
    NORMALIZE: tl.constexpr,
    HAS_CE: tl.constexpr,
    HAS_GL: tl.constexpr,
    HAS_GT: tl.constexpr,
    ACC: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """dL/dz for columns [v_lo, v_hi) of row i_n: dense c_kd*T*A*q_j (+ c_ce*softmax(z)_j), then the
    slot and label columns. Those few values are read before the dense sweep (which may overwrite z
    in place), with a barrier between, and stored after another; slots sharing a column carry the
    same total, so duplicate stores agree. "topk" and "full" slots add their corrections to the dense term;
    "tail" slots carry their whole value (A there is the coefficient of the columns off the slots)."""
    inv_t, temperature = tl.full([], inv_t, ACC), tl.full([], temperature, ACC)
    i_n = tl.program_id(0).to(tl.int64)
    v_lo = tl.program_id(1).to(tl.int64) * v_per_prog
    v_hi = tl.minimum(v_lo + v_per_prog, V)
    p_z = z_ptr + i_n * stride_zn
    p_g = g_ptr + i_n * stride_gn
    b_f = tl.load(scale_ptr).to(ACC)
    b_fc = tl.load(scale_ptr + 1).to(ACC)
    if HAS_GL:
        b_gl = tl.load(gl_ptr).to(ACC)
        b_f *= b_gl
        b_fc *= b_gl
    if HAS_GT:
        b_f += tl.load(gt_ptr + i_n).to(ACC)
    b_ckd = b_f * temperature
    b_a = tl.load(a_ptr + i_n)
    b_cA = b_ckd * b_a
    # A = 0 (a token with no unmasked slot): no dense term at all, as in reference.dense_grad.
    # 0 * exp(x) is not enough: a padding row of -inf logits has lse = -inf, and x = -inf - -inf is
    # NaN. A NaN A still makes the row NaN (NaN != 0).
    m_dense = b_a != 0
    # "topk" has no dense term and A = 0, except NaN for a token with an out-of-range id (index
    # checks off): adding c * A to every element makes that token's whole row NaN, as in the other modes.
    b_nan = 0.0
    if NORMALIZE == 0:
        b_nan = b_cA
    b_lse = 0.0
    if NORMALIZE > 0:
        b_lse = tl.load(lse_ptr + i_n)
    b_lse1 = 0.0
    i_lab = tl.full([], IGNORE, tl.int64)
    if HAS_CE:
        b_lse1 = tl.load(lse1_ptr + i_n)
        i_lab = tl.load(lab_ptr + i_n).to(tl.int64)
        # a label outside [0, V) that is not ignored (index checks off) makes the token's loss NaN
        # in the forward; its whole gradient row is NaN too, as for an out-of-range id
        b_nan += tl.where((i_lab != IGNORE) & ((i_lab < 0) | (i_lab >= V)), float("nan"), 0.0)
    o_k = tl.arange(0, BLOCK_K)
    m_k = o_k < K
    b_ids = tl.load(ids_ptr + i_n * K + o_k, mask=m_k, other=-1).to(tl.int64)  # [BLOCK_K]
    m_on = m_k & (tl.load(m_ptr + i_n * K + o_k, mask=m_k, other=0) != 0)
    b_corr = tl.load(corr_ptr + i_n * K + o_k, mask=m_k, other=0)  # [BLOCK_K]
    b_ids = tl.where(m_on, b_ids, -1)
    # slots sharing an id: each carries the sum over the group  [BLOCK_K, BLOCK_K]
    m_eq = (b_ids[:, None] == b_ids[None, :]) & m_on[None, :]
    b_tot = tl.sum(tl.where(m_eq, b_corr[None, :], 0.0), 1) * b_ckd  # [BLOCK_K]
    m_mine = m_on & (b_ids >= v_lo) & (b_ids < v_hi)
    b_zk = tl.load(p_z + b_ids, mask=m_mine, other=0).to(ACC)
    b_vk = b_tot + b_nan
    if NORMALIZE == 1:
        b_vk += tl.where(m_dense, b_cA * tl.exp(b_zk * inv_t - b_lse), 0.0)
    if NORMALIZE == 2:
        b_vk += b_cA * 0.0  # the NaN of a token with an out-of-range id
    if HAS_CE:
        b_fc = tl.where(i_lab != IGNORE, b_fc, 0.0)  # an ignored token has no cross-entropy term
        m_lab = (i_lab != IGNORE) & (i_lab >= v_lo) & (i_lab < v_hi)
        b_zl = tl.load(p_z + i_lab, mask=m_lab, other=0).to(ACC)
        b_vk += b_fc * tl.exp(b_zk - b_lse1) - tl.where(b_ids == i_lab, b_fc, 0.0)
        b_vl = b_fc * tl.exp(b_zl - b_lse1) - b_fc + b_nan
        m_lab_slot = m_on & (b_ids == i_lab)
        b_vl += tl.sum(tl.where(m_lab_slot, b_corr, 0.0), 0) * b_ckd
        if NORMALIZE == 1:
            b_vl += tl.where(m_dense, b_cA * tl.exp(b_zl * inv_t - b_lse), 0.0)
        if NORMALIZE == 2:  # the dense term unless the label is a slot, whose value already has it
            b_xl = b_zl * inv_t - b_lse
            b_vl += tl.where(tl.sum(m_lab_slot.to(tl.int32), 0) > 0, b_cA * 0.0,
                             tl.where(m_dense, b_cA * tl.exp(tl.where(b_xl > 0, 0.0, b_xl)), 0.0))
    # In place (g_ptr == z_ptr), another warp's sweep may store over a slot or label column: every
    # warp's loads of those columns above must be done first.
    tl.debug_barrier()
    for i_v in range(v_lo, v_hi, BLOCK_V):
        o_v = i_v + tl.arange(0, BLOCK_V)
        m_v = o_v < v_hi
        b_g = tl.zeros([BLOCK_V], dtype=ACC) + b_nan
        if NORMALIZE > 0 or HAS_CE:
            b_z = tl.load(p_z + o_v, mask=m_v, other=0).to(ACC)  # [BLOCK_V]
            if NORMALIZE > 0:
                b_x = b_z * inv_t - b_lse
                if NORMALIZE == 2:  # <= 0 off the slots; the slot columns (overwritten below) must not overflow
                    b_x = tl.where(b_x > 0, 0.0, b_x)
                b_g += tl.where(m_dense, b_cA * tl.exp(b_x), 0.0)
            if HAS_CE:
                b_g += b_fc * tl.exp(b_z - b_lse1)
        tl.store(p_g + o_v, b_g.to(g_ptr.dtype.element_ty), mask=m_v)
    tl.debug_barrier()
    tl.store(p_g + b_ids, b_vk.to(g_ptr.dtype.element_ty), mask=m_mine)
    if HAS_CE:
        tl.store(p_g + i_lab, b_vl.to(g_ptr.dtype.element_ty), mask=m_lab)


@triton.jit
def _kd_hidden_topk_kernel(
    h_ptr,  # [N, H] hidden states (contiguous)
    w_ptr,  # [V, H] lm-head weight, row stride stride_wv
    b_ptr,  # [V] bias (HAS_BIAS)
    ids_ptr,  # [N, K]
    t_ptr,  # [N, K]
    m_ptr,  # [N, K] uint8
    tok_ptr,  # [N] ACC out: per-token loss
    flag_ptr,  # [N] ACC out
    g_ptr,  # [N, K] ACC out: dL/dz at the slots (NEED_GRAD)
    gh_ptr,  # [N, H] out: grad_hidden (NEED_GH)
    scale_ptr,  # [2] ACC
    H,
    V,
    K,
    stride_wv,
    inv_t: tl.float64,  # 1 / T (typed: Triton would make a plain float argument fp32)
    temperature: tl.float64,
    HAS_BIAS: tl.constexpr,
    NEED_GRAD: tl.constexpr,
    NEED_GH: tl.constexpr,
    ACC: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    """"topk" from hidden states: z_k = <h, W[i_k]> (+ b[i_k]) for the K slots only, then the math
    core, then grad_hidden = sum_k g_k W[i_k] in a second sweep over the same rows."""
    inv_t, temperature = tl.full([], inv_t, ACC), tl.full([], temperature, ACC)
    i_n = tl.program_id(0).to(tl.int64)
    o_k, m_k, b_ids, b_t, m_valid, m_bad = _load_slots(ids_ptr, t_ptr, m_ptr, i_n, K, V, ACC, BLOCK_K)
    p_w = w_ptr + b_ids * stride_wv  # [BLOCK_K]
    b_acc = tl.zeros([BLOCK_K, BLOCK_H], dtype=ACC)  # products summed over tiles, reduced once at the end
    for i_h in range(0, H, BLOCK_H):
        o_h = i_h + tl.arange(0, BLOCK_H)
        m_h = o_h < H
        b_h = tl.load(h_ptr + i_n * H + o_h, mask=m_h, other=0).to(ACC)  # [BLOCK_H]
        b_w = tl.load(p_w[:, None] + o_h[None, :], mask=m_valid[:, None] & m_h[None, :], other=0).to(ACC)
        b_acc += b_w * b_h[None, :]  # [BLOCK_K, BLOCK_H]
    b_z = tl.sum(b_acc, 1)  # [BLOCK_K]
    if HAS_BIAS:
        b_z += tl.load(b_ptr + b_ids, mask=m_valid, other=0).to(ACC)
    b_s = b_z * inv_t
    b_loss, b_A, b_corr, _ = _kd_slot_terms(b_s[None, :], b_t[None, :], m_valid[None, :], tl.zeros([1], dtype=ACC), 0,
                                            ACC)
    b_loss = tl.sum(b_loss, 0) * (temperature * temperature)
    any_bad = tl.sum(m_bad.to(tl.int32), 0) > 0
    tl.store(tok_ptr + i_n, tl.where(any_bad, float("nan"), b_loss))
    tl.store(flag_ptr + i_n, (tl.sum(m_valid.to(tl.int32), 0) > 0).to(ACC))
    if NEED_GRAD:
        b_g = tl.sum(b_corr, 0) * (tl.load(scale_ptr).to(ACC) * temperature)  # [BLOCK_K]
        b_g = tl.where(m_bad, float("nan"), b_g)
        tl.store(g_ptr + i_n * K + o_k, b_g, mask=m_k)
        if NEED_GH:
            for i_h in range(0, H, BLOCK_H):
                o_h = i_h + tl.arange(0, BLOCK_H)
                m_h = o_h < H
                b_w = tl.load(p_w[:, None] + o_h[None, :], mask=m_valid[:, None] & m_h[None, :], other=0).to(ACC)
                b_gh = tl.sum(b_w * b_g[:, None], 0)  # [BLOCK_H]
                b_gh = tl.where(any_bad, float("nan"), b_gh)
                tl.store(gh_ptr + i_n * H + o_h, b_gh.to(gh_ptr.dtype.element_ty), mask=m_h)


@triton.autotune(configs=_WG_CONFIGS, key=["H", "K"])
@triton.jit
def _kd_weight_grad_kernel(
    seg_ptr,  # [n_tiles + 1] int64: vocab tile i owns the sorted entries seg[i] .. seg[i + 1] - 1
    key_ptr,  # [M] int64 sorted tile keys of the entries: id v is slot v // n_tiles of tile v % n_tiles
    order_ptr,  # [M] int64 flat entry ids (n * K + k) in that order
    g_ptr,  # [N * K] ACC: dL/dz at each slot
    h_ptr,  # [N, H] hidden states
    gw_ptr,  # [V, H] out
    V,
    H,
    K,
    alpha,  # factor applied to the sums before the store (a power of two: exact)
    SPLIT: tl.constexpr,  # 16-bit h: feed g to the matrix unit as hi + lo 16-bit parts
    ACC: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    """gw[v] = alpha * sum over slots e with id v of g[e] * h[token(e)], for a tile of BLOCK_V vocab rows.

    Tile t holds the ids t, t + n_tiles, t + 2 n_tiles, ... (n_tiles = cdiv(V, BLOCK_V)): a teacher's
    top-K ids are far from uniform, and in a BPE vocabulary the frequent tokens have small ids, so
    tiles of consecutive ids put most slots in the first tile and serialise them in one program (2x
    the whole step on a Zipf-distributed teacher, ``scripts/probe_skew.py``). Interleaved, the
    frequent ids land in different tiles.

    The tile's slots are contiguous in sorted order. Each step takes BLOCK_E of them: a one-hot
    [BLOCK_V, BLOCK_E] matrix carrying g times the gathered [BLOCK_E, BLOCK_H] hidden rows, on the
    matrix unit. Every weight-gradient row is written once (zeros where no slot points), in a fixed
    order: no atomics, no zero-fill, deterministic.
    """
    i_v = tl.program_id(0).to(tl.int64)
    o_v = i_v * BLOCK_V + tl.arange(0, BLOCK_V)  # [BLOCK_V] tile keys
    o_id = tl.arange(0, BLOCK_V).to(tl.int64) * tl.cdiv(V, BLOCK_V) + i_v  # [BLOCK_V] their vocab ids
    o_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)  # [BLOCK_H]
    m_h = o_h < H
    i_lo = tl.load(seg_ptr + i_v)
    i_hi = tl.load(seg_ptr + i_v + 1)
    b_acc = tl.zeros([BLOCK_V, BLOCK_H], dtype=ACC)
    for i_e in range(i_lo, i_hi, BLOCK_E):
        o_e = i_e + tl.arange(0, BLOCK_E)
        m_e = o_e < i_hi
        b_key = tl.load(key_ptr + o_e, mask=m_e, other=-1)  # [BLOCK_E]
        b_ent = tl.load(order_ptr + o_e, mask=m_e, other=0)
        b_g = tl.load(g_ptr + b_ent, mask=m_e, other=0).to(ACC)
        b_h = tl.load(h_ptr + (b_ent // K)[:, None] * H + o_h[None, :], mask=m_e[:, None] & m_h[None, :], other=0)
        b_a = tl.where(o_v[:, None] == b_key[None, :], b_g[None, :], 0.0)  # [BLOCK_V, BLOCK_E]
        if SPLIT:
            b_hi = b_a.to(b_h.dtype)
            b_acc = tl.dot(b_hi, b_h, b_acc, out_dtype=ACC)
            b_acc = tl.dot((b_a - b_hi.to(ACC)).to(b_h.dtype), b_h, b_acc, out_dtype=ACC)
        else:
            b_acc = tl.dot(b_a.to(b_h.dtype), b_h, b_acc, input_precision="ieee", out_dtype=ACC)
    p_out = gw_ptr + o_id[:, None] * H + o_h[None, :]
    tl.store(p_out, (b_acc * alpha).to(gw_ptr.dtype.element_ty), mask=(o_id < V)[:, None] & m_h[None, :])


@triton.jit
def _kd_reduce_kernel(
    tok_ptr,  # [N] ACC per-token KD loss (HAS_TOK)
    ce_ptr,  # [N] ACC per-token cross-entropy (HAS_CE and HAS_TOK)
    flag_ptr,  # [N] tokens with an unmasked slot (ACC or bool)
    lab_ptr,  # [N] labels (HAS_CE)
    items_ptr,  # [] num_items_in_batch (HAS_ITEMS)
    loss_ptr,  # [] ACC out (HAS_TOK)
    scale_ptr,  # [2] ACC out: per-token weights of the KD and CE terms
    N,
    items_value: tl.float64,  # (typed: Triton would make a plain float argument fp32)
    ce_weight: tl.float64,
    REDUCTION: tl.constexpr,  # 0 sum, 1 mean over tokens with an unmasked slot (CE: over labels), 2 items
    HAS_TOK: tl.constexpr,
    HAS_CE: tl.constexpr,
    HAS_ITEMS: tl.constexpr,
    ACC: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """One program: the reduction's denominators (on the device, no host sync) and the loss, summed
    in a fixed order."""
    items_value, ce_weight = tl.full([], items_value, ACC), tl.full([], ce_weight, ACC)
    b_n = tl.zeros([BLOCK], dtype=ACC)
    b_nc = tl.zeros([BLOCK], dtype=ACC)
    b_s = tl.zeros([BLOCK], dtype=ACC)
    b_sc = tl.zeros([BLOCK], dtype=ACC)
    for i in range(0, N, BLOCK):
        o = i + tl.arange(0, BLOCK)
        m = o < N
        b_n += tl.load(flag_ptr + o, mask=m, other=0).to(ACC)
        if HAS_CE:
            b_nc += (tl.load(lab_ptr + o, mask=m, other=IGNORE) != IGNORE).to(ACC)
        if HAS_TOK:
            b_s += tl.load(tok_ptr + o, mask=m, other=0).to(ACC)
            if HAS_CE:
                b_sc += tl.load(ce_ptr + o, mask=m, other=0).to(ACC)
    if REDUCTION == 1:
        b_w = 1.0 / tl.maximum(tl.sum(b_n, 0), 1.0)
        b_wc = ce_weight / tl.maximum(tl.sum(b_nc, 0), 1.0)
    elif REDUCTION == 2:
        if HAS_ITEMS:
            b_items = tl.load(items_ptr).to(ACC)
        else:
            b_items = items_value + tl.sum(b_n, 0) * 0.0
        b_w = 1.0 / b_items
        b_wc = ce_weight / b_items
    else:
        b_w = 1.0 + tl.sum(b_n, 0) * 0.0
        b_wc = ce_weight + tl.sum(b_n, 0) * 0.0
    if not HAS_CE:
        b_wc = b_wc * 0.0
    tl.store(scale_ptr, b_w)
    tl.store(scale_ptr + 1, b_wc)
    if HAS_TOK:
        tl.store(loss_ptr, tl.sum(b_s, 0) * b_w + tl.sum(b_sc, 0) * b_wc)


@triton.jit
def _kd_rescale_kernel(
    x_ptr,  # [M] gradient, scaled in place
    g_ptr,  # [] incoming gradient
    applied_ptr,  # [1] ACC: the factor x carries now
    M,
    ACC: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """x *= g / applied; nothing to do (and no memory traffic) when the two are equal."""
    b_f = tl.load(g_ptr).to(ACC) / tl.load(applied_ptr).to(ACC)
    if b_f != 1.0:
        o = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        m = o < M
        b_x = tl.load(x_ptr + o, mask=m, other=0)
        tl.store(x_ptr + o, (b_x.to(ACC) * b_f).to(x_ptr.dtype.element_ty), mask=m)


# ---------------------------------------------------------------------------------------------
# Launchers. Inputs are shape/dtype-checked by the public functions and index-range-checked by the
# ops (ops.py); these make the small operands contiguous, allocate and launch.


def _u8(mask):
    mask = mask.contiguous()
    return mask.view(torch.uint8) if mask.dtype == torch.bool else (mask != 0).view(torch.uint8)


def _topk_config(K):
    block_k = next_pow2(max(K, 1))
    return dict(BLOCK_K=block_k, BLOCK_N=max(1, min(64, _TOPK_TILE // block_k)))


def reduce(tok, ce, flags, labels, reduction, num_items, num_items_value, ce_weight, acc):
    """(loss [] or None, scale [2]) from per-token terms; see _kd_reduce_kernel."""
    dev = flags.device
    scale = torch.empty(2, device=dev, dtype=acc)
    loss = torch.empty((), device=dev, dtype=acc) if tok is not None else None
    args = (tok, ce, flags, labels, num_items, loss, scale, flags.shape[0], float(num_items_value), float(ce_weight))
    meta = dict(REDUCTION=reduction, HAS_TOK=tok is not None, HAS_CE=labels is not None,
                HAS_ITEMS=num_items is not None, ACC=tl_dtype(acc), BLOCK=_REDUCE_BLOCK)
    launch(_kd_reduce_kernel, (1,), args, meta, _REDUCE_WARPS)
    return loss, scale


def topk_fwd(z, t, mask, temperature, reduction, num_items, num_items_value):
    """(loss [], per-token loss [N], scale [2]) for gathered logits z [N, K]."""
    N, K = z.shape
    acc = acc_dtype(z, t)
    tok = torch.empty(N, device=z.device, dtype=acc)
    flags = torch.empty(N, device=z.device, dtype=acc)
    if N:
        cfg = _topk_config(K)
        launch(_kd_topk_kernel, (cdiv(N, cfg["BLOCK_N"]),),
               (z.contiguous(), t.contiguous(), _u8(mask), tok, flags, None, None, None, None, N, K,
                1.0 / temperature, float(temperature)),
               dict(IS_BWD=False, HAS_GT=False, ACC=tl_dtype(acc), **cfg), _TOPK_WARPS)
    loss, scale = reduce(tok, None, flags, None, reduction, num_items, num_items_value, 0.0, acc)
    return loss, tok, scale


def topk_bwd(grad_loss, grad_tok, z, t, mask, scale, temperature):
    N, K = z.shape
    g = torch.empty(N, K, device=z.device, dtype=z.dtype)
    if N:
        cfg = _topk_config(K)
        launch(_kd_topk_kernel, (cdiv(N, cfg["BLOCK_N"]),),
               (z.contiguous(), t.contiguous(), _u8(mask), None, None, g, grad_loss.contiguous(),
                None if grad_tok is None else grad_tok.contiguous(), scale, N, K, 1.0 / temperature,
                float(temperature)),
               dict(IS_BWD=True, HAS_GT=grad_tok is not None, ACC=tl_dtype(scale.dtype), **cfg), _TOPK_WARPS)
    return g


def _rows(z):
    return z if z.stride(-1) == 1 else z.contiguous()


def _slot_bits(n, V, normalize, device):
    """The "tail" forward's bit map of the slot columns, [n, W] int32 (None otherwise): 32 columns a word,
    rows padded to whole 128-byte lines (about n * V / 8 bytes), then one more line whose first word
    counts the token's repeated ids. _row_fwd zeroes and fills it for each launch, so one map serves
    every chunk of rows."""
    return torch.empty(n, cdiv(V, 1024) * 32 + 32, device=device, dtype=torch.int32) if normalize == 2 else None


def _row_fwd(z, ids, t, mask_u8, labels, normalize, temperature, acc, outs):
    """Launch the row forward kernel over the rows of z (a [n, V] view)."""
    n, V = z.shape
    K = ids.shape[1]
    tok, flags, lse, A, corr, ce, lse1, bits = outs
    has_ce = labels is not None
    if n == 0:
        return
    if normalize == 2:
        bits = bits[:n].zero_()
        launch(_kd_mark_slots_kernel, (n,), (ids, t, mask_u8, bits, K, V, bits.stride(0)),
               dict(ACC=tl_dtype(acc), BLOCK_K=next_pow2(K)), _MARK_WARPS)
    launch(_kd_row_fwd_kernel, (n,),
           (z, ids, t, mask_u8, labels, tok, flags, lse, A, corr, ce, lse1, bits, V, K, z.stride(0),
            0 if bits is None else bits.stride(0), 1.0 / temperature, float(temperature)),
           dict(NORMALIZE=normalize, HAS_CE=has_ce, SEP_CE=has_ce and (normalize == 0 or temperature != 1.0),
                ACC=tl_dtype(acc), BLOCK_V=_ROW_BLOCK_V, BLOCK_K=next_pow2(K)), _ROW_WARPS)


def _row_bwd(z, g, ids, mask_u8, labels, lse, A, corr, lse1, grad_loss, grad_tok, scale, normalize, temperature):
    n, V = z.shape
    K = ids.shape[1]
    if n == 0 or V == 0:
        return
    split = max(1, min(cdiv(_ROW_MIN_PROGRAMS, n), cdiv(V, _ROW_BLOCK_V)))
    v_per_prog = cdiv(cdiv(V, split), _ROW_BLOCK_V) * _ROW_BLOCK_V
    launch(_kd_row_bwd_kernel, (n, cdiv(V, v_per_prog)),
           (z, g, ids, mask_u8, labels, lse, A, corr, lse1, grad_loss, grad_tok, scale, V, K, z.stride(0), g.stride(0),
            1.0 / temperature, float(temperature), v_per_prog),
           dict(NORMALIZE=normalize, HAS_CE=labels is not None, HAS_GL=grad_loss is not None,
                HAS_GT=grad_tok is not None, ACC=tl_dtype(scale.dtype), BLOCK_V=_ROW_BLOCK_V, BLOCK_K=next_pow2(K)),
           _ROW_WARPS)


def logits_fwd(z, ids, t, mask, normalize, temperature, reduction, num_items, num_items_value):
    """(loss, tok [N], scale [2], lse [N], A [N], corr [N, K]) for full logits z [N, V]."""
    N, V = z.shape
    K = ids.shape[1]
    acc = acc_dtype(z, t)
    dev = z.device
    tok, flags, lse, A = (torch.empty(N, device=dev, dtype=acc) for _ in range(4))
    corr = torch.empty(N, K, device=dev, dtype=acc)
    if normalize == 0:
        lse.zero_()
    _row_fwd(_rows(z), ids.contiguous(), t.contiguous(), _u8(mask), None, normalize, temperature, acc,
             (tok, flags, lse, A, corr, None, None, _slot_bits(N, V, normalize, dev)))
    loss, scale = reduce(tok, None, flags, None, reduction, num_items, num_items_value, 0.0, acc)
    return loss, tok, scale, lse, A, corr


def logits_bwd(grad_loss, grad_tok, z, ids, mask, lse, A, corr, scale, normalize, temperature):
    z = _rows(z)
    g = torch.empty(z.shape, device=z.device, dtype=z.dtype)
    _row_bwd(z, g, ids.contiguous(), _u8(mask), None, lse, A, corr, None, grad_loss.contiguous(),
             None if grad_tok is None else grad_tok.contiguous(), scale, normalize, temperature)
    return g


def lm_weight_grad(ids, mask, g, hidden, V, out_dtype, alpha=1.0):
    """[V, H] weight gradient of the gathered logits z[n, k] = <h[n], W[ids[n, k]]>: alpha times the sum
    over slots of g[n, k] * h[n] into row ids[n, k]. Masked slots and ids outside [0, V) (index checks
    off) sort past the last vocab tile and are skipped. Tiles interleave the ids (see the kernel)."""
    N, H = hidden.shape
    out = torch.empty(V, H, device=hidden.device, dtype=out_dtype)
    if H == 0 or V == 0:  # (V = 0 is refused by the public functions; the tile interleave divides by it)
        return out
    n_tiles = cdiv(V, _WG_BLOCK_V)
    past = n_tiles * _WG_BLOCK_V
    ids = ids.long()
    keys = torch.where((mask != 0) & (ids >= 0) & (ids < V), ids % n_tiles * _WG_BLOCK_V + ids // n_tiles,
                       past).reshape(-1)
    sorted_keys, order = torch.sort(keys, stable=True)
    bounds = torch.arange(0, past + 1, _WG_BLOCK_V, device=keys.device, dtype=torch.long)
    seg = torch.searchsorted(sorted_keys, bounds)
    K = ids.shape[1]
    launch_tuned(_kd_weight_grad_kernel, lambda meta: (n_tiles, cdiv(H, meta["BLOCK_H"])),
                 (seg, sorted_keys, order, g, hidden, out, V, H, K, float(alpha)),
                 dict(SPLIT=hidden.dtype in (torch.float16, torch.bfloat16), ACC=tl_dtype(acc_dtype(hidden)),
                      BLOCK_V=_WG_BLOCK_V, BLOCK_E=_WG_BLOCK_E),
                 (_kd_weight_grad_kernel, H, K, g.dtype, hidden.dtype, out.dtype, hidden.device))
    return out


def chunk_rows(N, V, itemsize, chunk_size=0):
    if chunk_size > 0:
        return max(1, min(N, chunk_size))
    return max(1, min(N, 1 << max(0, (CHUNK_BYTES // max(V * itemsize, 1)).bit_length() - 1)))


def _pow2_at_most(x: float) -> float:
    """The largest power of two <= x (x > 0)."""
    return math.ldexp(1.0, math.frexp(x)[1] - 1)


def hidden_fwd(hidden, weight, bias, ids, t, mask, labels, normalize, temperature, reduction, num_items,
               num_items_value, ce_weight, need_gh, need_gw, need_gb, chunk_size):
    """See reference.kd_hidden_fwd: loss and per-token loss, the gradients for an incoming gradient
    of 1 (empty when not needed), and ``applied`` [2]: the factors grad_hidden and (grad_weight,
    grad_bias) carry relative to those gradients (the backward divides them out)."""
    N, H = hidden.shape
    V = weight.shape[0]
    K = ids.shape[1]
    dev = hidden.device
    has_ce = labels is not None and ce_weight != 0.0
    if has_ce:
        labels = labels.contiguous()
    else:
        labels = None
    acc = acc_dtype(hidden, weight, t)
    hidden, ids, t, m8 = hidden.contiguous(), ids.contiguous(), t.contiguous(), _u8(mask)
    if bias is not None:
        bias = bias.contiguous()  # the gather kernel reads b_ptr + id
    need_grad = need_gh or need_gw or need_gb
    gh = torch.empty(N, H, device=dev, dtype=hidden.dtype) if need_gh else hidden.new_empty(0)
    gb_acc = torch.zeros(V, device=dev, dtype=acc) if need_gb else None
    tok = torch.empty(N, device=dev, dtype=acc)
    flags = mask.any(-1) if mask.dtype == torch.bool else (mask != 0).any(-1)
    _, scale = reduce(None, None, flags, labels, reduction, num_items, num_items_value, ce_weight, acc)
    applied = torch.ones(2, device=dev, dtype=acc)
    alpha = 1.0
    if hidden.dtype == torch.float16:
        # fp16 gradients divided by the token count fall into subnormals: compute them for a KD
        # weight of 1 and let the backward's rescale apply the reduction's weight w (on the device:
        # "mean" counts the tokens there), so grad_hidden carries 1 / w. The weight and bias
        # gradients sum over all N tokens, so at weight 1 they could pass fp16's 65504 where the true
        # ones do not: their fp32 sums are multiplied before the cast by alpha, a power of two
        # (exact) known on the host, and carry alpha / w <= 1: alpha <= w for "sum" and a number
        # num_items_in_batch, and alpha <= 1 / N <= w for "mean". A tensor num_items_in_batch is not
        # known on the host; alpha is taken as for "mean", so they carry num_items / next_pow2(N).
        if reduction == 2 and num_items is None:
            w = 1.0 / num_items_value
        else:
            w = 1.0 if reduction == 0 else 1.0 / max(N, 1)
        alpha = _pow2_at_most(w)
        inv_w = 1.0 / scale[:1]
        applied = torch.cat([inv_w, inv_w * alpha])
        scale = scale / scale[0]

    if normalize == 0 and not has_ce:
        flags2 = torch.empty(N, device=dev, dtype=acc)
        g = torch.empty(N, K, device=dev, dtype=acc) if need_grad else None
        if N:
            launch(_kd_hidden_topk_kernel, (N,),
                   (hidden, weight, bias, ids, t, m8, tok, flags2, g, gh if need_gh else None, scale, H, V, K,
                    weight.stride(0), 1.0 / temperature, float(temperature)),
                   dict(HAS_BIAS=bias is not None, NEED_GRAD=need_grad, NEED_GH=need_gh, ACC=tl_dtype(acc),
                        BLOCK_K=next_pow2(K), BLOCK_H=_HID_BLOCK_H), _HID_WARPS)
        elif need_gh:
            gh.zero_()
        loss, _ = reduce(tok, None, flags, None, reduction, num_items, num_items_value, 0.0, acc)
        gw = lm_weight_grad(ids, mask, g, hidden, V, weight.dtype, alpha) if need_gw else weight.new_empty(0)
        if need_gb:
            # masked and out-of-range slots (index checks off; their g is NaN) add nothing, as in lm_weight_grad
            ok = (mask != 0) & (ids >= 0) & (ids < V)
            clean = torch.where(ok, ids, torch.zeros_like(ids)).reshape(-1).long()
            g_ok = torch.where(ok, g, torch.zeros_like(g)).reshape(-1)
            gb = gb_acc.index_add_(0, clean, g_ok).mul_(alpha).to(bias.dtype)
        else:
            gb = hidden.new_empty(0)
        return loss, tok, gh, gw, gb, applied

    C = chunk_rows(N, V, hidden.element_size(), chunk_size)
    buf = torch.empty(C, V, device=dev, dtype=hidden.dtype)
    lse, A, lse1, ce = (torch.empty(C, device=dev, dtype=acc) for _ in range(4))
    corr = torch.empty(C, K, device=dev, dtype=acc)
    ce_tok = torch.empty(N, device=dev, dtype=acc) if has_ce else None
    flags_c = torch.empty(C, device=dev, dtype=acc)  # the row kernel's output; unused (flags came from the mask)
    bits = _slot_bits(C, V, normalize, dev)
    gw = torch.empty(V, H, device=dev, dtype=weight.dtype) if need_gw else weight.new_empty(0)
    wt = weight.t()
    for r0 in range(0, N, C):
        r1 = min(N, r0 + C)
        n = r1 - r0
        z = buf[:n]
        h_c = hidden[r0:r1]
        if bias is None:
            torch.mm(h_c, wt, out=z)
        else:
            torch.addmm(bias, h_c, wt, out=z)
        lab_c = labels[r0:r1] if has_ce else None
        _row_fwd(z, ids[r0:r1], t[r0:r1], m8[r0:r1], lab_c, normalize, temperature, acc,
                 (tok[r0:r1], flags_c, lse, A, corr, ce_tok[r0:r1] if has_ce else None, lse1, bits))
        if not need_grad:
            continue
        _row_bwd(z, z, ids[r0:r1], m8[r0:r1], lab_c, lse, A, corr, lse1, None, None, scale, normalize, temperature)
        if need_gh:
            torch.mm(z, weight, out=gh[r0:r1])
        if need_gw:  # alpha scales the matmul's fp32 sums before they are rounded to the weight's dtype
            if r0 == 0:
                torch.addmm(gw, z.t(), h_c, beta=0, alpha=alpha, out=gw)  # beta = 0: gw's contents are ignored
            else:
                gw.addmm_(z.t(), h_c, alpha=alpha)
        if need_gb:
            gb_acc += z.sum(0, dtype=acc)
    if N == 0:
        if need_gw:
            gw.zero_()
    loss, _ = reduce(tok, ce_tok, flags, labels, reduction, num_items, num_items_value, ce_weight, acc)
    gb = gb_acc.mul_(alpha).to(bias.dtype) if need_gb else hidden.new_empty(0)
    return loss, tok, gh, gw, gb, applied


def rescale_(x: torch.Tensor, g: torch.Tensor, applied: torch.Tensor) -> None:
    """x *= g / applied in place (no traffic when equal)."""
    n = x.numel()
    if n:
        launch(_kd_rescale_kernel, (cdiv(n, _SCALE_BLOCK),), (x, g, applied, n),
               dict(ACC=tl_dtype(x.dtype), BLOCK=_SCALE_BLOCK), _SCALE_WARPS)


def hidden_bwd(grad_loss, gh, gw, gb, applied):
    """Rescale the forward's gradients to the incoming gradient, then record the new factors."""
    g = grad_loss.contiguous()
    rescale_(gh, g, applied[:1])
    rescale_(gw, g, applied[1:])
    rescale_(gb, g, applied[1:])
    applied.copy_(g.reshape(1).to(applied.dtype).expand(2))
