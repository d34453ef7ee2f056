"""``TopKSAE``: a TopK / HierarchicalTopK sparse autoencoder whose decoder runs through the fused ops
and whose encoder gets a K-sparse gradient (:func:`sparsefuse.sparse_linear`).

Shapes: ``x [B, D]`` activations, ``W_enc [F, D]``, ``b_enc [F]``, ``W_dec [F, D]`` (one unit-norm
dictionary row per latent), ``b_dec [D]``; ``indices [B, K]`` int64 and ``vals [B, K]`` the K active
latents of each row, sorted by activation, largest first.

Math (Gao et al. 2024, "Scaling and evaluating sparse autoencoders"; Hierarchical: arXiv 2505.24473):

* encode: ``pre = relu((x - b_dec) @ W_enc.T + b_enc)``, ``vals, indices = topk(pre, K)``.
* decode: ``x_hat = b_dec + sum_k vals[:, k] * W_dec[indices[:, k]]``.
* reconstruction loss, normalised by the variance ``var`` of the data (so it reads as a fraction of
  variance unexplained): TopK ``mse(x_hat, x) / var``; Hierarchical the mean over k = 1..K of the
  same for the prefix reconstruction that uses the first k latents.
* AuxK (dead latents): with ``e = x - x_hat`` (detached), the ``k_aux`` largest pre-activations among
  latents that have not fired for ``dead_tokens`` tokens reconstruct ``e`` without bias;
  ``auxk = mse(e_hat, e) / mse(e, 0)``, added with weight ``auxk_alpha``.
"""

from __future__ import annotations

import json
import math
import numbers
from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .._validate import (FLOAT_DTYPES, INDEX_DTYPES, check_index_range, check_number, check_positive_int,
                         check_tensor, index_checks_enabled)
from . import reference
from .ops import (hierarchical_sae_loss, normalize_rows_, remove_parallel_component_, sae_decode, sparse_linear,
                  topk, topk_sae_loss)

DECODERS = {
    "fused": (topk_sae_loss, hierarchical_sae_loss),
    "reference": (reference.topk_sae_loss, reference.hierarchical_sae_loss),
}
ENCODERS = ("sparse", "dense")  # how forward() differentiates the encoder (see TopKSAE)
# AuxK runs as dense products over its C candidate columns when C <= AUXK_DENSE_RATIO * n (n = the
# picks a row, min(k_aux, C)); above, as n gathers a row (sparse_linear and the TopK loss). A dense
# product does C / n times the work of the gathers, but on tensor cores and without the sorted
# segmented sums of their backward (benchmarks/NOTES.md, session 29).
AUXK_DENSE_RATIO = 8


class SAEOutput(NamedTuple):
    """What :meth:`TopKSAE.forward` returns. Losses are float32 (float64 for float64 inputs) scalars."""

    loss: Tensor  #: recon_loss + auxk_alpha * auxk_loss, the quantity to minimise
    recon_loss: Tensor  #: TopK or Hierarchical reconstruction loss divided by the variance
    auxk_loss: Tensor  #: AuxK loss on dead latents (0 when none is dead or AuxK is off)
    indices: Tensor  #: [B, K] int64 active latents, by activation, largest first
    vals: Tensor  #: [B, K] their activations


def _global_mean(t: Tensor) -> Tensor:
    """Mean of a scalar over the processes of a torch.distributed job (itself when there is none)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        t = t.clone()
        dist.all_reduce(t)
        t = t / dist.get_world_size()
    return t


def json_number(o):
    """``json.dump``'s fallback for NumPy numbers in a config (``dead_tokens`` from ``np.arange``, a
    ``float32`` learning rate), which it refused after the training they configured had run."""
    if isinstance(o, numbers.Integral):
        return int(o)
    if isinstance(o, numbers.Real):
        return float(o)
    raise TypeError(f"Object of type {type(o).__name__} is not JSON serializable")


def check_dead_tokens(dead_tokens) -> None:
    """The dead-latent threshold in tokens: a whole number (NumPy's too) >= 0 and below 2^62 (1e23
    overflowed a tensor; a float or None failed only at the first AuxK step)."""
    if (isinstance(dead_tokens, bool) or not isinstance(dead_tokens, numbers.Integral)
            or not 0 <= dead_tokens < 2**62):
        raise ValueError(f"dead_tokens must be an int >= 0 and below 2^62, got {dead_tokens!r}")


def check_auxk_alpha(auxk_alpha) -> None:
    """AuxK's weight: finite and >= 0 (inf trained a NaN model, NaN gave a NaN loss; 0 turns it off)."""
    if not (math.isfinite(auxk_alpha) and auxk_alpha >= 0):
        raise ValueError(f"auxk_alpha must be finite and >= 0 (0 turns AuxK off), got {auxk_alpha}")


