"""Exact PyTorch references for the VQ codebook ops.

* :func:`ema_update`: the whole EMA codebook update written the plain way (a B x K one-hot, then
  the five steps: batch statistics, EMA blend, codebook refresh, counters, dead-code restart). It is
  the test oracle of the fused op, and, with ``row_picker="randperm"``, the eager baseline of the
  benchmark. It works in the dtype of the state it is given (float64 in tests).
* :func:`ema_accumulate` / :func:`ema_apply` / :func:`ema_restart`: the same math split the way
  the registered ops split it (batch statistics, then the update), so that a ``torch.distributed``
  all-reduce can sit between them. They are the ops' CPU implementation.
* :func:`nearest_code`: brute-force search (materialises the B x K distance matrix).
* :func:`restart_rows`: the keyed pseudo-random permutation that picks the rows of x that dead
  codes restart from. Kernels and references share its definition bit for bit.

Shapes: L levels (1 for a single codebook), B rows, K codes, D dims. State: ``codebook [L, K, D]``,
``cluster_size [L, K]`` (EMA of counts), ``embed_sum [L, K, D]`` (EMA of sums), ``counters
[L, K]`` integer steps since the code was last used.

Semantics (``active`` = False: "laplace", as in vector-quantize-pytorch / EnCodec / RQ-VAE; True:
"active", as in RecTokens' VQQuantizer); n_k, s_k are the batch count and sum of code k:

* laplace: every code decays, ``N <- g N + (1-g) n``, ``S <- g S + (1-g) s``; Laplace smoothing
  ``N'_k = (N_k + eps) / (sum N + K eps) * sum N``; ``codebook_k = S_k / N'_k`` (a code with
  N'_k = 0 keeps its vector). A code is dead when ``N_k < threshold`` (after the blend); it takes a
  row v of x and its buffers restart consistently: ``codebook_k = v``, ``N_k = reset``,
  ``S_k = reset * v``, so the next refresh keeps it near v. The restart comes after the refresh,
  so it is not overwritten in the same step (EnCodec's order loses it).
* active: only codes with n_k > 0 blend (``N``, ``S`` as above) and refresh
  (``codebook_k = S_k / max(N_k, eps)``); the others keep every value. A code whose counter reaches
  ``restart_after`` (> 0) takes a row v of x with ``N_k = 0``, ``S_k = 0``.
* counters (when given): 0 for codes used in the batch or restarted, else + 1.
* an unchecked code outside [0, K) makes the batch count and sums of the nearest valid code NaN
  (:func:`ema_accumulate`, as the kernels); a NaN count counts as used, so the NaN reaches that
  code's N, S and codebook row, and with laplace (through sum N) every refreshed codebook row.

Dead codes are numbered 0, 1, 2, ... in code order within each level; dead code number r takes
global row ``restart_rows(key, r mod Bg, Bg)`` of the batch (in DDP, Bg is the sum of every rank's B,
the ranks' rows in rank order): distinct rows while there are at most Bg dead codes.
"""

from __future__ import annotations

import torch

from .._dtypes import acc_dtype

#: Constants of the restart-row permutation (each < 2^31, so every product fits in int64).
HASH_MUL1 = 0x2C1B3C6D
HASH_MUL2 = 0x297A2D39
HASH_MASK = 0x7FFFFFFF
FEISTEL_ROUNDS = 4


def _half_bits(n: int) -> int:
    bits = max(int(n - 1).bit_length(), 1)
    return (bits + 1) // 2


def _round_fn(r: torch.Tensor, k: torch.Tensor, mask: int) -> torch.Tensor:
    t = (r * HASH_MUL1 + k) & HASH_MASK
    t = t ^ (t >> 15)
    t = (t * HASH_MUL2) & HASH_MASK
    t = t ^ (t >> 13)
    return t & mask


def _feistel(i: torch.Tensor, key: torch.Tensor, half: int) -> torch.Tensor:
    mask = (1 << half) - 1
    left, right = i >> half, i & mask
    for j in range(FEISTEL_ROUNDS):
        left, right = right, left ^ _round_fn(right, key[..., j], mask)
    return (left << half) | right


def restart_rows(key: torch.Tensor, i: torch.Tensor, n: int) -> torch.Tensor:
    """A keyed bijection of [0, n), applied to ``i`` (int64, values in [0, n)).

    A 4-round Feistel network on 2*h bits, the smallest even width of at least 2 with
    2^(2h) >= n (so 2^(2h) < 4n for n > 1), with cycle walking: values that land outside [0, n) go
    through the network again until they land inside. ``key`` is [..., 4] int64 (broadcast against
    ``i``), drawn from the caller's generator.
    """
    half = _half_bits(n)
    v = _feistel(i, key, half)
    while bool((v >= n).any()):
        v = torch.where(v >= n, _feistel(v, key, half), v)
    return v


