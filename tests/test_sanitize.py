"""compute-sanitizer over every Triton kernel of every family (GPU tier), and the CPU-tier check
that the sanitizer cases know every kernel the package defines.

The cases are in ``tests/sanitize_cases.py``: odd shapes, every op forward and backward, and
out-of-range indices with the host check off. Gated tools: memcheck (out-of-bounds and misaligned
accesses) and initcheck (reads of device memory nothing wrote). racecheck is not gated: Triton's
reductions let several lanes of one warp store their copy of a reduced value to one shared-memory
word, and with fused multiply-adds those copies can differ in the last bit (triton-lang/triton
#7264), so it reports write-after-write hazards in ``_sae_decode_fwd_kernel`` and
``_nearest_code_fwd_kernel``. The lanes are in one warp and one instruction, and 200 repeats of
either op gave bit-identical outputs on an H100 (``benchmarks/NOTES.md``, session 25).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import sanitize_cases

ROOT = Path(__file__).resolve().parent.parent
FAMILIES = ("sae", "kd", "vq")


def test_sanitizer_cases_know_every_kernel():
    """Every ``*_kernel`` the package defines belongs to a family whose cases must launch it."""
    import importlib
    import pkgutil

    import sparsefuse

    defined = set()
    for info in pkgutil.walk_packages(sparsefuse.__path__, "sparsefuse."):
        if info.name.endswith("__main__"):  # the CLI entry point runs on import
            continue
        defined |= sanitize_cases.kernels_of(importlib.import_module(info.name))
    known = set().union(*(sanitize_cases.family_kernels(f) for f in FAMILIES))
    assert defined and defined == known, f"kernels no sanitizer family covers: {sorted(defined - known)}"


@pytest.mark.gpu
@pytest.mark.parametrize("tool", ["memcheck", "initcheck"])
def test_gpu_compute_sanitizer_clean(tool):
    """Each family's cases under the tool, the three families at once: zero errors, every kernel
    launched (sanitize_cases checks that on CUDA), and the NaN poisoning of bad indices asserted."""
    exe = shutil.which("compute-sanitizer")
    assert exe, "compute-sanitizer is part of the GPU tier's toolchain"
    runs = {}
    for fam in FAMILIES:
        dtypes = "float32" if tool == "initcheck" and fam == "kd" else "all"  # see sanitize_cases' docstring
        cmd = [exe, "--tool", tool, "--error-exitcode", "3", sys.executable, str(ROOT / "tests" / "sanitize_cases.py"),
               fam, "cuda", dtypes]
        runs[fam] = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT)
    failed = []
    for fam, proc in runs.items():
        out, _ = proc.communicate(timeout=1200)
        lines = out.splitlines()
        if proc.returncode != 0 or "ok" not in lines or "========= ERROR SUMMARY: 0 errors" not in lines:
            failed.append(f"{fam} (rc {proc.returncode}):\n{out[-3000:]}")
    assert not failed, "\n\n".join(failed)
