"""The accumulation dtype, one rule for every family: float64 if any input is float64, else float32.

16-bit inputs are loaded in their storage dtype and summed in float32; float64 inputs are summed in
float64 end to end (the references, the kernels and the returned losses alike).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton.language as tl


def acc_dtype(*tensors: Optional[torch.Tensor]) -> torch.dtype:
    """float64 if any of ``tensors`` (None entries skipped) is float64, else float32."""
    return torch.float64 if any(t is not None and t.dtype == torch.float64 for t in tensors) else torch.float32


def tl_dtype(acc: torch.dtype):
    """The kernels' ``ACC`` constexpr for an accumulation dtype: ``tl.float64`` or ``tl.float32``."""
    return tl.float64 if acc == torch.float64 else tl.float32
