"""Input validation shared by every op: clear errors that name the offending argument.

Shape, dtype and device checks run in the public functions, so a bad call fails the same way in
eager mode and while ``torch.compile`` traces. The range check on index values reads the data, so
it runs inside the ops; on a GPU it would cost a host sync, so there it is off unless asked for
(see :func:`set_index_checks`).
"""

from __future__ import annotations

import math
import numbers
import os
from typing import Optional, Sequence

import torch
from torch._subclasses.fake_tensor import FakeTensor

from ._registry import PLAIN_TYPES

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
INDEX_DTYPES = (torch.int32, torch.int64)

def _mode_from_env() -> Optional[bool]:
    value = os.environ.get("SPARSEFUSE_CHECK_INDICES", "").strip().lower()
    return {"1": True, "true": True, "0": False, "false": False}.get(value)


_check_indices: Optional[bool] = _mode_from_env()


def set_index_checks(enabled: Optional[bool]) -> None:
    """Choose when index values are range-checked on the host.

    * ``None`` (default): check CPU tensors (free), skip CUDA tensors (a check there is a
      device-to-host sync, which would stall every training step).
    * ``True``: check everywhere; an index outside its range raises ``IndexError`` naming the
      argument, at the cost of one sync per call on a GPU. Use it while debugging a data pipeline.
    * ``False``: check nowhere.

    Unchecked or not, kernels never read or write out of bounds: an out-of-range index is never
    dereferenced, and the outputs that depend on it become NaN (never a plausible number). That
    includes weight-gradient rows fed by its NaN: in the SAE losses, those of the other latents of
    its row; from hidden states, the whole LM-head gradient. One exception: from hidden states with
    ``normalize="topk"`` and no cross-entropy, the loss and the token's hidden-state gradient are NaN
    but the bad slot is left out of the weight and bias gradients. The ops' PyTorch implementations
    (CPU tensors without the Triton interpreter) do the same.
    ``SPARSEFUSE_CHECK_INDICES=1`` / ``0`` sets the mode from the environment.
    """
    global _check_indices
    _check_indices = None if enabled is None else bool(enabled)


def index_checks_enabled(t: Optional[torch.Tensor] = None) -> bool:
    """Whether an index tensor like ``t`` (default: a CUDA tensor) is range-checked now."""
    if _check_indices is not None:
        return _check_indices
    return t is not None and t.is_cpu  # not t.device.type: that builds a string (~1 us a call)


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
    if shape is not None and t.shape != shape:  # equal sizes (the common case) skip the per-entry loop
        if t.dim() != len(shape):
            raise ValueError(f"{name} must have {len(shape)} dimensions, got shape {tuple(t.shape)}")
        for want, got in zip(shape, t.shape):
            if want is not None and want != got:
                expected = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
                raise ValueError(f"{name} has shape {tuple(t.shape)}; expected {expected}")
    if device is not None and t.device != device:
        raise ValueError(f"{name} is on {t.device} but the other inputs are on {device}")


def check_not_empty(name: str, t: torch.Tensor, dim: int, what: str) -> None:
    """Raise ``ValueError`` if ``t`` has no entries along ``dim``; ``what`` names one entry there
    ("row (F >= 1)")."""
    if t.shape[dim] < 1:
        raise ValueError(f"{name} must have at least one {what}, got shape {tuple(t.shape)}")


def check_index_range(name: str, idx: torch.Tensor, upper: int) -> None:
    """Raise ``IndexError`` if any entry of ``idx`` lies outside ``[0, upper)`` (when checks are on)."""
    if idx.numel() == 0 or not index_checks_enabled(idx):
        return
    bad = idx < 0
    if upper <= torch.iinfo(idx.dtype).max:  # a larger bound wraps in idx's dtype: int32 >= 2**31 is >= -2**31
        bad |= idx >= upper
    if bool(bad.any()):
        first = idx[bad].reshape(-1)[0].item()
        raise IndexError(f"{name} holds {first}, outside [0, {upper})")


def check_in_place(name: str, t: Optional[torch.Tensor]) -> None:
    """For a tensor an op rewrites in place: refuse one that requires grad while grad mode is on (as
    PyTorch's own in-place ops refuse a leaf), and one whose elements share memory (an expanded
    tensor, which PyTorch's in-place ops refuse too; a kernel would race on it)."""
    if t is None:
        return
    if t.requires_grad and torch.is_grad_enabled():
        raise ValueError(f"{name} requires grad, but it is rewritten in place: call this under torch.no_grad(), "
                         f"or keep {name} a buffer (or a Parameter with requires_grad=False)")
    if not torch.compiler.is_compiling() and torch._debug_has_internal_overlap(t) == 1:
        raise ValueError(f"{name} has elements that share memory (an expanded tensor?), but it is rewritten in place")
    check_not_inference(name, t)


def _span(x: torch.Tensor) -> tuple[int, int]:
    """[first byte, one past the last) of a view with non-negative strides."""
    last = sum((n - 1) * st for n, st in zip(x.shape, x.stride()))
    return x.data_ptr(), x.data_ptr() + (last + 1) * x.element_size()