LEVEL_MUL = 0x1B873593
_WORD_STEP = 0x7FEB352D


def key_words(device, generator=None):
    """Four round-key words from a CUDA generator's Philox state, read and advanced on the host the
    way PyTorch's own random kernels consume it (no device work); None on CPU, while a CUDA graph is
    being captured, or under ``torch.compile`` (then :func:`draw_key` draws them on the device)."""
    if not isinstance(device, torch.device):
        device = torch.device(device)
    if device.type != "cuda" or torch.compiler.is_compiling() or torch.cuda.is_current_stream_capturing():
        return None
    if generator is None:
        idx = device.index
        generator = torch.cuda.default_generators[torch.cuda.current_device() if idx is None else idx]
    seed, offset = generator.initial_seed(), generator.get_offset()
    generator.set_offset(offset + 4)
    base = seed * HASH_MUL1 + (seed >> 31) * HASH_MUL2 + offset * LEVEL_MUL  # word j: (base + j * STEP) mod MASK
    return (base % HASH_MASK, (base + _WORD_STEP) % HASH_MASK, (base + 2 * _WORD_STEP) % HASH_MASK,
            (base + 3 * _WORD_STEP) % HASH_MASK)


def expand_words(words, levels: int, device) -> torch.Tensor:
    """[L, 4] round keys from four words: key[l, j] = words[j] xor (l * LEVEL_MUL), masked to 31 bits.
    Computed on ``device`` with the words as scalar arguments: no host-to-device copy, which on CUDA
    would block the host every training step."""
    lev = torch.arange(0, levels * LEVEL_MUL, LEVEL_MUL, dtype=torch.int64, device=device) & HASH_MASK
    return torch.stack([lev ^ (w & HASH_MASK) for w in words], dim=1)


def draw_key(levels: int, device, generator=None) -> torch.Tensor:
    """[L, 4] int64 round keys in [0, 2^31 - 1) from ``generator`` (see :func:`key_words`)."""
    words = key_words(device, generator)
    if words is not None:
        return expand_words(words, levels, device)
    return torch.randint(0, HASH_MASK, (levels, 4), device=device, dtype=torch.int64, generator=generator)


def ema_update(x, codes, codebook, cluster_size, embed_sum, counters=None, *, decay, active=False, eps=1e-5,
               threshold=0.0, reset=None, restart_after=0, key=None, row_picker="feistel", generator=None):
    """The whole update in place, the plain way (one-hot). Single level ([B, D], [B], [K, D], ...)
    or stacked levels ([L, B, D], [L, B], [L, K, D], ...). The one-hot product multiplies each row
    of x by 0 for every other code, so a NaN or inf in x reaches every code's sum (0 * NaN), where
    the kernels and :func:`ema_accumulate` poison only its own code's: compare them on finite x."""
    single = codebook.dim() == 2
    if single:
        x, codes, codebook, cluster_size, embed_sum = (t.unsqueeze(0) for t in (x, codes, codebook, cluster_size,
                                                                              embed_sum))
        counters = None if counters is None else counters.unsqueeze(0)
    L, K, D = codebook.shape
    B = x.shape[1]
    dt = codebook.dtype
    if key is None and row_picker == "feistel":
        key = draw_key(L, codebook.device, generator)
    # 1. one-hot and batch statistics
    onehot = torch.nn.functional.one_hot(codes.long(), K).to(dt)  # [L, B, K]
    n = onehot.sum(1)
    s = torch.einsum("lbk,lbd->lkd", onehot, x.to(dt))
    dead = _blend_and_refresh(n, s, codebook, cluster_size, embed_sum, counters, decay, active, eps, threshold,
                              restart_after)
    # 5. dead-code restart from rows of x
    rank = dead.long().cumsum(1) - 1
    if B == 0:
        return
    if row_picker == "feistel":
        rows = restart_rows(key[:, None, :], rank.clamp_min(0) % B, B)
    else:  # the benchmark baseline: a plain device-side permutation per level
        perm = torch.stack([torch.randperm(B, device=x.device, generator=generator) for _ in range(L)])
        rows = perm.gather(1, rank.clamp_min(0) % B)
    v = x.to(dt).gather(1, rows[..., None].expand(L, K, D))
    r = 0.0 if active else (threshold if reset is None else reset)
    codebook.copy_(torch.where(dead[..., None], v, codebook))
    embed_sum.copy_(torch.where(dead[..., None], v * r, embed_sum))
    cluster_size.copy_(torch.where(dead, torch.full_like(cluster_size, r), cluster_size))
    if counters is not None:
        counters.copy_(torch.where(dead, torch.zeros_like(counters), counters))


