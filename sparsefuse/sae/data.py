"""Activations to train SAEs on: an embedded synthetic set with a known dictionary, or a file.

Synthetic set (:func:`synthetic_activations`), seeded and generated on the fly, nothing stored:

* a ground-truth dictionary ``G [n_features, D]`` of random unit vectors, with ``n_features > D``
  (features in superposition: they cannot all be orthogonal);
* feature i fires in a row with probability ``p_i`` that falls off with its rank like
  ``1 / (i + 10)``, scaled so that on average ``mean_active`` features fire per row (each ``p_i``
  capped at 1, so a ``mean_active`` near ``n_features`` gets fewer: :func:`expected_active`);
* a firing feature has magnitude ``m_i * s`` with a per-feature scale ``m_i`` log-uniform in
  ``[0.5, 2]`` and ``s ~ Exponential(1)``, so a few features dominate each row;
* ``x = sum_i a_i G_i + noise``, the noise isotropic Gaussian with ``noise`` times the mean
  per-element standard deviation of the signal.

Files (:func:`load_activations`): ``.npy``, ``.pt`` / ``.pth`` (a tensor, or a dict holding one) or
``.safetensors`` (key ``activations``, or its only tensor), of shape ``[N, D]``, finite, float or
signed integer (read as float32).
"""

from __future__ import annotations

import os
from typing import Optional

import torch
from torch import Tensor

from .._validate import FLOAT_DTYPES, INDEX_DTYPES, check_number


def synthetic_dictionary(d_model: int, n_features: int, seed: int = 0) -> Tensor:
    """``[n_features, d_model]`` float32 random unit rows (the ground truth)."""
    g = torch.Generator().manual_seed(seed)
    G = torch.randn(n_features, d_model, generator=g, dtype=torch.float64)
    return (G / G.norm(dim=1, keepdim=True)).float()


def _firing_probabilities(n_features: int, mean_active: float) -> Tensor:
    """``p [n_features]`` float64: ``p_i`` proportional to ``1 / (i + 10)``, summing to ``mean_active``
    before each is capped at 1."""
    check_number("mean_active", mean_active, positive=True)
    p = 1.0 / (torch.arange(n_features, dtype=torch.float64) + 10.0)
    return (p * mean_active / p.sum()).clamp(max=1.0)


def expected_active(n_features: int, mean_active: float) -> float:
    """The mean number of features that fire per row of :func:`synthetic_activations`: ``mean_active``
    unless the cap of each probability at 1 binds (then fewer)."""
    return float(_firing_probabilities(n_features, mean_active).sum())


def synthetic_activations(
    n: int, d_model: int = 32, n_features: int = 256, mean_active: float = 5.0, noise: float = 0.02,
    seed: int = 0,
) -> tuple[Tensor, Tensor]:
    """``(x [n, d_model], G [n_features, d_model])``, both float32, following the module docstring."""
    if min(n, d_model, n_features) < 1:
        raise ValueError("synthetic_activations needs n, d_model, n_features >= 1")
    check_number("noise", noise, positive=False)
    p = _firing_probabilities(n_features, mean_active)
    G = synthetic_dictionary(d_model, n_features, seed)
    g = torch.Generator().manual_seed(seed + 1)
    scale = torch.exp(torch.empty(n_features, dtype=torch.float64).uniform_(-0.693, 0.693, generator=g))
    x = torch.empty(n, d_model, dtype=torch.float32)
    chunk = 8192
    for start in range(0, n, chunk):
        m = min(chunk, n - start)
        on = torch.rand(m, n_features, generator=g) < p.float()
        s = torch.empty(m, n_features).exponential_(1.0, generator=g)
        a = on * s * scale.float()
        x[start:start + m] = a @ G
    signal_std = float(x.std(0).mean()) if n > 1 else 1.0
    x += noise * signal_std * torch.randn(n, d_model, generator=g)
    return x, G


