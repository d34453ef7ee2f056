"""One place that turns a launcher into a registered ``torch.library`` op.

Every sparsefuse op is a ``torch.library.custom_op`` named ``sparsefuse::<name>`` with a fake
(meta) implementation, so it survives ``torch.compile(fullgraph=True)``, and optionally a
registered autograd formula whose backward is itself one of these ops.

Device dispatch: the op's default implementation is the Triton launcher. On CPU tensors the
launcher still runs when ``TRITON_INTERPRET=1`` was set before sparsefuse was imported (that is
how CI exercises the real kernels without a GPU); otherwise CPU tensors go to the exact PyTorch
reference registered here as the ``cpu`` kernel.

Eager fast path: going through the dispatcher and ``torch.library``'s Python autograd layer costs
a few hundred microseconds of host time per training step, which on a GPU is longer than the
kernels of a small step. So in plain eager mode (no ``torch.compile`` tracing, no dispatch mode,
plain tensors) the returned op calls the same implementation directly, with the same
``setup_context`` / ``backward`` wrapped in an ``autograd.Function``, and bumps the version
counters of the arguments it mutates as the dispatcher would (so autograd still refuses a tensor
saved for backward and then changed in place). Anything else (compile, ``torch.jit.trace``,
``opcheck``, fake or functional tensors, ``torch.vmap``) goes through the registered op. The
VQ and KD public functions, which keep their own eager paths, use the same helpers:
:func:`plain_eager` and :func:`bump_versions`, and :func:`refuse_transforms` and
:func:`first_order` for the derivatives the ops do not have (forward mode, functorch's reverse
mode, second derivatives): each raises ``NotImplementedError`` rather than return a wrong one.
"""

from __future__ import annotations

import functools
import inspect
import os
from typing import Callable, Iterable, Optional