def _blend_and_refresh(n, s, codebook, cluster_size, embed_sum, counters, decay, active, eps, threshold,
                       restart_after):
    """Steps 2-4 in place; returns the dead mask [L, K]. A NaN count (a code poisoned by an
    out-of-range code, see :func:`ema_accumulate`) counts as used, so the NaN reaches its state."""
    used = (n > 0) | n.isnan()
    new_n = decay * cluster_size + (1 - decay) * n
    new_s = decay * embed_sum + (1 - decay) * s
    if active:
        cluster_size.copy_(torch.where(used, new_n, cluster_size))
        embed_sum.copy_(torch.where(used[..., None], new_s, embed_sum))
        codebook.copy_(torch.where(used[..., None], embed_sum / cluster_size.clamp_min(eps)[..., None], codebook))
    else:
        cluster_size.copy_(new_n)
        embed_sum.copy_(new_s)
        total = cluster_size.sum(1, keepdim=True)
        smoothed = (cluster_size + eps) / (total + cluster_size.shape[1] * eps) * total
        ok = (smoothed > 0) | smoothed.isnan()  # a NaN total reaches every code
        codebook.copy_(torch.where(ok[..., None], embed_sum / torch.where(ok, smoothed, 1.0)[..., None], codebook))
    if counters is not None:
        new_c = torch.where(used, torch.zeros_like(counters), counters + 1)
        counters.copy_(new_c)
    if active:
        if restart_after <= 0:
            return torch.zeros_like(used)
        if counters is None:
            raise ValueError("the 'active' semantics needs steps_since_active")
        return counters >= restart_after
    return cluster_size < threshold


# --- the split used by the registered ops ---------------------------------------------------------


def ema_accumulate(x, codes, num_codes: int):
    """Batch statistics: (n [L, K], s [L, K, D]) in float32 (float64 for float64 x). A code outside
    [0, K) adds NaN to the count and sums of the nearest valid code, as in the kernels."""
    L, B, D = x.shape
    dt = acc_dtype(x)
    n = torch.zeros(L, num_codes, dtype=dt, device=x.device)
    s = torch.zeros(L, num_codes, D, dtype=dt, device=x.device)
    ok = (codes >= 0) & (codes < num_codes)
    idx = codes.long().clamp(0, num_codes - 1)
    n.scatter_add_(1, idx, torch.where(ok, 1.0, float("nan")).to(dt))
    s.scatter_add_(1, idx[..., None].expand(L, B, D), torch.where(ok[..., None], x.to(dt), float("nan")))
    return n, s


def ema_apply(x, codebook, cluster_size, embed_sum, counters, n, s, key, *, decay, active, eps, threshold, reset,
              restart_after, sizes=None, rank=0):
    """Blend, refresh and restart in place, given the (all-reduced) statistics.

    Under DDP, ``sizes`` holds every rank's number of rows B_r ([world] integers; they may differ)
    and the restart rows come from the global batch of sum B_r rows, the rows of rank r starting at
    B_0 + ... + B_{r-1}; this rank writes the rows it owns into the returned ``cand [L, K, D]``
    (zeros elsewhere, to be summed over ranks) and ``dead [L, K]``; :func:`ema_restart` then
    installs them. With ``sizes=None`` (one process) the restart happens here and ``cand`` is empty.
    """
    L, K, D = codebook.shape
    B = x.shape[1]
    dist = sizes is not None
    Bg, off = (int(sizes.sum()), int(sizes[:rank].sum())) if dist else (B, 0)
    dead = _blend_and_refresh(n.to(codebook.dtype), s.to(codebook.dtype), codebook, cluster_size, embed_sum, counters,
                              decay, active, eps, threshold, restart_after)
    if Bg == 0:
        dead = torch.zeros_like(dead)
    nr = dead.long().cumsum(1) - 1
    rows = restart_rows(key[:, None, :], nr.clamp_min(0) % max(Bg, 1), max(Bg, 1)) - off
    own = dead & (rows >= 0) & (rows < B)
    v = x.to(codebook.dtype).gather(1, rows.clamp(0, max(B - 1, 0))[..., None].expand(L, K, D)) if B else \
        codebook.new_zeros(L, K, D)
    v = torch.where(own[..., None], v, 0.0)
    r = 0.0 if active else float(reset)
    cluster_size.copy_(torch.where(dead, torch.full_like(cluster_size, r), cluster_size))
    if counters is not None:
        counters.copy_(torch.where(dead, torch.zeros_like(counters), counters))
    if dist:
        return v.to(torch.float32), dead.to(torch.int8)
    codebook.copy_(torch.where(dead[..., None], v, codebook))
    embed_sum.copy_(torch.where(dead[..., None], v * r, embed_sum))
    return codebook.new_empty(0, dtype=torch.float32), codebook.new_empty(0, dtype=torch.int8)


