"""Compile the segmented-sum kernels for sm_90 on any machine (no GPU needed; Triton ships ptxas).

The CPU tier runs kernels under the interpreter, which does not type-check: a helper returning
fp32 in one constexpr branch and fp64 in the other, or a loop-carried variable that changes type,
only fails when the kernel is compiled for a GPU. This compiles every dtype and flag variant of the
kernels built on ``sparsefuse/_segsum.py`` (the SAE weight gradient, the chunk kernel, the
deterministic VQ statistics) and of the KD weight gradient (accumulators, row dtypes, key dtypes,
optional pointers), and exits non-zero naming the first that fails. Run it without ``TRITON_INTERPRET`` (tests/test_launch.py does, in a subprocess)."""
import itertools
import os
import sys

assert os.environ.get("TRITON_INTERPRET", "0") in ("", "0"), "unset TRITON_INTERPRET: it replaces the compiler"

import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from sparsefuse import _segsum  # noqa: E402
from sparsefuse.kd import kernels as kd  # noqa: E402
from sparsefuse.sae import kernels as sae  # noqa: E402
from sparsefuse.vq import kernels as vq  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)


def compile_one(fn, types, const, num_warps=2):
    """Compile ``fn`` with pointer/integer ``types`` and constexpr ``const`` (None marks an absent
    optional pointer)."""
    names = fn.arg_names
    sig = {n: "constexpr" if n in const else types[n] for n in names}
    src = ASTSource(fn=fn, signature=sig, constexprs={(names.index(n),): v for n, v in const.items()}, attrs={})
    triton.compile(src, target=TARGET, options={"num_warps": num_warps})


def variants():
    """(name, kernel, argument types, constexprs) of every variant a launcher can pick."""
    accs = {"fp32": tl.float32, "fp64": tl.float64}
    for (acc, rows), weighted, wsum, per_entry in itertools.product(
            (("fp32", "fp32"), ("fp32", "bf16"), ("fp32", "fp16"), ("fp64", "fp64")), (True, False), (True, False),
            (True, False)):
        a, r = "*" + acc, "*" + rows
        yield (f"sae weight grad acc={acc} rows={rows} weighted={weighted} wsum={wsum} row_per_entry={per_entry}",
               sae._sae_weight_grad_kernel,
               dict(seg_ptr="*i64", order_ptr="*i64", vals_ptr=r, rows_ptr=r, part_ptr=a, wpart_ptr=a, scale_ptr=a,
                    gw_ptr=r, wsum_ptr=a, K="i32", D="i32", stride_gw="i32"),
               dict(WEIGHTED=weighted, ROW_PER_ENTRY=per_entry, HAS_SCALE=True, HAS_WSUM=wsum, ACC=accs[acc],
                    BLOCK_D=512, CHUNK=128, E=_segsum.GATHER_STEP, **({} if weighted else dict(vals_ptr=None))))
    for keys, (acc, rows), (weighted, wsum) in itertools.product(
            ("i32", "i64"), (("fp32", "fp32"), ("fp32", "bf16"), ("fp32", "fp16"), ("fp64", "fp64")),
            ((True, True), (True, False), (False, False))):
        a, r = "*" + acc, "*" + rows
        yield (f"chunk kernel keys={keys} acc={acc} rows={rows} weighted={weighted} wsum={wsum}",
               _segsum._segment_chunks_kernel,
               dict(keys_ptr="*" + keys, order_ptr="*i64", w_ptr=r, rows_ptr=r, part_ptr=a, wpart_ptr=a, M="i32",
                    R="i32", D="i32", NC="i32", row_div="i32"),
               dict(CHUNK=128, WEIGHTED=weighted, HAS_WSUM=wsum, ACC=accs[acc], BLOCK_D=512, E=8,
                    **({} if weighted else dict(w_ptr=None)), **({} if wsum else dict(wpart_ptr=None))))
    for x, counters in itertools.product(("fp32", "bf16", "fp16", "fp64"), (True, False)):
        yield (f"vq segment x={x} counters={counters}", vq._vq_ema_segment_kernel,
               dict(x_ptr="*" + x, order_ptr="*i64", seg_ptr="*i64", part_ptr="*fp32", stats_ptr="*fp32",
                    cs_ptr="*fp32", cnt_ptr="*i32", B="i32", K="i32", D="i32", NC="i32"),
               dict(HAS_COUNTERS=counters, BLOCK_D=128, CHUNK=64, E=_segsum.GATHER_STEP,
                    **({} if counters else dict(cnt_ptr=None))))
    for h, acc in (("bf16", "fp32"), ("fp16", "fp32"), ("fp32", "fp32"), ("fp64", "fp64")):
        yield (f"kd weight grad h={h}", kd._kd_weight_grad_kernel.fn,
               dict(seg_ptr="*i64", key_ptr="*i64", order_ptr="*i64", g_ptr="*" + acc, h_ptr="*" + h,
                    gw_ptr="*" + h, V="i32", H="i32", K="i32", alpha="fp32"),
               dict(SPLIT=h in ("bf16", "fp16"), ACC=accs[acc], BLOCK_V=64, BLOCK_E=32, BLOCK_H=128))


def main() -> int:
    n = 0
    for name, fn, types, const in variants():
        try:
            compile_one(fn, types, const)
        except Exception as e:  # noqa: BLE001 - report which variant, then fail
            print(f"FAILED: {name}: {type(e).__name__}: {e}", file=sys.stderr)
            return 1
        n += 1
    print(f"compiled {n} kernel variants for sm_90")
    return 0


if __name__ == "__main__":
    sys.exit(main())