class TopKSAE(nn.Module):
    """A TopK (or HierarchicalTopK) sparse autoencoder.

    Args:
        d_model: D, the width of the activations.
        n_latents: F, the dictionary size.
        k: K, active latents per row (1 <= K <= F).
        hierarchical: train with the HierarchicalTopK loss (every prefix k <= K reconstructs), so
            the SAE stays good at any smaller sparsity; TopK loss otherwise.
        normalize_decoder: keep every decoder row at unit norm (:meth:`normalize_decoder_`) and
            drop the gradient component parallel to each row (:meth:`remove_parallel_grad_`); the
            trainer calls both around each optimiser step.
        auxk_alpha: weight of the AuxK loss (0 turns it off). Default 1/32 (Gao et al.).
        k_aux: latents used by AuxK; default ``max(1, min(d_model // 2, n_latents))``.
        dead_tokens: a latent is dead once it has not fired for more than this many training tokens.
        decoder: ``"fused"`` (the sparsefuse ops) or ``"reference"`` (the plain PyTorch math of
            :mod:`sparsefuse.sae.reference`, for comparisons and benchmarks).
        encoder: how the encoder's gradient is computed in :meth:`forward`. ``"sparse"``: the
            dense product ``x @ W_enc.T`` only chooses the latents (no autograd graph); the K
            chosen ones are recomputed through :func:`sparsefuse.sparse_linear`, whose backward
            costs O(B*K*D) instead of two dense [B, F] matmuls, and the latents are chosen through
            :func:`sparsefuse.topk` (block maxima, then two small selections). ``"dense"``: autograd
            through the dense product and ``torch.topk`` (the plain PyTorch way). Same values and
            gradients (which of several equal activations is chosen may differ).
        seed: seed of the initialisation (the global RNG is left alone).

    Initialisation: encoder rows uniform in ``[-1/sqrt(D), 1/sqrt(D)]``, decoder = the encoder's
    transpose (same rows), scaled to unit norm when ``normalize_decoder``, biases zero (the trainer
    sets ``b_dec`` to the data mean). Parameters are in ``dtype`` (default float32); use
    ``torch.autocast`` for bfloat16 compute on float32 parameters.
    """

    def __init__(
        self,
        d_model: int,
        n_latents: int,
        k: int,
        hierarchical: bool = False,
        *,
        normalize_decoder: bool = True,
        auxk_alpha: float = 1 / 32,
        k_aux: Optional[int] = None,
        dead_tokens: int = 10_000_000,
        decoder: str = "fused",
        encoder: str = "sparse",
        seed: int = 0,
        device=None,
        dtype=None,
    ):
        super().__init__()
        for name, n in (("d_model", d_model), ("n_latents", n_latents), ("k", k)):
            check_positive_int(name, n)  # whole numbers: a float k failed later, in torch.topk
        if k > n_latents:
            raise ValueError(f"k must be between 1 and n_latents={n_latents}, got k={k}")
        if decoder not in DECODERS:
            raise ValueError(f"decoder must be one of {sorted(DECODERS)}, got {decoder!r}")
        if encoder not in ENCODERS:
            raise ValueError(f"encoder must be one of {list(ENCODERS)}, got {encoder!r}")
        check_auxk_alpha(auxk_alpha)
        # a whole number (NumPy's too): a float k_aux failed only at the first AuxK step, naming k
        if k_aux is not None and (isinstance(k_aux, bool) or not isinstance(k_aux, numbers.Integral)):
            raise ValueError(f"k_aux must be an int or None, got {k_aux!r}")
        check_dead_tokens(dead_tokens)
        self.config = dict(
            d_model=d_model, n_latents=n_latents, k=k, hierarchical=hierarchical,
            normalize_decoder=normalize_decoder, auxk_alpha=auxk_alpha,
            k_aux=max(1, min(d_model // 2, n_latents)) if k_aux is None else k_aux, dead_tokens=dead_tokens, decoder=decoder,
            encoder=encoder,
        )
        if not 1 <= self.config["k_aux"] <= n_latents:
            raise ValueError(f"k_aux must be between 1 and n_latents={n_latents}, got {self.config['k_aux']}")
        self.d_model, self.n_latents, self.k, self.hierarchical = d_model, n_latents, k, hierarchical
        self.decoder, self.encoder = decoder, encoder
        g = torch.Generator().manual_seed(seed)
        bound = 1 / math.sqrt(d_model)
        w = (torch.rand(n_latents, d_model, generator=g) * 2 - 1) * bound
        w_dec = w / w.norm(dim=1, keepdim=True).clamp_min(1e-12) if normalize_decoder else w.clone()
        kw = dict(device=device, dtype=dtype or torch.float32)
        self.W_enc = nn.Parameter(w.to(**kw))
        self.b_enc = nn.Parameter(torch.zeros(n_latents, **kw))
        self.W_dec = nn.Parameter(w_dec.to(**kw))
        self.b_dec = nn.Parameter(torch.zeros(d_model, **kw))
        self.register_buffer("tokens_since_fired", torch.zeros(n_latents, dtype=torch.int64, device=device))

    # --- encode / decode -----------------------------------------------------------------------

    def pre_acts(self, x: Tensor) -> Tensor:
        """``relu((x - b_dec) @ W_enc.T + b_enc)``, ``[B, F]``, in the parameters' dtype."""
        return F.relu(self._encoder_linear(x.to(self.W_enc.dtype)))

    def _encoder_linear(self, xe: Tensor, W_enc: Optional[Tensor] = None, b_enc: Optional[Tensor] = None) -> Tensor:
        """``(xe - b_dec) @ W_enc.T + b_enc`` before the ReLU: every latent, or the encoder rows given."""
        W_enc, b_enc = (self.W_enc, self.b_enc) if W_enc is None else (W_enc, b_enc)
        return F.linear(xe - self.b_dec.to(xe.dtype), W_enc, b_enc)

    def encode(self, x: Tensor, k: Optional[int] = None) -> tuple[Tensor, Tensor]:
        """``(indices [B, k] int64, vals [B, k])``: the k (default K) largest activations, largest first."""
        vals, indices = self._select(self.pre_acts(x), self.k if k is None else k)
        return indices, vals

    def _select(self, a: Tensor, k: int) -> tuple[Tensor, Tensor]:
        """``(values, indices)`` of the k largest entries of each row of ``a``, largest first."""
        return topk(a, k) if self.encoder == "sparse" else a.topk(k, dim=-1, sorted=True)

    def decode(self, indices: Tensor, vals: Tensor) -> Tensor:
        """``b_dec + sum_k vals[:, k] * W_dec[indices[:, k]]`` through :func:`sparsefuse.sae_decode`, ``[B, D]``."""
        if self.decoder == "reference":  # range-checked as the fused op is (plain indexing would wrap -1)
            if not torch.compiler.is_compiling():  # the check reads the data: not inside a graph
                check_index_range("indices", indices, self.n_latents)
            return reference.sae_decode(indices, vals, self.W_dec, self.b_dec)
        return sae_decode(indices, vals, self.W_dec, self.b_dec)

    def dead_mask(self) -> Tensor:
        """``[F]`` bool: latents that have not fired for more than ``dead_tokens`` tokens."""
        return self.tokens_since_fired > self.config["dead_tokens"]

    # --- forward -------------------------------------------------------------------------------

    def forward(self, x: Tensor, variance: Optional[Tensor | float] = None, *,
                auxk_latents: Optional[Tensor] = None) -> SAEOutput:
        """Encode, decode and return the loss parts (see :class:`SAEOutput`).

        Args:
            x: ``[B, D]`` activations (any float dtype; the encoder runs in the parameters' dtype, or
                in autocast's; the loss targets ``x`` as given).
            variance: the mean squared deviation of the data per element, that the reconstruction
                loss is divided by: a finite number > 0, or a 0-dim tensor (not checked: reading it
                would be a host sync). Default: that of this batch (detached); a batch without any
                (one row, or equal rows) makes the losses NaN, as ``fvu_curve`` does, so pass
                ``variance`` to evaluate single rows. The trainer passes the variance of the whole
                data set, which keeps the loss linear in the rows of a batch (so data-parallel
                training matches one process exactly).
            auxk_latents: ``[C]`` int32 or int64, the latents AuxK may choose from, for a caller that
                knows a superset of the dead ones (that it is one is not checked: reading the dead mask
                would be a host sync). Each id lies in ``[0, F)`` and appears once: where index checks
                run (see :func:`sparsefuse.set_index_checks`) either fault raises; unchecked, an id out
                of range makes ``auxk_loss`` and its gradients NaN, and one listed twice may be picked
                twice. AuxK then selects among these C columns, at most ``n = min(k_aux, C)`` latents a
                row, and an empty tensor skips it (``auxk_loss`` is 0). The loss and gradients are those
                of the search over all latents (to rounding): the latents left out are alive, so AuxK
                gives them 0. That search costs a top-``k_aux`` selection over ``[B, F]`` and two sparse
                products over ``k_aux`` (default D / 2) latents a row, whether or not any latent is
                dead. Over few candidates (C <= ``AUXK_DENSE_RATIO`` * n) AuxK runs as two dense
                ``[B, C]`` products instead. None (default): all latents. The trainer bounds the dead-latent
                clock on the host.

        In training mode with AuxK on (``auxk_alpha > 0``), under an initialised
        ``torch.distributed`` group of more than one process, the forward all-reduces AuxK's
        normaliser (the mean squared residual of the global batch) so that data-parallel training
        matches one process: it is a collective, and every process of the group must call
        ``forward`` together, as in a DDP training step.
        """
        check_tensor("x", x, shape=(None, self.d_model), dtypes=FLOAT_DTYPES, device=self.W_enc.device)
        if auxk_latents is not None:
            check_tensor("auxk_latents", auxk_latents, shape=(None,), dtypes=INDEX_DTYPES, device=self.W_enc.device)
            if not torch.compiler.is_compiling():
                check_index_range("auxk_latents", auxk_latents, self.n_latents)
                if index_checks_enabled(auxk_latents) and auxk_latents.unique().numel() < auxk_latents.numel():
                    raise ValueError("auxk_latents lists a latent more than once")
        if isinstance(variance, Tensor):
            if variance.dim() != 0:
                raise ValueError(f"variance must be a number or a 0-dim tensor, got shape {tuple(variance.shape)}")
        elif variance is not None:
            check_number("variance", variance, positive=True)
        topk_loss, hier_loss = DECODERS[self.decoder]
        xe = x.to(self.W_enc.dtype)  # the encoder's input, in its parameters' dtype (x stays the target)
        shift = self.b_dec.to(xe.dtype)  # the pre-encoder bias
        if self.encoder == "dense":
            pre = F.relu(self._encoder_linear(xe))
            vals, indices = self._select(pre, self.k)
        else:  # the dense product only selects; ReLU would not change which latents end up nonzero
            with torch.no_grad():
                pre = self._encoder_linear(xe)
            top, indices = self._select(pre, self.k)
            vals = F.relu(sparse_linear(xe, self.W_enc, indices, self.b_enc, shift, values=top))
        if variance is None:
            xf = x.detach().to(reference.acc_dtype(x))
            xf = xf - xf.sum(0) / max(xf.shape[0], 1)
            variance = xf.square().sum() / max(xf.numel(), 1)
            # an empty batch divides its 0 loss by 1; a batch without variance gets NaN (it was
            # clamped to 1e-30, which gave a loss and gradients of order 1e30)
            variance = variance.new_ones(()) if x.shape[0] == 0 else torch.where(variance > 0, variance, math.nan)
        auxk_loss = None
        if self.training and self.config["auxk_alpha"] > 0 and (auxk_latents is None or auxk_latents.numel()):
            auxk_loss = self._auxk_loss(x, xe, pre, indices, vals, topk_loss, auxk_latents)
        # the [B, F] pre-activations are done with (the sparse encoder keeps no reference), so they
        # are freed before the decoder loss, whose forward may allocate the weight-gradient buffer
        del pre
        loss_fn = hier_loss if self.hierarchical else topk_loss
        recon_loss = loss_fn(indices, self.W_dec, vals, self.b_dec, x) / variance
        if auxk_loss is None:
            auxk_loss = recon_loss.new_zeros(())
        loss = recon_loss + self.config["auxk_alpha"] * auxk_loss
        return SAEOutput(loss, recon_loss, auxk_loss, indices, vals)

    def _auxk_loss(self, x, xe, pre, indices, vals, topk_loss, latents=None):
        dead = self.dead_mask()
        # e = x - x_hat in float32 (float64 for float64 x), as the reconstruction loss forms it:
        # rounding x_hat to a 16-bit x's dtype first would move a small e by up to half an ulp of x_hat
        with torch.no_grad():
            acc = reference.acc_dtype(x)
            resid = x.to(acc) - self.decode(indices, vals).to(acc)  # [B, D]
        # the C candidate columns: every latent, or the caller's superset of the dead ones (the
        # others are alive and would get 0). An unchecked id outside [0, F) is read as a valid one
        # and makes the loss NaN at the end (indexing with it would wrap or fault).
        if latents is not None:
            outside = ((latents < 0) | (latents >= self.n_latents)).any()
            latents = latents.clamp(0, self.n_latents - 1)
        cand, cand_dead = (pre, dead) if latents is None else (pre[:, latents], dead[latents])  # [B, C], [C]
        n = min(self.config["k_aux"], cand.shape[1])
        aux_vals, pick = self._select(cand * cand_dead.to(cand.dtype), n)  # [B, n]
        if cand.shape[1] <= AUXK_DENSE_RATIO * n:
            mse = self._auxk_dense(xe, cand, cand_dead, pick, resid, latents)
        else:
            aux_idx = pick if latents is None else latents[pick]
            if self.encoder == "sparse":  # picks that are not dead (too few dead latents) get 0 and no gradient
                aux_vals = F.relu(sparse_linear(xe, self.W_enc, aux_idx, self.b_enc, self.b_dec.to(xe.dtype),
                                                values=aux_vals))
                aux_vals = aux_vals * dead[aux_idx].to(aux_vals.dtype)
            mse = topk_loss(aux_idx, self.W_dec, aux_vals, None, resid)
        # sum / max(numel, 1): an empty shard contributes 0 instead of a NaN that the mean would spread
        scale = _global_mean(resid.to(mse.dtype).square().sum() / max(resid.numel(), 1)).clamp_min(1e-30)
        if latents is not None:  # NaN for the loss and, through the factor, for its gradients
            mse = mse * torch.where(outside, math.nan, 1.0)
        return torch.where(dead.any(), mse / scale, mse.new_zeros(()))

    def _auxk_dense(self, xe, cand, cand_dead, pick, resid, latents):
        """AuxK's mse as dense products over the C candidate columns, for few candidates: the
        activations ``[B, C]`` with everything but each row's picks zeroed, times the candidates'
        decoder rows. The same loss and gradients as the sparse path (to rounding; under autocast
        the two products run in its dtype, as the encoder's does)."""
        if latents is None:
            W_enc, b_enc, W_dec = self.W_enc, self.b_enc, self.W_dec
        else:
            W_enc, b_enc, W_dec = self.W_enc[latents], self.b_enc[latents], self.W_dec[latents]
        if self.encoder == "sparse":  # the candidates' pre-activations again, now with a graph
            a = F.relu(self._encoder_linear(xe, W_enc, b_enc))
        else:
            a = cand  # already relu'd, with a graph
        keep = torch.zeros(a.shape, dtype=torch.bool, device=a.device).scatter_(1, pick, True) & cand_dead
        e_hat = (a * keep.to(a.dtype)) @ W_dec.to(a.dtype)  # [B, D]
        return (e_hat.to(resid.dtype) - resid).square().sum() / max(resid.numel(), 1)

    # --- training helpers ----------------------------------------------------------------------

    def fired_counts(self, indices: Tensor, vals: Tensor) -> Tensor:
        """``[F]`` float: how often each latent was active with a positive value in this batch (no host sync)."""
        counts = torch.zeros(self.n_latents, device=vals.device, dtype=torch.float32)
        return counts.index_add_(0, indices.reshape(-1), (vals.detach().reshape(-1) > 0).float())

    @torch.no_grad()
    def record_firing(self, counts: Tensor, n_tokens: int) -> None:
        """Advance the dead-latent clock by ``n_tokens`` and reset it for latents with ``counts > 0``
        (``counts [F]`` on the module's device; refused before the clock moves)."""
        check_tensor("counts", counts, shape=(self.n_latents,), device=self.tokens_since_fired.device)
        self.tokens_since_fired.add_(n_tokens).masked_fill_(counts > 0, 0)

    @torch.no_grad()
    def normalize_decoder_(self) -> None:
        """Scale every decoder row to unit norm (call after each optimiser step); a no-op when the
        module was built with ``normalize_decoder=False``."""
        if self.config["normalize_decoder"]:
            if self.decoder == "reference":
                reference.unit_rows_(self.W_dec, None, 1e-12)
            else:  # one fused pass
                normalize_rows_(self.W_dec)

    @torch.no_grad()
    def remove_parallel_grad_(self) -> None:
        """Remove from ``W_dec.grad`` the component parallel to each (unit-norm) row (call before the
        step); a no-op when the module was built with ``normalize_decoder=False``."""
        if self.config["normalize_decoder"] and self.W_dec.grad is not None:
            if self.decoder == "reference":
                reference.unit_rows_(self.W_dec, self.W_dec.grad, 1e-12)
            else:  # one fused pass over W_dec and its gradient
                remove_parallel_component_(self.W_dec.grad, self.W_dec)

    # --- evaluation ----------------------------------------------------------------------------

    @torch.no_grad()
    def fvu_curve(self, x: Tensor, ks=None, batch_size: int = 4096) -> dict:
        """Fraction of variance unexplained using only the first k' latents, for each k' in ``ks``.

        ``FVU(k') = sum ||x - x_hat_k'||^2 / sum ||x - mean(x)||^2`` over all rows of ``x``, where
        ``x_hat_k'`` decodes the k' largest activations of the K-sparse code. Default ``ks``:
        1, 2, 4, ... up to K (K included). Returns ``{k': fvu}``, NaN for every k' when the rows of
        ``x`` have no variance (a single row, or all rows equal): FVU is undefined there.
        """
        check_positive_int("batch_size", batch_size)
        check_tensor("x", x, shape=(None, self.d_model), dtypes=FLOAT_DTYPES)  # not reported as indices
        ks = powers_of_two_upto(self.k) if ks is None else list(ks)
        bad = [kp for kp in ks if not isinstance(kp, int) or isinstance(kp, bool) or not 1 <= kp <= self.k]
        if bad:
            raise ValueError(f"ks must hold integers in [1, k] = [1, {self.k}], got {bad}")
        ks = list(dict.fromkeys(ks))  # a k' listed twice summed its squared error twice (twice the FVU)
        mean = x.double().mean(0)
        total = float((x.double() - mean).square().sum())
        if not total > 0:
            return dict.fromkeys(ks, math.nan)
        sse = dict.fromkeys(ks, 0.0)
        for start in range(0, x.shape[0], batch_size):
            xb = x[start:start + batch_size]
            idx, vals = self.encode(xb.to(self.W_enc.dtype))
            for kp in ks:
                recon = self.decode(idx[:, :kp], vals[:, :kp])
                sse[kp] += float((xb.double() - recon.double()).square().sum())
        return {kp: sse[kp] / total for kp in ks}

    # --- persistence ---------------------------------------------------------------------------

    def save(self, path: str) -> None:
        """Write parameters, the dead-latent clock and the config to a ``.safetensors`` file."""
        from safetensors.torch import save_file

        tensors = {name: t.detach().contiguous().cpu() for name, t in self.state_dict().items()}
        save_file(tensors, path, metadata={"sparsefuse.TopKSAE": json.dumps(self.config, default=json_number)})

    @classmethod
    def load(cls, path: str, device=None) -> "TopKSAE":
        """Rebuild a :class:`TopKSAE` written by :meth:`save`."""
        from safetensors import safe_open
        from safetensors.torch import load_file

        with safe_open(path, framework="pt") as f:
            meta = f.metadata() or {}
        if "sparsefuse.TopKSAE" not in meta:
            raise ValueError(f"{path} is not a sparsefuse TopKSAE checkpoint (no 'sparsefuse.TopKSAE' metadata)")
        config = json.loads(meta["sparsefuse.TopKSAE"])
        state = load_file(path)
        model = cls(**config, device=device, dtype=state["W_enc"].dtype)
        model.load_state_dict(state)
        return model

    def extra_repr(self) -> str:
        kind = "hierarchical" if self.hierarchical else "topk"
        return (f"d_model={self.d_model}, n_latents={self.n_latents}, k={self.k}, loss={kind}, "
                f"decoder={self.decoder}, encoder={self.encoder}")


def powers_of_two_upto(k: int) -> list:
    """``[1, 2, 4, ..., k]``: the powers of two below k, then k itself."""
    out, p = [], 1
    while p < k:
        out.append(p)
        p *= 2
    return out + [k]
