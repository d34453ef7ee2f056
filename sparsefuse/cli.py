"""Command line: ``sparsefuse bench [family ...]`` and ``sparsefuse train-sae [options]``."""

from __future__ import annotations

import argparse
import sys

import torch


def _bench(args) -> int:
    from .bench import FAMILIES, family, harness

    names = args.families or list(FAMILIES)
    unknown = [n for n in names if n not in FAMILIES]
    if unknown:
        print(f"unknown benchmark family {unknown}; choose from {', '.join(FAMILIES)}", file=sys.stderr)
        return 2
    if args.render:
        for name in names:
            print(family(name).render(args.out, args.readme) or f"no results for {name} in {args.out}")
        return 0
    if not torch.cuda.is_available():
        print("No CUDA GPU found: sparsefuse benchmarks time GPU kernels, so nothing is timed here.\n"
              "Running a small correctness check of the ops on the CPU instead:")
        ok = all([family(name).check() for name in names])
        print("all checks passed" if ok else "SOME CHECKS FAILED")
        return 0 if ok else 1
    for name in names:
        mod = family(name)
        print(f"== {name} on {harness.gpu_name()}")
        results = harness.run_cases(mod.cases(quick=args.quick))
        path = harness.save(results, name, args.out)
        print(f"results: {path}")
        text = mod.render(args.out, args.readme)
        if text:
            print(text)
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="sparsefuse", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    bench = sub.add_parser("bench", help="time the fused ops against PyTorch eager and torch.compile")
    bench.add_argument("families", nargs="*", help="which families (default: all)")
    bench.add_argument("--quick", action="store_true", help="small shapes, for a smoke run")
    bench.add_argument("--out", default="benchmarks/results", help="results folder (JSON, Markdown, PNG)")
    bench.add_argument("--readme", default="README.md", help="README whose bench tables are rewritten")
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
