"""The CPU implementations return the layouts the ops' fakes promise (two bugs found in review, session 50).

The ops' CPU implementations (CPU tensors without the Triton interpreter run ``reference.py``) must
return what the ops' fake implementations promise, as the kernels do: under ``torch.compile`` the
graph is built from the fakes, and a gradient laid out otherwise failed the compiled backward's
stride assertion.
"""

import torch

from helpers import run_without_interpreter
from sparsefuse.kd import reference as kd_ref
from sparsefuse.vq import reference as vq_ref


def column_major(t: torch.Tensor) -> torch.Tensor:
    return t.t().contiguous().t()


def test_cpu_quantize_backward_is_contiguous_for_a_column_major_x():
    """``vq_quantize_bwd``'s CPU implementation gave grad_x in x's layout; its fake (and the kernel)
    give a contiguous one. ``VectorQuantizer()(y.t())`` under ``torch.compile`` failed in the
    backward on CPU ("expected size 9==9, stride 1==5")."""
    x = column_major(torch.randn(9, 5))
    q = torch.randn(9, 5)
    grad_out = torch.randn(9, 5)
    g = vq_ref.quantize_bwd(grad_out, torch.tensor(1.5), x, q, 0.7)
    assert g.is_contiguous(), g.stride()
    torch.testing.assert_close(g, (x - q) * (1.5 * 2 * 0.7 / 45) + grad_out)


def test_cpu_gathered_kd_backward_is_contiguous_for_a_column_major_mask():
    """``kd_topk_bwd``'s CPU implementation gave the gradient in the layout of the mask (a transposed
    bool mask passed to ``topk_kd_loss``); its fake (and the kernel) give a contiguous one, so the
    compiled backward failed on CPU ("expected size 6==6, stride 1==4")."""
    z = torch.randn(6, 4, dtype=torch.float64)
    t = torch.log_softmax(torch.randn(6, 4, dtype=torch.float64), -1)
    mask = column_major(torch.rand(6, 4) > 0.3)
    scale = torch.tensor([0.25, 0.0], dtype=torch.float64)
    g = kd_ref.kd_topk_bwd(torch.tensor(1.0, dtype=torch.float64), None, z, t, mask, scale, 1.5)
    assert g.is_contiguous(), g.stride()
    want = kd_ref.kd_topk_bwd(torch.tensor(1.0, dtype=torch.float64), None, z, t, mask.contiguous(), scale, 1.5)
    torch.testing.assert_close(g, want)


def test_cpu_backward_ops_match_their_fakes_for_column_major_inputs():
    """The same two ops through ``torch.library.opcheck``'s fake-tensor test, on the CPU
    implementations (a fresh process without the interpreter)."""
    run_without_interpreter("""
import torch
import sparsefuse
from sparsefuse.vq import quantize

ops = torch.ops.sparsefuse
cm = lambda t: t.t().contiguous().t()
x, codebook = cm(torch.randn(9, 5)), torch.randn(7, 5)
codes = torch.randint(0, 7, (9,))
out, _ = quantize(x, codes, codebook, 0.7)
torch.library.opcheck(ops.vq_quantize_bwd.default, (torch.randn(9, 5), torch.tensor(1.0), x, out, 0.7),
                      test_utils=("test_faketensor",))
z, t = torch.randn(6, 4), torch.log_softmax(torch.randn(6, 4), -1)
mask = cm(torch.rand(6, 4) > 0.3)
_, tok, scale = ops.kd_topk(z, t, mask, 1.5, 1, None, 1.0)
torch.library.opcheck(ops.kd_topk_bwd.default, (torch.ones(()), tok, z, t, mask, scale, 1.5),
                      test_utils=("test_faketensor",))
print("ok")
""")
