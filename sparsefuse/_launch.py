"""Low-overhead kernel launches, shared by every family.

``kernel[grid](...)`` re-derives Triton's specialisation of every argument on each call; for the
small per-step kernels (the EMA update: about 25 arguments, microseconds of device work) that host
work was most of an update's time (about 45 us a launch on an H200 host), and SAE training steps
at K <= 64 were host-bound for the same reason. :func:`launch` keys a cache of
compiled kernels by exactly what Triton specialises on (pointer dtype and 16-byte alignment; for an
integer, whether it is 1, divisible by 16, and its type (i32, i64, or u64 from 2^63), or only its
type for parameters marked ``do_not_specialize``; None; constexpr values; device), so
a cached kernel is only reused where Triton would have picked the same one, and launched the way
``JITFunction.run`` launches it (same stream, metadata and hooks). The interpreter takes the
ordinary path.
"""

from __future__ import annotations

import os
import threading

import torch
from triton import knobs

from ._registry import INTERPRET

try:
    from torch._C import _cuda_getCurrentRawStream as _current_stream
except ImportError:  # CPU-only builds: never reached (launch() takes the ordinary path on CPU)
    def _current_stream(idx):
        return torch.cuda.current_stream(idx).cuda_stream

_CACHE: dict = {}
_NOSPEC: dict = {}
#: ``SPARSEFUSE_FAST_LAUNCH=0`` sends every launch through ``kernel[grid](...)``.
FAST = os.environ.get("SPARSEFUSE_FAST_LAUNCH", "1") != "0"
_I32 = 2**31
_I64 = 2**63


def _arg_key(a):
    if isinstance(a, torch.Tensor):
        return a.dtype, a.data_ptr() % 16 == 0
    if a is None or isinstance(a, bool):
        return a
    if isinstance(a, int):  # Triton's integer types: i32, else i64, else (from 2^63) u64
        return a == 1, a % 16 == 0, -_I32 <= a < _I32, a >= _I64
    if isinstance(a, float):
        return float
    return a


def _nospec_key(a):
    """The key of an argument of a ``do_not_specialize`` parameter: an integer's type only (not its
    value); anything else (a float, bool, None) is typed as elsewhere."""
    if type(a) is int:
        return -_I32 <= a < _I32, a >= _I64
    return _arg_key(a)


def _first_tensor(args):
    """The tensor whose device a launch goes to: the first argument, or, where that is an optional
    tensor passed as None, the first tensor given."""
    a0 = args[0]
    return a0 if a0 is not None else next(a for a in args if hasattr(a, "is_cuda"))


def _hooked(hook) -> bool:
    """Whether a Triton launch hook would call anything (a HookChain holds a list of calls)."""
    return hook is not None and bool(getattr(hook, "calls", True))


# Host-side arithmetic for grids and block sizes. Triton 3.6's ``triton.cdiv`` and
# ``triton.next_power_of_2`` are constexpr functions whose host calls cost a few microseconds each
# (argument unwrapping on every call); a hierarchical SAE step made 13 of them.
def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_pow2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1)."""
    return 1 << max(int(n) - 1, 0).bit_length()


def launch(fn, grid, args, meta, num_warps, num_stages=None):
    """``fn[grid](*args, **meta, num_warps=num_warps)``; ``meta`` holds the constexpr arguments, which
    follow ``args`` in the kernel's signature. Launched on the device of the first tensor in ``args``
    (Triton itself launches on the current device, and custom ops set no device guard)."""
    opts = dict(num_warps=num_warps) if num_stages is None else dict(num_warps=num_warps, num_stages=num_stages)
    t0 = _first_tensor(args)
    if INTERPRET or not t0.is_cuda:
        fn[grid](*args, **meta, **opts)
        return
    dev = torch.cuda.current_device()
    if t0.get_device() != dev:  # Triton launches on the current device: make it the tensors' one
        with torch.cuda.device(t0.get_device()):
            return launch(fn, grid, args, meta, num_warps, num_stages)
    if not FAST:
        fn[grid](*args, **meta, **opts)
        return
    nospec = _NOSPEC.get(fn)
    if nospec is None:
        nospec = _NOSPEC[fn] = frozenset(i for i, p in enumerate(fn.params) if p.do_not_specialize)
    if nospec:
        arg_keys = tuple(_nospec_key(a) if i in nospec else _arg_key(a) for i, a in enumerate(args))
    else:
        arg_keys = tuple(map(_arg_key, args))
    key = (fn, dev, num_warps, num_stages, tuple(meta.items()), arg_keys)
    kernel = _CACHE.get(key)
    if kernel is None:
        _CACHE[key] = fn[grid](*args, **meta, **opts)
        return
    all_args = (*args, *(meta[name] for name in fn.arg_names[len(args):]))
    stream = _current_stream(dev)
    n = len(grid)
    g1, g2 = (grid[1] if n > 1 else 1), (grid[2] if n > 2 else 1)
    rt = knobs.runtime
    enter, leave = rt.launch_enter_hook, rt.launch_exit_hook
    if _hooked(enter) or _hooked(leave):  # a profiler's hooks: launched exactly as Triton launches
        kernel.run(grid[0], g1, g2, stream, kernel.function, kernel.packed_metadata,
                   kernel.launch_metadata(grid, stream, *all_args), enter, leave, *all_args)
    else:  # no hooks: no launch metadata to build and no empty hook chains to call (a few us a launch)
        kernel.run(grid[0], g1, g2, stream, kernel.function, kernel.packed_metadata, None, None, None, *all_args)


_TUNED: dict = {}
_TUNE_LOCK = threading.RLock()


def launch_tuned(tuner, grid_fn, args, meta, tune_key):
    """Launch a ``triton.autotune``-wrapped kernel: the first call for ``tune_key`` goes through the
    autotuner; later calls launch its pick through :func:`launch` (the autotuner's own dispatch costs
    tens of microseconds of host time per call). ``tune_key`` must determine the autotuner's key
    (its key arguments and the dtypes of the tensors)."""
    cfg = _TUNED.get(tune_key)
    if cfg is None or INTERPRET or not FAST:
        t0 = _first_tensor(args)
        if not INTERPRET and t0.is_cuda and t0.get_device() != torch.cuda.current_device():
            with torch.cuda.device(t0.get_device()):  # as in launch()
                return launch_tuned(tuner, grid_fn, args, meta, tune_key)
        with _TUNE_LOCK:  # the autotuner keeps its pick in one attribute: two threads tuning at once
            tuner[grid_fn](*args, **meta)  # could each read the other's
            if not INTERPRET:
                _TUNED[tune_key] = tuner.best_config
        return
    launch(tuner.fn, grid_fn(cfg.kwargs), args, {**meta, **cfg.kwargs}, cfg.num_warps, cfg.num_stages)
