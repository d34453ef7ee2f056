"""One place that turns a launcher into a registered ``torch.library`` op.

Every sparsefuse op is a ``torch.library.custom_op`` named ``sparsefuse::<name>`` with a fake
(meta) implementation, so it survives ``torch.compile(fullgraph=True)``, and optionally a
registered autograd formula whose backward is itself one of these ops.

Device dispatch: the op's default implementation is the Triton launcher. On CPU tensors the
launcher still runs when ``TRITON_INTERPRET=1`` was set before sparsefuse was imported (that is
how CI exercises the real kernels without a GPU); otherwise CPU tensors go to the exact PyTorch
reference registered here as the ``cpu`` kernel.
"""

from __future__ import annotations

import os
from typing import Callable, Iterable, Optional

import torch

NAMESPACE = "sparsefuse"

#: True when Triton runs kernels on CPU tensors through its interpreter. Triton reads the
#: variable when a kernel is decorated, so it must be set before sparsefuse is imported.
INTERPRET: bool = os.environ.get("TRITON_INTERPRET", "0") == "1"


def register_op(
    name: str,
    *,
    fake: Callable,
    reference: Optional[Callable] = None,
    mutates_args: Iterable[str] = (),
    backward: Optional[Callable] = None,
    setup_context: Optional[Callable] = None,
):
    """Decorator: register ``launcher`` as ``torch.ops.sparsefuse.<name>``.

    Args:
        name: op name inside the ``sparsefuse`` namespace.
        fake: shape/dtype-only implementation (same signature) used under tracing.
        reference: pure-PyTorch implementation for CPU tensors when the Triton interpreter is off.
        mutates_args: names of arguments written in place (declared to the dispatcher).
        backward, setup_context: autograd formula, as for ``torch.library.register_autograd``.
    """

    def wrap(launcher: Callable):
        op = torch.library.custom_op(f"{NAMESPACE}::{name}", launcher, mutates_args=tuple(mutates_args))
        op.register_fake(fake)
        if reference is not None and not INTERPRET:
            op.register_kernel("cpu", reference)
        if backward is not None:
            op.register_autograd(backward, setup_context=setup_context)
        return op

    return wrap
