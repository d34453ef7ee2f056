"""Input validation shared by every op: clear errors that name the offending argument.

Shape, dtype and device checks run wherever the op runs, the fake implementation included, so a
bad call fails the same way in eager mode and while ``torch.compile`` traces. The value check on
indices reads the data, so it runs only in real implementations; it costs one host sync and can be
switched off (see :func:`set_index_checks`).
"""

from __future__ import annotations

import os
from typing import Optional, Sequence

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
INDEX_DTYPES = (torch.int32, torch.int64)

_check_indices = os.environ.get("SPARSEFUSE_CHECK_INDICES", "1") != "0"


def set_index_checks(enabled: bool) -> None:
    """Turn the host-side range check on index tensors on or off (default on).

    On: an index outside its range raises ``IndexError`` naming the argument, at the cost of one
    device-to-host sync per call. Off: no sync; kernels still never read or write out of bounds,
    and an out-of-range index turns the outputs that depend on it into NaN (never silently into a
    plausible number). The environment variable ``SPARSEFUSE_CHECK_INDICES=0`` sets the default.
    """
    global _check_indices
    _check_indices = bool(enabled)


def index_checks_enabled() -> bool:
    return _check_indices


def check_tensor(
    name: str,
    t: Optional[torch.Tensor],
    *,
    shape: Optional[Sequence[Optional[int]]] = None,
    dtypes: Optional[Sequence[torch.dtype]] = None,
    device: Optional[torch.device] = None,
    optional: bool = False,
) -> None:
    """Raise ``TypeError``/``ValueError`` naming ``name`` unless ``t`` fits.

    ``shape`` is a sequence of expected sizes; ``None`` entries match any size. Its length is the
    expected rank.
    """
    if t is None:
        if optional:
            return
        raise TypeError(f"{name} must be a tensor, got None")
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a tensor, got {type(t).__name__}")
    if dtypes is not None and t.dtype not in dtypes:
        allowed = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise TypeError(f"{name} has dtype {str(t.dtype).replace('torch.', '')}; expected one of {allowed}")
    if shape is not None:
        if t.dim() != len(shape):
            raise ValueError(f"{name} must have {len(shape)} dimensions, got shape {tuple(t.shape)}")
        for want, got in zip(shape, t.shape):
            if want is not None and want != got:
                expected = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
                raise ValueError(f"{name} has shape {tuple(t.shape)}; expected {expected}")
    if device is not None and t.device != device:
        raise ValueError(f"{name} is on {t.device} but the other inputs are on {device}")


def check_index_range(name: str, idx: torch.Tensor, upper: int) -> None:
    """Raise ``IndexError`` if any entry of ``idx`` lies outside ``[0, upper)`` (when checks are on)."""
    if not _check_indices or idx.numel() == 0:
        return
    bad = (idx < 0) | (idx >= upper)
    if bool(bad.any()):
        first = idx[bad].reshape(-1)[0].item()
        raise IndexError(f"{name} holds {first}, outside [0, {upper})")
