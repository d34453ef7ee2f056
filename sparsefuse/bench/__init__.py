"""Benchmarks: ``sparsefuse bench <family>``. One harness (``harness.py``), one module per family."""

import importlib

FAMILIES = ("sae", "vq", "kd", "sae_train")


def family(name: str):
    """The benchmark module of one family (``cases``, ``render``, ``check``)."""
    return importlib.import_module(f"{__name__}.{name}")