import torch
import torch.autograd.forward_ad as _forward_ad

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
        backward, setup_context: autograd formula, as for ``torch.library.register_autograd``
            (``backward`` is wrapped in :func:`first_order`).
    """
    if backward is not None:
        backward = first_order(backward)

    def wrap(launcher: Callable):
        op = torch.library.custom_op(f"{NAMESPACE}::{name}", launcher, mutates_args=tuple(mutates_args))
        op.register_fake(fake)
        cpu_impl = launcher
        if reference is not None and not INTERPRET:
            cpu_impl = _without_autocast(reference)
            op.register_kernel("cpu", cpu_impl)
        if backward is not None:
            op.register_autograd(backward, setup_context=setup_context)
        params = list(inspect.signature(launcher).parameters)
        mutated = tuple(params.index(a) for a in mutates_args)
        return RegisteredOp(op, launcher, cpu_impl, backward, setup_context, mutated)

    return wrap


class RegisteredOp:
    """A ``torch.library`` op plus its eager fast path (see the module docstring).

    Calling it runs the op; attribute access falls through to the ``CustomOpDef``.
    """

    def __init__(self, op, launcher, cpu_impl, backward, setup_context, mutated=()):
        self.op = op
        self._mutated = mutated  # positions of the arguments written in place
        self._launcher = launcher
        self._cpu_impl = cpu_impl
        self._function = None
        if backward is not None:
            impl = self._impl
            self._function = type(
                f"{op._name.split('::')[-1]}_function",
                (torch.autograd.Function,),
                {
                    "forward": staticmethod(lambda *args: impl(args)(*args)),
                    "setup_context": staticmethod(setup_context),
                    "backward": staticmethod(backward),
                },
            )
            # Function.apply first binds the arguments to forward's signature (an inspect.signature
            # call, ~15 us of host time a step); forward takes *args, so that binding changes
            # nothing, and with no functorch transform active (plain_eager) apply goes straight on
            # to the C implementation, which is what this is.
            self._apply = super(torch.autograd.Function, self._function).apply

    def _impl(self, args):
        for a in args:
            if isinstance(a, torch.Tensor):
                return self._cpu_impl if a.is_cpu else self._launcher  # not device.type: a string a call
        return self._launcher

    def __call__(self, *args):
        if not plain_eager(args):
            return self.op(*args)
        if self._function is not None and torch.is_grad_enabled() and any(
            isinstance(a, torch.Tensor) and a.requires_grad for a in args
        ):
            return self._apply(*args)
        impl = self._impl(args)
        if impl is self._cpu_impl and self._function is None and torch.is_grad_enabled():
            # An op without a backward records no graph, as its kernels record none: the reference
            # would otherwise tie what it writes (VQ state, a weight's .grad) to its inputs' graph.
            with torch.no_grad():
                out = impl(*args)
        else:
            out = impl(*args)
        if self._mutated:
            bump_versions(*(args[i] for i in self._mutated))
        return out

    def __getattr__(self, attr):
        return getattr(self.op, attr)


def _without_autocast(reference: Callable) -> Callable:
    """The CPU reference with CPU autocast off while it runs: its einsums and matmuls are the op's
    arithmetic (float32, float64 for float64), not the caller's autocast dtype, as the kernels'
    arithmetic is on every path (under bf16 autocast the reference decode was off by 2e-2)."""

    @functools.wraps(reference)
    def run(*args):
        if torch.is_autocast_enabled("cpu"):
            with torch.autocast("cpu", enabled=False):
                return reference(*args)
        return reference(*args)

    return run


#: exact types of plain tensors (a subclass, such as FakeTensor or a wrapper, is not one)
PLAIN_TYPES = (torch.Tensor, torch.nn.Parameter)


def plain_eager(args) -> bool:
    """Cheap (it runs on every call): no tracing (Dynamo or ``torch.jit.trace``), no dispatch mode,
    no functorch transform, and every tensor argument a plain CPU or CUDA tensor.

    Raises ``NotImplementedError`` for forward-mode AD and functorch's reverse mode (see
    :func:`refuse_transforms`)."""
    if torch.compiler.is_compiling():  # first: Dynamo must not trace the checks below
        return False
    if torch._C._get_tracing_state() is not None:  # torch.jit.trace records the op, not its launches
        return False
    if refuse_transforms(args):
        return False
    if torch._C._len_torch_dispatch_stack():
        return False
    for a in args:
        if isinstance(a, torch.Tensor) and (type(a) not in PLAIN_TYPES or not (a.is_cuda or a.is_cpu)):
            return False
    return True


def refuse_transforms(args, *, functorch_ok: bool = True) -> bool:
    """Raise ``NotImplementedError`` where an argument would need a derivative rule these ops do not
    have: forward-mode AD (:func:`_refuse_forward_ad`), and functorch's reverse-mode transforms
    (``torch.func.grad``, ``vjp``, ``jacrev``) over an argument the transform differentiates (one
    it wraps that requires grad; a captured ``nn.Parameter`` is not one). Under a ``vmap`` inside
    such a transform (``grad(lambda v: vmap(f)(v).sum())``) the batched wrappers hide which
    arguments are differentiated, so there any wrapped argument is refused. Their autograd formulas
    are registered for ``torch.autograd``, which functorch does not use for custom ops, so PyTorch
    itself failed with a message about ``setup_context``.
    ``torch.vmap`` alone passes (the registered ops run per sample). ``functorch_ok=False`` (callers
    whose own ``autograd.Function`` has no functorch support) refuses every functorch transform.
    Returns whether a functorch transform is active; False, checking nothing, while
    ``torch.compile`` traces."""
    if torch.compiler.is_compiling():
        return False
    functorch = torch._C._functorch.peek_interpreter_stack() is not None
    if functorch:
        _refuse_forward_ad(args, functorch=True)
        if not functorch_ok:
            raise NotImplementedError(_NO_FUNCTORCH)
        grad = torch._C._functorch.TransformType.Grad
        level = torch._C._functorch.maybe_get_level  # -1 for a tensor no transform wraps (a captured Parameter)
        stack = torch._C._functorch.get_interpreter_stack()
        if torch.is_grad_enabled() and any(i.key() == grad for i in stack):
            innermost = stack[-1].key() == grad  # else a vmap inside grad: its wrappers do not require grad
            if any(isinstance(a, torch.Tensor) and level(a) != -1 and (a.requires_grad or not innermost)
                   for a in args):
                raise NotImplementedError(_NO_FUNCTORCH_GRAD)
    elif _forward_ad._current_level >= 0:  # inside torch.autograd.forward_ad.dual_level()
        _refuse_forward_ad(args, functorch=False)
    return functorch


_NO_FUNCTORCH_GRAD = ("sparsefuse ops do not support functorch's reverse-mode transforms (torch.func.grad, vjp, "
                      "jacrev); differentiate with torch.autograd (loss.backward(), torch.autograd.grad)")
_NO_FUNCTORCH = ("this sparsefuse function does not run under functorch transforms (torch.func.grad, vjp, jacrev, "
                 "vmap); call it outside the transform and differentiate with torch.autograd")
_legacy_batched = torch._C._functorch.is_legacy_batchedtensor
_NO_BATCHED_BACKWARD = ("sparsefuse ops have no batched backward: their backward cannot run under torch.vmap "
                        "(torch.autograd.grad(..., is_grads_batched=True), "
                        "torch.autograd.functional.jacobian(vectorize=True)); compute one gradient at a time")
_NO_SECOND_DERIVATIVE = ("sparsefuse ops have no second derivative, so their backward cannot run with "
                         "create_graph=True (gradient penalties, Hessian-vector products, meta-learning through "
                         "them); compute first-order gradients only")


def first_order(backward: Callable) -> Callable:
    """Wrap an autograd ``backward(ctx, *grads)`` of these ops, which have no second derivative.

    Run with ``create_graph=True`` (grad mode on inside a backward), the kernels' gradients would
    come back as constants: a gradient penalty or ``torch.autograd.functional.hvp`` built on them
    would silently lose their second-order terms (the CPU references recorded part of them). So that
    raises ``NotImplementedError`` instead. (Handing the gradients back attached to a node that
    raises only when differentiated, as ``once_differentiable`` does, is not enough: ``autograd.grad``
    prunes nodes off the path to its inputs, so that node must be wired to every input of the op,
    which would keep activations such as KD's hidden states alive until the backward.) A backward
    under ``torch.vmap`` (batched incoming gradients: ``is_grads_batched=True``,
    ``jacobian(vectorize=True)``) raises too: the kernels cannot read batched tensors. Otherwise
    this costs two calls and a flag read."""

    @functools.wraps(backward)
    def wrapper(ctx, *grads):
        if not torch.compiler.is_compiling():
            if torch.is_grad_enabled():
                raise NotImplementedError(_NO_SECOND_DERIVATIVE)
            if torch._C._functorch.peek_interpreter_stack() is not None or any(
                    g is not None and _legacy_batched(g) for g in grads):  # is_grads_batched: the old vmap
                raise NotImplementedError(_NO_BATCHED_BACKWARD)
        return backward(ctx, *grads)

    return wrapper


_NO_FORWARD_AD = ("sparsefuse ops have no forward-mode AD formula (torch.func.jvp / jacfwd, or dual tensors of "
                  "torch.autograd.forward_ad); differentiate in reverse mode (loss.backward(), torch.autograd.grad)")


def _refuse_forward_ad(args, functorch: bool) -> None:
    """A custom op without a forward-mode formula hands back no tangent (zeros under
    ``torch.func.jvp``) without complaint; refuse, rather than return a wrong derivative.

    An argument carrying a tangent is refused: under a forward-AD dual level, or under a functorch
    transform whose innermost level is a Jvp (``jvp``, ``jacfwd``). Arguments without one
    (constants, detached values, integer ids) run. A Jvp level below another transform (``vmap``
    or ``grad`` inside ``jvp``) hides its tangents behind that transform's wrappers, so there any
    wrapped argument is refused: an error where a zero tangent might be right, never the reverse."""
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    stack = (torch._C._functorch.get_interpreter_stack() or ()) if functorch else ()
    jvp = torch._C._functorch.TransformType.Jvp
    if stack and stack[-1].key() != jvp:  # a Jvp level, if any, hides below another transform
        refuse = any(i.key() == jvp for i in stack) and any(
            torch._C._functorch.is_functorch_wrapped_tensor(t) for t in tensors)
    else:
        refuse = any(_forward_ad.unpack_dual(t).tangent is not None for t in tensors)
    if refuse:
        raise NotImplementedError(_NO_FORWARD_AD)


def bump_versions(*tensors) -> None:
    """Mark tensors a launcher wrote in place as modified for autograd (``None`` entries skipped)."""
    torch.autograd.graph.increment_version([t for t in tensors if t is not None])
