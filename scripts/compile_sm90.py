"""Compile the segmented-sum kernels for sm_90 on any machine (no GPU needed; Triton ships ptxas).

The CPU tier runs kernels under the interpreter, which does not type-check: a helper returning
fp32 in one constexpr branch and fp64 in the other, or a loop-carried variable that changes type,
only fails when the kernel is compiled for a GPU. This compiles every dtype and flag variant of the
kernels built on ``sparsefuse/_segsum.py`` (the SAE weight gradient and its sort keys, written by a
key pass or by the backward's finishing launch, the chunk kernel, the deterministic VQ statistics),
of the KD weight gradient (accumulators, row dtypes, key dtypes, optional pointers), of the KD row
kernels (dtypes, normalisations, cross-entropy) and of the "tail" slot marking, and exits non-zero
naming the first that fails. Run it without ``TRITON_INTERPRET`` (tests/test_launch.py
does, in a subprocess)."""
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


def compile_one(fn, types, const, num_warps=2, divisible=()):
    """Compile ``fn`` with pointer/integer ``types`` and constexpr ``const`` (None marks an absent
    optional pointer); the arguments named in ``divisible`` are specialised as multiples of 16, as a
    launch specialises 16-byte-aligned pointers and such integers. Returns the compiled kernel."""
    names = fn.arg_names
    sig = {n: "constexpr" if n in const else types[n] for n in names}
    src = ASTSource(fn=fn, signature=sig, constexprs={(names.index(n),): v for n, v in const.items()},
                    attrs={(names.index(n),): [["tt.divisibility", 16]] for n in divisible})
    return triton.compile(src, target=TARGET, options={"num_warps": num_warps})


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
                    R="i32", D="i32", NC="i32", row_div="i32", NKEYS="i32"),
               dict(CHUNK=128, WEIGHTED=weighted, HAS_WSUM=wsum, ACC=accs[acc], BLOCK_D=512, E=8,
                    **({} if weighted else dict(w_ptr=None)), **({} if wsum else dict(wpart_ptr=None))))
    for (idx, keys), (vals, gv), skip in itertools.product(
            (("i32", "i32"), ("i64", "i32"), ("i64", "i64")),
            (("fp32", "fp32"), ("bf16", "fp32"), ("fp16", "fp32"), ("fp64", "fp64")), (True, False)):
        yield (f"sae segment keys idx={idx} keys={keys} vals={vals} skip={skip}", sae._segment_keys_kernel,
               dict(idx_ptr="*" + idx, vals_ptr="*" + vals, gv_ptr="*" + gv, keys_ptr="*" + keys, M="i32", F="i32",
                    P="i32"),
               dict(SKIP=skip, BLOCK=1024, **({} if skip else dict(vals_ptr=None, gv_ptr=None))))
    for (acc, out), (idx, keys) in itertools.product(
            (("fp32", "fp32"), ("fp32", "bf16"), ("fp32", "fp16"), ("fp64", "fp64")),
            ((None, None), ("i32", "i32"), ("i64", "i32"), ("i64", "i64"))):
        yield (f"sae grads finish acc={acc} out={out} keys={keys}", sae._grads_finish_kernel,
               dict(gv_ptr="*" + acc, gvals_ptr="*" + out, colsum_ptr="*" + acc, gbias_ptr="*" + out, gc_ptr="*" + acc,
                    idx_ptr="*" + (idx or "i64"), vals_ptr="*" + out, keys_ptr="*" + (keys or "i32"), P="i32",
                    BK="i32", D="i32", F="i32", n_vals="i32"),
               dict(KEYS=keys is not None, ACC=accs[acc], BLOCK=1024,
                    **({} if keys else dict(idx_ptr=None, vals_ptr=None, keys_ptr=None))))
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
    for (z, acc), normalize, ce in itertools.product((("bf16", "fp32"), ("fp32", "fp32"), ("fp64", "fp64")),
                                                     (0, 1, 2), (False, True)):
        a = "*" + acc
        yield (f"kd row forward z={z} normalize={normalize} ce={ce}", kd._kd_row_fwd_kernel,
               dict(z_ptr="*" + z, ids_ptr="*i64", t_ptr="*" + z, m_ptr="*u8", lab_ptr="*i64", tok_ptr=a,
                    flag_ptr=a, lse_ptr=a, a_ptr=a, corr_ptr=a, ce_ptr=a, lse1_ptr=a, bit_ptr="*i32", V="i32",
                    K="i32", stride_zn="i32", stride_bn="i32", inv_t="fp64", temperature="fp64"),
               dict(NORMALIZE=normalize, HAS_CE=ce, SEP_CE=ce and normalize == 0, ACC=accs[acc], BLOCK_V=4096,
                    BLOCK_K=64, **({} if ce else dict(lab_ptr=None, ce_ptr=None, lse1_ptr=None)),
                    **({} if normalize == 2 else dict(bit_ptr=None))))
        if normalize == 2 and not ce:
            for ids in ("i32", "i64"):
                yield (f"kd mark slots z={z} ids={ids}", kd._kd_mark_slots_kernel,
                       dict(ids_ptr="*" + ids, t_ptr="*" + z, m_ptr="*u8", bit_ptr="*i32", K="i32", V="i32",
                            stride_bn="i32"),
                       dict(ACC=accs[acc], BLOCK_K=64))
        yield (f"kd row backward z={z} normalize={normalize} ce={ce}", kd._kd_row_bwd_kernel,
               dict(z_ptr="*" + z, g_ptr="*" + z, ids_ptr="*i64", m_ptr="*u8", lab_ptr="*i64", lse_ptr=a, a_ptr=a,
                    corr_ptr=a, lse1_ptr=a, gl_ptr=a, gt_ptr=a, scale_ptr=a, V="i32", K="i32", stride_zn="i32",
                    stride_gn="i32", inv_t="fp64", temperature="fp64", v_per_prog="i32"),
               dict(NORMALIZE=normalize, HAS_CE=ce, HAS_GL=True, HAS_GT=True, ACC=accs[acc], BLOCK_V=4096,
                    BLOCK_K=64, **({} if ce else dict(lab_ptr=None, lse1_ptr=None))))
    for w, acc in (("fp32", "fp32"), ("bf16", "fp32"), ("fp64", "fp64")):
        for project in (True, False):
            yield (f"sae unit rows w={w} project={project}", sae._unit_rows_kernel,
                   dict(w_ptr="*" + w, g_ptr="*" + w, D="i32", stride_wf="i32", stride_wd="i32", stride_gf="i32",
                        stride_gd="i32", eps="fp64"),
                   dict(PROJECT=project, ACC=accs[acc], BLOCK_D=1024))
    for acc, reduction, ce in itertools.product(("fp32", "fp64"), (0, 1, 2), (False, True)):
        a = "*" + acc
        yield (f"kd reduce acc={acc} reduction={reduction} ce={ce}", kd._kd_reduce_kernel,
               dict(tok_ptr=a, ce_ptr=a, flag_ptr=a, lab_ptr="*i64", items_ptr=a, loss_ptr=a, scale_ptr=a, N="i32",
                    items_value="fp64", ce_weight="fp64"),
               dict(REDUCTION=reduction, HAS_TOK=True, HAS_CE=ce, HAS_ITEMS=reduction == 2, ACC=accs[acc], BLOCK=1024,
                    **({} if ce else dict(ce_ptr=None, lab_ptr=None))))


def fp64_arithmetic(ptx: str) -> list:
    """The float64 instructions of a kernel other than reading a float64 argument and rounding it:
    a float32 kernel with any would do its math in float64 (an fp64-typed scalar used untyped)."""
    return [line.strip() for line in ptx.splitlines()
            if ".f64" in line and not line.strip().startswith(("ld.param.f64", "cvt.rn.f32.f64", "//", ".param"))]


def main() -> int:
    n = 0
    for name, fn, types, const in variants():
        try:
            kernel = compile_one(fn, types, const)
        except Exception as e:  # noqa: BLE001 - report which variant, then fail
            print(f"FAILED: {name}: {type(e).__name__}: {e}", file=sys.stderr)
            return 1
        if const.get("ACC") is tl.float32 and fp64_arithmetic(kernel.asm["ptx"]):
            print(f"FAILED: {name}: float64 arithmetic in a float32 kernel: {fp64_arithmetic(kernel.asm['ptx'])[:3]}",
                  file=sys.stderr)
            return 1
        n += 1
    print(f"compiled {n} kernel variants for sm_90")
    return 0


if __name__ == "__main__":
    sys.exit(main())
