"""Kernel-level sweep for the SAE kernels (block sizes, warps, stages, variants). GPU only."""
import json, os, sys
import torch, triton, triton.language as tl
from triton.testing import do_bench
from sparsefuse.sae import kernels as kn
from sparsefuse.bench.sae import make_inputs

B, F, D = 4096, 65536, 2304
out = {}

def t(fn):
    fn(); torch.cuda.synchronize()
    return do_bench(fn, warmup=25, rep=100)

@triton.jit
def _wg_scalar_kernel(seg_ptr, order_ptr, vals_ptr, rows_ptr, gw_ptr, K, D, c, BLOCK_D: tl.constexpr):
    i_f = tl.program_id(0).to(tl.int64)
    o_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    m_d = o_d < D
    i_start = tl.load(seg_ptr + i_f)
    i_end = tl.load(seg_ptr + i_f + 1)
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for e in range(i_start, i_end):
        ent = tl.load(order_ptr + e)
        v = tl.load(vals_ptr + ent).to(tl.float32)
        acc += v * tl.load(rows_ptr + (ent // K) * D + o_d, mask=m_d, other=0)
    tl.store(gw_ptr + i_f * D + o_d, acc * c, mask=m_d)

for dtype in (torch.float32, torch.bfloat16):
    for K in (32, 128):
        idx, w, v, b, tg = make_inputs(B, K, F, D, dtype, "cuda")
        tag = f"{str(dtype)[6:]}-K{K}"
        acc = torch.float32
        # forward gather kernel sweep
        resid = torch.empty(B, D, device="cuda"); gv = torch.empty(B, K, device="cuda"); rl = torch.empty(B, device="cuda")
        BK = triton.next_power_of_2(K)
        for BD in (32, 64, 128, 256):
            for nw in (2, 4, 8):
                for ns in (1, 2, 3):
                    if BK * BD > 16384: continue
                    try:
                        ms = t(lambda: kn._sae_decode_fwd_kernel[(B,)](idx, v, w, b, tg, resid, gv, rl, K, D, F, D, 1,
                               HAS_BIAS=True, IS_LOSS=True, ACC=tl.float32, BLOCK_K=BK, BLOCK_D=BD, num_warps=nw, num_stages=ns))
                    except Exception as e:
                        ms = float("nan")
                    out[f"fwd {tag} BD={BD} nw={nw} ns={ns}"] = ms
        # hierarchical kernel modes
        gwbuf = torch.zeros(F, D, device="cuda"); gbr = torch.empty(B, D, device="cuda")
        for BD in (16, 32, 64, 128):
            for nw in (4, 8):
                for mode in (0, 1):
                    if BK * BD > 16384: continue
                    ms = t(lambda: kn._hierarchical_sae_fwd_kernel[(B,)](idx, v, w, b, tg, gwbuf, gv, gbr, rl, K, D, F, D, 1, 1e-9,
                           HAS_BIAS=True, WEIGHT_GRAD=mode, ACC=tl.float32, BLOCK_K=BK, BLOCK_D=BD, num_warps=nw))
                    out[f"hier {tag} mode={mode} BD={BD} nw={nw}"] = ms
        # weight-grad kernel variants
        keys = idx.reshape(-1)
        sk, order = torch.sort(keys, stable=True)
        seg = torch.searchsorted(sk, torch.arange(F + 1, device="cuda", dtype=keys.dtype))
        gw = torch.empty(F, D, device="cuda", dtype=dtype)
        out[f"sort+searchsorted {tag}"] = t(lambda: torch.searchsorted(torch.sort(keys, stable=True)[0], torch.arange(F + 1, device="cuda", dtype=keys.dtype)))
        for BE, BD, nw in ((16, 512, 4), (16, 512, 8), (4, 512, 4), (8, 256, 4), (2, 1024, 4), (4, 1024, 8), (1, 1024, 4)):
            ms = t(lambda: kn._sae_weight_grad_kernel[(F, triton.cdiv(D, BD))](seg, order, v, resid, None, gw, K, D, 1.0,
                   WEIGHTED=True, ROW_PER_ENTRY=False, HAS_SCALE=False, ACC=tl.float32, BLOCK_E=BE, BLOCK_D=BD, num_warps=nw))
            out[f"wg {tag} BE={BE} BD={BD} nw={nw}"] = ms
        for BD, nw in ((512, 4), (1024, 4), (1024, 8), (2304 and 2048, 8)):
            ms = t(lambda: _wg_scalar_kernel[(F, triton.cdiv(D, BD))](seg, order, v, resid, gw, K, D, 1.0, BLOCK_D=BD, num_warps=nw))
            out[f"wgscalar {tag} BD={BD} nw={nw}"] = ms
        out[f"zeros FxD fp32"] = t(lambda: torch.zeros(F, D, device="cuda"))
        out[f"copy FxD {tag}"] = t(lambda: gw.copy_(w))
        print(tag, "done", flush=True)

json.dump(out, open(os.path.join(os.environ.get("OUT", "."), "tune.json"), "w"), indent=1)
groups = {}
for k, ms in out.items():
    g = " ".join(k.split()[:2]) + (" " + k.split()[2] if k.startswith("hier") else "")
    groups.setdefault(g, []).append((ms, k))
for g, items in groups.items():
    items.sort()
    print(f"{g:32} best {items[0][0]:.3f} ms  {items[0][1]}   | worst {items[-1][0]:.3f}")
