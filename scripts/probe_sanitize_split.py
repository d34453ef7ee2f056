"""One KD hidden-state call of tests/sanitize_cases.py (argv: V dtype normalize ce_weight chunk), for
bisecting a compute-sanitizer report; scripts/sanitize_split.sh runs each under initcheck."""
import sys

import torch

sys.path.insert(0, "tests")
import sanitize_cases as sc  # noqa: E402

import sparsefuse  # noqa: E402

V, dt, norm, ce, chunk = sys.argv[1:6]
V, dt, ce = int(V), getattr(torch, dt), float(ce)
chunk = None if chunk == "None" else int(chunk)
ids, t, m, z, h, w, b, labels = sc._kd_inputs(11, 5, V, 40, dt, "cuda")
ps = sc.leaves(h, w, b)
loss = sparsefuse.topk_kd_loss_from_hidden(ps[0], ps[1], ids, t, m, normalize=norm, lm_head_bias=ps[2], labels=labels,
                                           ce_weight=ce, chunk_size=chunk, reduction="sum")
sc.grads(loss * 0.5, ps)
torch.cuda.synchronize()
print("ok")
