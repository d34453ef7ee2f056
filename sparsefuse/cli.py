"""Command line: ``sparsefuse bench [family ...]`` and ``sparsefuse train-sae [options]``."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

import numpy as np
import torch

from ._registry import INTERPRET


def _interpreter_runs() -> bool:
    """Whether Triton's interpreter can run the kernels here: Triton 3.6's breaks on NumPy >= 2.4
    (it turns one-element arrays into Python integers, which NumPy 2.4 refuses)."""
    return tuple(int(p) for p in np.__version__.split(".")[:2]) < (2, 4)


def _bench(args) -> int:
    from .bench import FAMILIES, family, harness

    names = args.families or list(FAMILIES)
    unknown = [n for n in names if n not in FAMILIES]
    if unknown:
        print(f"unknown benchmark family {unknown}; choose from {', '.join(FAMILIES)}", file=sys.stderr)
        return 2
    # a --quick (smoke) run has its own folder and leaves the README's tables to the full run
    out = args.out or (harness.QUICK_DIR if args.quick else harness.RESULTS_DIR)
    readme = ("" if args.quick else "README.md") if args.readme is None else args.readme
    if args.render:
        for name in names:
            print(family(name).render(out, readme) or f"no results for {name} in {out}")
        return 0
    if not torch.cuda.is_available():
        interpreter_runs = _interpreter_runs()
        if INTERPRET != interpreter_runs:
            # CPU tensors take the PyTorch reference unless the Triton interpreter was on at import:
            # the check runs in a process that has it where it works (so that it exercises the
            # kernels), and in one without it where it does not
            env = dict(os.environ, TRITON_INTERPRET="1" if interpreter_runs else "0")
            return subprocess.run([sys.executable, "-m", "sparsefuse", "bench", *names], env=env).returncode
        print("No CUDA GPU found: sparsefuse benchmarks time GPU kernels, so nothing is timed here.")
        if INTERPRET:
            print("Running a small correctness check of the ops' Triton kernels on the CPU (Triton's interpreter, "
                  "TRITON_INTERPRET=1) against the float64 reference instead:")
        else:
            print(f"Triton's interpreter does not run with NumPy {np.__version__} (it needs NumPy < 2.4; "
                  f"`pip install 'numpy<2.4'` to check the kernels), so only the ops' CPU path, the PyTorch "
                  f"reference, is checked against float64:")
        ok = all([family(name).check() for name in names])
        print("all checks passed" if ok else "SOME CHECKS FAILED")
        return 0 if ok else 1
    for name in names:
        mod = family(name)
        print(f"== {name} on {harness.gpu_name()}")
        # saved after every round, so that a run stopped part-way keeps the rounds it measured
        harness.run_cases(mod.cases(quick=args.quick), on_round=lambda res, name=name: harness.save(res, name, out))
        print(f"results: {os.path.join(out, name + '.json')}")
        text = mod.render(out, readme)
        if text:
            print(text)
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="sparsefuse", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    bench = sub.add_parser("bench", help="time the fused ops against PyTorch eager and torch.compile")
    bench.add_argument("families", nargs="*", help="which families (default: all)")
    bench.add_argument("--quick", action="store_true",
                       help="small shapes, for a smoke run (saved under benchmarks/results/quick; README untouched)")
    bench.add_argument("--out", default=None, help="results folder (JSON, Markdown, PNG); default benchmarks/results")
    bench.add_argument("--readme", default=None,
                       help="README whose bench tables are rewritten (default README.md; '' for none)")
    bench.add_argument("--render", action="store_true", help="only rebuild tables and plots from saved results")
    bench.set_defaults(func=_bench)
    train = sub.add_parser("train-sae", help="train a TopK / Hierarchical SAE (default: small synthetic run)")
    from .sae.train import add_arguments, run_cli

    add_arguments(train)
    train.set_defaults(func=run_cli)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    raise SystemExit(main())