def load_activations(path: str) -> Tensor:
    """Read ``[N, D]`` activations from ``.npy``, ``.pt``/``.pth`` or ``.safetensors``, as float32.

    Raises ``FileNotFoundError`` or ``ValueError`` with a message naming the file and the problem
    (unknown extension, a file its reader cannot read, not a 2-D array of floats or signed
    integers, empty, or non-finite values).
    """
    if not os.path.exists(path):
        raise FileNotFoundError(f"activations file not found: {path}")
    ext = os.path.splitext(path)[1].lower()
    if ext not in (".npy", ".pt", ".pth", ".safetensors"):
        raise ValueError(f"{path}: unknown activations format {ext!r}; use .npy, .pt or .safetensors")
    try:
        obj = _read(path, ext)
    except Exception as e:  # truncated, corrupt or another kind of file: each reader raises its own type
        raise ValueError(f"{path}: cannot be read as a {ext} file ({_reason(e)})") from e
    return check_activations(_single_tensor(obj, path), path)


def _reason(e: Exception) -> str:
    """A reader's exception on one line: torch.load's weights-only refusal puts its reason after a
    paragraph of advice that does not apply to an activations file."""
    text = " ".join(str(e).split())
    if "WeightsUnpickler error:" in text:
        text = text.split("WeightsUnpickler error:", 1)[1].split(" Check the documentation", 1)[0].strip()
    return f"{type(e).__name__}: {text[:200]}"


def _read(path: str, ext: str):
    if ext == ".npy":
        import numpy as np

        arr = np.load(path, allow_pickle=False)
        if arr.dtype.kind in "fiu" and not arr.dtype.isnative:  # torch reads only the machine's byte order
            arr = arr.astype(arr.dtype.newbyteorder("="))
        return torch.from_numpy(arr)
    if ext in (".pt", ".pth"):
        return torch.load(path, map_location="cpu", weights_only=True)
    from safetensors.torch import load_file

    return load_file(path)


def _single_tensor(obj, path: str) -> Tensor:
    if isinstance(obj, Tensor):
        return obj
    if isinstance(obj, dict):
        if "activations" in obj:
            return obj["activations"]
        tensors = [v for v in obj.values() if isinstance(v, Tensor)]
        if len(tensors) == 1:
            return tensors[0]
        raise ValueError(f"{path}: holds {len(tensors)} tensors; name the activations 'activations'")
    raise ValueError(f"{path}: expected a tensor or a dict of tensors, got {type(obj).__name__}")


def check_activations(x: Tensor, name: str = "activations", d_model: Optional[int] = None) -> Tensor:
    """Validate ``[N, D]`` activations and return them as contiguous float32."""
    if not isinstance(x, Tensor):
        raise ValueError(f"{name}: expected a tensor, got {type(x).__name__}")
    x = x.detach()  # data: torch.save keeps requires_grad, and training would backpropagate into the set
    if x.layout != torch.strided or x.is_meta:  # sparse or meta tensors failed deep inside PyTorch
        raise ValueError(f"{name}: activations must be a dense tensor holding data, got layout {x.layout} on "
                         f"{x.device}")
    if x.dim() != 2:
        raise ValueError(f"{name}: activations must have shape [N, D], got shape {tuple(x.shape)}")
    if x.dtype not in FLOAT_DTYPES + (torch.int8, torch.int16) + INDEX_DTYPES:  # float8 has no isfinite
        raise ValueError(f"{name}: activations must be float16/bfloat16/float32/float64 or signed integers, got "
                         f"dtype {x.dtype}")
    if x.shape[0] < 1 or x.shape[1] < 1:
        raise ValueError(f"{name}: activations are empty (shape {tuple(x.shape)})")
    if d_model is not None and x.shape[1] != d_model:
        raise ValueError(f"{name}: activations have D={x.shape[1]}, the SAE expects d_model={d_model}")
    _check_finite(x, name, "non-finite values (NaN or inf)")
    x = x.float().contiguous()
    _check_finite(x, name, "finite values beyond float32's range, which float32 makes infinite")
    return x


def _check_finite(x: Tensor, name: str, what: str) -> None:
    bad = ~torch.isfinite(x)
    if bad.any():
        raise ValueError(f"{name}: activations contain {int(bad.sum())} {what} in {int(bad.any(1).sum())} rows")