def ema_restart(codebook, embed_sum, cand, dead, reset):
    """Install the summed candidate rows of dead codes (the DDP tail of :func:`ema_apply`)."""
    m = dead.bool()[..., None]
    v = cand.to(codebook.dtype)
    codebook.copy_(torch.where(m, v, codebook))
    embed_sum.copy_(torch.where(m, v * reset, embed_sum))


# --- nearest-code search ----------------------------------------------------------------------------


def nearest_code(x, codebook, cosine=False):
    """(codes [B] int64, dist [B] float32/float64) by brute force; ties go to the lowest index.

    Squared Euclidean distance, or with ``cosine`` the squared distance between the unit vectors,
    2 - 2 cos(x, c), clamped at 0 against rounding. Arithmetic in float32 (float64 for float64
    inputs). A NaN score ranks before every number (``torch.argmin``'s order) and gives a NaN
    distance: a row of x holding a NaN gets code 0, and a codebook row holding a NaN is the code of
    every row of x (the lowest such row).
    """
    dt = acc_dtype(x, codebook)
    xf, cf = x.to(dt), codebook.to(dt)
    if cosine:
        cn = cf / cf.norm(dim=1, keepdim=True).clamp_min(1e-12)
        score = -_dots(xf, cn)
        codes = score.argmin(1)
        best = score.gather(1, codes[:, None])[:, 0]
        dist = (2 + 2 * best / xf.norm(dim=1).clamp_min(1e-12)).clamp_min(0)
        return codes, dist
    score = (cf * cf).sum(1)[None, :] - 2 * _dots(xf, cf)
    codes = score.argmin(1)
    dist = ((xf * xf).sum(1) + score.gather(1, codes[:, None])[:, 0]).clamp_min(0)
    return codes, dist


def _dots(x, c, elements=1 << 22):
    """x @ c.T [B, K], each entry summed over D in the same order: identical rows of c get identical
    scores, so that ties really go to the lowest index (a BLAS product rounded duplicate codebook rows
    differently, and a higher duplicate won). Row chunks of at most ``elements`` products."""
    B, K = x.shape[0], c.shape[0]
    step = max(1, elements // max(K * x.shape[1], 1))
    return torch.cat([(x[i:i + step, None, :] * c[None]).sum(-1) for i in range(0, B, step)]) if B else \
        x.new_zeros(0, K)


def sqdist_matrix(x, codebook, cosine=False):
    """[B, K] float64 squared distances (between unit vectors with ``cosine``): the test oracle."""
    xf, cf = x.double(), codebook.double()
    if cosine:
        xf = xf / xf.norm(dim=1, keepdim=True).clamp_min(1e-12)
        cf = cf / cf.norm(dim=1, keepdim=True).clamp_min(1e-12)
    return ((xf * xf).sum(1, keepdim=True) - 2 * (xf @ cf.T) + (cf * cf).sum(1)).clamp_min(0)


def nearest_code_exact(x, codebook, cosine=False):
    """Float64 brute force (the test oracle): (codes [B], squared distances [B])."""
    d = sqdist_matrix(x, codebook, cosine)
    codes = d.argmin(1)
    return codes, d.gather(1, codes[:, None])[:, 0]


def quantize(x, codes, codebook, beta):
    """Straight-through quantisation: (out = codebook[codes] with d out / d x = identity,
    loss = beta * mean((x - sg(out))^2)), differentiable in x by autograd."""
    q = codebook[codes].to(x.dtype).detach()
    return x + (q - x).detach(), beta * (x - q).square().mean()


def quantize_fwd(x, codes, codebook, beta):
    """(out = codebook[codes] in x's dtype, loss of that rounded out in float32, float64 if either
    input is float64)."""
    dt = acc_dtype(x, codebook)
    ok = (codes >= 0) & (codes < codebook.shape[0])  # as in the kernel: a bad code's row is NaN
    q = torch.where(ok[:, None], codebook[torch.where(ok, codes, 0)], float("nan")).to(x.dtype)
    loss = (x.to(dt) - q.to(dt)).square().sum() * (beta / max(x.numel(), 1))
    return q, loss


def quantize_bwd(grad_out, grad_loss, x, q, beta):
    """grad_x, contiguous like the kernel's and the op's fake (elementwise ops keep x's layout: a
    column-major x failed the compiled backward's stride check)."""
    dt = acc_dtype(x, q)
    g = (x.to(dt) - q.to(dt)) * (grad_loss.to(dt) * (2.0 * beta / max(x.numel(), 1))) + grad_out.to(dt)
    return g.to(x.dtype).contiguous()