def _has_memory(t: torch.Tensor) -> bool:
    """Whether ``t`` holds real memory to compare: not empty, not meta, not a FakeTensor (export,
    shape propagation), whose data pointers are all 0, nor a functorch wrapper (``vmap``), whose
    storage cannot be read."""
    return (t.numel() > 0 and not t.is_meta and not isinstance(t, FakeTensor)
            and not torch._C._functorch.is_functorch_wrapped_tensor(t))


def _overlap(t: torch.Tensor, other: torch.Tensor) -> bool:
    """Whether the byte ranges of two non-empty views of one storage intersect."""
    (a0, a1), (b0, b1) = _span(t), _span(other)
    return a0 < b1 and b0 < a1


def check_no_partial_overlap(name: str, t: torch.Tensor, other_name: str, other: torch.Tensor) -> None:
    """For a tensor rewritten in place while ``other`` is read: refuse the two sharing memory unless
    they are the same view (a kernel would read elements another program already rewrote; PyTorch's
    in-place ops refuse this too). Byte ranges are compared, so interleaved views of one buffer are
    refused as well."""
    if torch.compiler.is_compiling() or not (_has_memory(t) and _has_memory(other)):
        return
    if t.untyped_storage().data_ptr() != other.untyped_storage().data_ptr():
        return
    if t.data_ptr() == other.data_ptr() and t.shape == other.shape and t.stride() == other.stride() \
            and t.dtype == other.dtype:
        return
    if _overlap(t, other):
        raise ValueError(f"{name} and {other_name} share memory without being the same tensor, but {name} is "
                         f"rewritten in place while {other_name} is read: pass a copy of one of them")


def check_disjoint(named: dict) -> None:
    """For an op that rewrites several of ``named``'s tensors in place and reads the others: refuse
    any two that share memory, the same tensor passed twice included (one would be rewritten while
    the op still reads or writes the other). None entries are skipped; one storage pointer per
    tensor is compared first, so distinct buffers cost a few microseconds."""
    if torch.compiler.is_compiling():
        return
    tensors = [t for t in named.values() if t is not None]
    if all(type(t) in PLAIN_TYPES for t in tensors):  # the common case, in about a third of the time
        try:  # distinct storages: no pair below could match
            if len({t.untyped_storage().data_ptr() for t in tensors}) == len(tensors):
                return
        except NotImplementedError:  # a functorch wrapper: no storage to read (see _has_memory)
            pass
    items = [(n, t) for n, t in named.items() if t is not None and _has_memory(t)]
    ptrs = [t.untyped_storage().data_ptr() for _, t in items]
    if len(set(ptrs)) == len(ptrs):
        return
    for i, (name, t) in enumerate(items):
        for j in range(i):
            if ptrs[i] == ptrs[j] and _overlap(t, items[j][1]):
                raise ValueError(f"{items[j][0]} and {name} share memory, but the op rewrites some of them in "
                                 f"place while it reads the others: pass separate tensors (a copy of one of them)")


def check_not_inference(name: str, t: Optional[torch.Tensor]) -> None:
    """Refuse to rewrite in place, outside inference mode, a tensor made under
    ``torch.inference_mode()``, as PyTorch's in-place ops and the registered ops do (the eager paths
    launch the kernels without the dispatcher, which would raise)."""
    if (t is not None and not torch.compiler.is_compiling() and t.is_inference()
            and not torch.is_inference_mode_enabled()):
        raise RuntimeError(f"{name} was made under torch.inference_mode() and cannot be rewritten in place outside "
                           f"it: clone it first, or run this under torch.inference_mode()")


def use_deterministic(deterministic: Optional[bool]) -> bool:
    """The ops' ``deterministic`` option: None follows ``torch.use_deterministic_algorithms``."""
    return torch.are_deterministic_algorithms_enabled() if deterministic is None else bool(deterministic)


def check_positive_int(name: str, n) -> None:
    """A Python int >= 1 (not a bool): the modules' sizes, counts and batch sizes."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"{name} must be a positive int, got {n!r}")


def check_number(name: str, x, *, positive: bool) -> float:
    """A finite Python or NumPy number (not a bool), > 0 (``positive``) or >= 0, as a float. A tensor
    is refused: reading its value (float(tensor)) would be a host sync. Finiteness is two comparisons,
    not ``math.isfinite``, which Dynamo cannot trace on a number it made symbolic (``dynamic=True``,
    or a value that changed between calls)."""
    if type(x) is float or type(x) is int:  # the common case, without the ABC check (host time per step)
        ok = -math.inf < x < math.inf
    elif isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a Python number, not a tensor (reading a tensor's value is a host sync)")
    else:
        ok = isinstance(x, numbers.Real) and not isinstance(x, bool) and -math.inf < x < math.inf
    if not ok or not (x > 0 if positive else x >= 0):
        raise ValueError(f"{name} must be a {'positive' if positive else 'non-negative'} finite number, got {x!r}")
    return float(x)
