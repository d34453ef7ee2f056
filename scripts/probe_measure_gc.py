"""Which benchmark cases leave CUDA memory in reference cycles (freed only by the collector)?

Runs the cases of one bench family in order, measuring each as the harness does; before each case
it collects garbage with DEBUG_SAVEALL and lists the CUDA tensors (>= 64 MiB) that only the
collector could free, with the types of the objects in those cycles; and again after the
case's first call (where compilation and autotuning run) and its second. A cycle that survives into
the next measurement can be freed in the middle of it and make the peak-memory reading too low
(the logits-full 2.1 MiB reading of session 13). Usage: python scripts/probe_measure_gc.py kd OUT.json
"""

import collections
import gc
import importlib
import json
import sys

import torch

from sparsefuse.bench import harness


def _is_cuda_tensor(o):
    try:  # the garbage holds dead weakref proxies, whose every attribute raises
        return isinstance(o, torch.Tensor) and o.is_cuda
    except ReferenceError:
        return False


def cyclic():
    """CUDA memory (MiB) that only the collector can free now, the large tensors in it, and the
    commonest object types of the cycles; the garbage is then freed."""
    gc.set_debug(gc.DEBUG_SAVEALL)
    gc.collect()
    tensors = [o for o in gc.garbage if _is_cuda_tensor(o)]
    mib = sum(o.untyped_storage().nbytes() for o in tensors) / 2**20
    big = [(tuple(o.shape), str(o.dtype)) for o in tensors if o.numel() * o.element_size() >= 2**26]
    kinds = collections.Counter(type(o).__name__ for o in gc.garbage).most_common(6)
    gc.garbage.clear()
    gc.set_debug(0)
    gc.collect()
    return dict(cuda_mib=round(mib, 1), big=big, types=kinds)


def main(family, out):
    mod = importlib.import_module(f"sparsefuse.bench.{family}")
    rows = []
    for case in mod.cases():
        before = cyclic()
        fn = case.make()
        fn()  # the first call: compilation and autotuning
        torch.cuda.synchronize()
        first = cyclic()
        fn()
        torch.cuda.synchronize()
        second = cyclic()
        del fn
        res = harness.measure(case, warmup_ms=10, rep_ms=30)
        row = dict(op=case.op, provider=case.provider, dtype=case.dtype, before_case=before,
                   after_first_call=first, after_second_call=second,
                   peak_extra_mib=round(res.peak_extra_mib, 1), ms=round(res.ms, 3))
        print(json.dumps(row), flush=True)
        rows.append(row)
    with open(out, "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
