"""The one benchmark harness: timing, peak memory, result files, README tables and plots.

A family module (``sparsefuse/bench/sae.py`` and friends) builds ``Case`` objects (one op, one
provider, one shape, one dtype) and hands them to :func:`run_cases`. Each case is timed with
``triton.testing.do_bench`` (median and 20/80 % quantiles, after warm-up) on random data, and its
peak extra memory is read from the CUDA caching allocator. Each case also gets a device time
(:func:`device_time`): the same step with the host far ahead of the GPU, so it reads the GPU's
time alone where do_bench, at small shapes, reads how fast the host enqueues. Results are merged into
``<out>/<family>.json`` keyed by (op, provider, shape, dtype, mode, GPU, version); each family's
``render`` builds its tables from the JSON (:func:`speedup_table`) and :func:`publish` writes them
into the README and ``<out>/<family>.md`` beside a PNG plot. Without a GPU, each family's ``check``
compares its ops with the float64 reference instead (:func:`rel_err`).
"""

from __future__ import annotations

import gc
import json
import os
import platform
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Optional

import torch

from .. import __version__

RESULTS_DIR = os.path.join("benchmarks", "results")
QUICK_DIR = os.path.join(RESULTS_DIR, "quick")  # --quick runs: smoke tests, never the README's tables


@dataclass
class Case:
    """One measurement. ``make`` builds fresh inputs and returns a zero-argument callable to time."""

    op: str
    provider: str
    shape: dict
    dtype: str
    mode: str  # "fwd" or "full" (forward + backward)
    make: Callable[[], Callable[[], object]]
    bytes_moved: Optional[int] = None  # minimal HBM traffic, for the GB/s column
    flops: Optional[int] = None
    #: timed this many times, in round-robin with the other multi-round cases; the result is the
    #: round with the median time. For host-bound microsecond cases, whose one-off medians on a
    #: shared host moved 3x between runs; every provider of a comparison gets the same rounds.
    rounds: int = 1


@dataclass
class Result:
    op: str
    provider: str
    shape: dict
    dtype: str
    mode: str
    ms: float
    ms_q20: float
    ms_q80: float
    peak_extra_mib: float
    gbps: Optional[float] = None
    tflops: Optional[float] = None
    #: median GPU time of one call with the host far ahead (:func:`device_time`); None where the
    #: host could not get ahead, or for results saved before it was measured
    device_ms: Optional[float] = None
    gpu: str = ""
    version: str = __version__
    torch: str = torch.__version__
    extra: dict = field(default_factory=dict)
    #: the process that measured it (:data:`RUN`); "" for results saved before runs were recorded
    run: str = ""

    def key(self):
        return (self.op, self.provider, json.dumps(self.shape, sort_keys=True), self.dtype, self.mode, self.gpu,
                self.version)

    def row(self):
        """What one table row compares: every provider of one op, dtype, shape and mode."""
        return self.op, self.dtype, json.dumps(self.shape, sort_keys=True), self.mode


#: One benchmark process is one run: :func:`save` keeps each table row's providers from one run.
RUN = f"{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}"


def gpu_name() -> str:
    return torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor() or "cpu"


def measure(case: Case, *, warmup_ms: int = 50, rep_ms: int = 300) -> Result:
    """Time one case (median of do_bench, and its device time: :func:`device_time`) and record its peak
    extra memory."""
    from triton.testing import do_bench

    gc.collect()  # an earlier case's tensors held in reference cycles: freed now, not mid-measurement
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    fn = case.make()
    fn()  # compile / autotune / warm caches outside the measurement
    gc.collect()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    # With the collector running, a cycle holding gigabytes freed during this call would hand its
    # memory to the call's own allocations, and the peak would read that much too low.
    gc.disable()
    try:
        out = fn()
        torch.cuda.synchronize()
    finally:
        gc.enable()
    peak = torch.cuda.max_memory_allocated() - base
    # The call allocated its own results, so a peak below their size is a misreading (session 13
    # read 2.1 MiB for a call returning a 2 GiB gradient, once, on another machine): flag it.
    floor = _result_bytes(out)
    del out
    q20, med, q80 = do_bench(fn, warmup=warmup_ms, rep=rep_ms, quantiles=[0.2, 0.5, 0.8])
    dev = device_time(fn, med)
    del fn
    res = Result(
        op=case.op, provider=case.provider, shape=case.shape, dtype=case.dtype, mode=case.mode,
        ms=med, ms_q20=q20, ms_q80=q80, peak_extra_mib=peak / 2**20,
        gbps=None if case.bytes_moved is None else case.bytes_moved / med / 1e6,
        tflops=None if case.flops is None else case.flops / med / 1e9,
        device_ms=dev, gpu=gpu_name(), run=RUN,
    )
    if peak < floor:
        res.extra["peak_below_results_mib"] = floor / 2**20
    return res


def device_time(fn, wall_ms: float) -> Optional[float]:
    """Median GPU time of one call of ``fn`` while the host is far ahead, in ms.

    do_bench enqueues one call and then waits on the GPU; when enqueuing a call takes the host longer
    than the GPU takes to run it (a small eager step: hundreds of microseconds of Python, autograd
    and launches), its median is the host's time. Here a GPU sleep holds the device while the host
    enqueues the calls, each as do_bench runs it (L2 flushed, then events around the call), so each
    call starts as soon as the previous one ends and its events bracket GPU work only. The sleep
    is sized from ``wall_ms`` (do_bench's median, which is at least the host's time per call) and
    checked. If the host had not finished enqueuing when the GPU woke, either the sleep fell short of
    what was asked (a GPU still at idle clocks when the cycles-per-ms rate was first read sleeps
    several times shorter once it clocks up), and the try is repeated with the rate that sleep
    showed; or the host was blocked, most likely by a full launch queue (about a thousand pending
    launches: a training step of a hundred kernels fills it in ten calls), and the try is repeated
    with half as many calls, down to three. After five tries the result is None.
    """
    import triton

    drv = triton.runtime.driver.active
    cache = drv.get_empty_cache_for_benchmark()
    ev = lambda: torch.cuda.Event(enable_timing=True)  # noqa: E731
    n = max(5, min(20, int(100 / max(wall_ms, 1e-3))))
    t0, t1 = ev(), ev()
    torch.cuda.synchronize()
    cycles = 10**7
    t0.record()
    torch.cuda._sleep(cycles)
    t1.record()
    torch.cuda.synchronize()
    cycles_per_ms = cycles / max(t0.elapsed_time(t1), 1e-3)
    for _ in range(5):
        starts, ends = [ev() for _ in range(n)], [ev() for _ in range(n)]
        want_ms = 2 * n * wall_ms + 5
        cycles = int(want_ms * cycles_per_ms)
        t0.record()
        torch.cuda._sleep(cycles)
        t1.record()
        h0 = time.perf_counter()
        for s, e in zip(starts, ends):
            drv.clear_cache(cache)
            s.record()
            fn()
            e.record()
        host_ms = (time.perf_counter() - h0) * 1e3
        torch.cuda.synchronize()
        slept_ms = t0.elapsed_time(t1)
        if host_ms < slept_ms:  # the host was done before the GPU woke
            times = sorted(s.elapsed_time(e) for s, e in zip(starts, ends))
            return times[(n - 1) // 2]
        if slept_ms < 0.8 * want_ms:  # the clock rate had changed: the sleep was too short
            cycles_per_ms = cycles / max(slept_ms, 1e-3)
        else:
            n = max(3, n // 2)
    return None


def _result_bytes(out) -> int:
    """Bytes of the distinct tensor storages in a case's result (nested tuples and lists)."""
    seen, stack = {}, [out]
    while stack:
        o = stack.pop()
        if isinstance(o, (tuple, list)):
            stack.extend(o)
        elif isinstance(o, torch.Tensor):
            st = o.untyped_storage()
            seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values())


def host_us(fn, n: int = 200, warmup: int = 20) -> float:
    """Host time to enqueue one call of ``fn`` in microseconds: no synchronisation inside the timed
    loop, so where the GPU keeps up (tiny shapes) this is the Python, dispatch and launch cost."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) / n * 1e6


def idle_host_ms(fn, n: int = 200) -> float:
    """Host time of one call of ``fn`` enqueued on an idle GPU, in ms (median of ``n``, each after a
    synchronisation): what a call costs the host when nothing is queued ahead of it."""
    times = []
    for _ in range(n):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    torch.cuda.synchronize()
    return statistics.median(times)


def host_profile(fn, n: int = 200, top: int = 20, stream=None) -> None:
    """cProfile of ``n`` calls of ``fn`` (no synchronisation inside), the ``top`` entries by own time
    printed to ``stream`` (stdout): where a call's host time goes, Python function by function."""
    import cProfile
    import pstats

    pr = cProfile.Profile()
    pr.enable()
    for _ in range(n):
        fn()
    pr.disable()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    pstats.Stats(pr, stream=stream).sort_stats("tottime").print_stats(top)


def _warm_gpu(case, seconds: float = 0.5) -> None:
    """Run ``case`` untimed for a while first: the first case of a process otherwise pays for clocks
    ramping up from idle and lazy initialisation (seen as a 0.7 vs 1.1-1.3 ms spread on the first
    SAE case across runs)."""
    fn = case.make()
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        fn()
        torch.cuda.synchronize()
    del fn
    torch.cuda.empty_cache()


def run_cases(cases, *, log=print, on_round=None) -> list:
    """Measure every case (in order, after warming the GPU on the first); cases with ``rounds > 1``
    are measured again in later rounds, and keep the round with their median time.

    ``on_round(results)``, if given, gets the results so far after each round (the median of the
    rounds measured), so that a caller can save them and a run killed part-way keeps what it had."""
    rounds = [[] for _ in cases]
    if cases:
        _warm_gpu(cases[0])
    for r in range(max((c.rounds for c in cases), default=0)):
        for case, got in zip(cases, rounds):
            if r >= case.rounds:
                continue
            try:
                res = measure(case)
            except torch.cuda.OutOfMemoryError as e:  # the eager reference can exceed the card at large K
                log(f"  {case.op:<14} {case.provider:<14} {case.dtype:<9} {case.shape}  out of memory ({e.__class__.__name__})")
                torch.cuda.empty_cache()
                continue
            got.append(res)
            tag = f"  (round {r + 1}/{case.rounds})" if case.rounds > 1 else ""
            log(f"  {res.op:<14} {res.provider:<14} {res.dtype:<9} {_shape_str(res.shape):<28} {res.mode:<5} "
                f"{res.ms:8.3f} ms  {res.peak_extra_mib:9.1f} MiB" + (f"  {res.gbps:7.0f} GB/s" if res.gbps else "")
                + (f"  device {res.device_ms:.3f} ms" if res.device_ms else "  device -")
                + tag + ("  (peak below the results' size: misread)" if "peak_below_results_mib" in res.extra else ""))
        if on_round is not None:
            on_round(_medians(rounds))
    return _medians(rounds)


def _medians(rounds: list) -> list:
    """Each case's result from the round with its median time (the lower median of an even count),
    with every round's time under ``extra["rounds_ms"]``."""
    results = []
    for got in rounds:
        if got:
            ordered = sorted(got, key=lambda res: res.ms)
            pick = ordered[(len(ordered) - 1) // 2]
            if len(ordered) > 1:
                pick.extra["rounds_ms"] = [round(res.ms, 5) for res in ordered]
            results.append(pick)
    return results


def _shape_str(shape: dict) -> str:
    return " ".join(f"{k}={v}" for k, v in shape.items())


def save(results: list, family: str, out_dir: str = RESULTS_DIR) -> str:
    """Merge results into ``<out_dir>/<family>.json``.

    A table row (:meth:`Result.row`) measured again replaces every result of that row saved by another
    run, so that each row compares providers measured side by side: a baseline that failed this time
    (out of memory, not installed) reads as missing, not as an earlier run's number on another GPU,
    torch or code version. Results of one run (a process saving case by case) merge by key. The file
    is replaced atomically, so a run killed while saving leaves the previous file whole."""
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"{family}.json")
    new_runs = {}
    for r in results:
        new_runs.setdefault(r.row(), set()).add(r.run)
    merged = {}
    for r in load(family, out_dir):
        if r.row() not in new_runs or new_runs[r.row()] == {r.run}:
            merged[r.key()] = r
    for r in results:
        merged[r.key()] = r
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump([asdict(r) for r in merged.values()], f, indent=1)
    os.replace(tmp, path)
    return path


def load(family: str, out_dir: str = RESULTS_DIR) -> list:
    path = os.path.join(out_dir, f"{family}.json")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [Result(**d) for d in json.load(f)]


def _shape_order(shape_json: str) -> tuple:
    """Sort key of a shape: numbers numerically (K=32 before K=128), anything else as text after them."""
    return tuple((0, v, "") if isinstance(v, (int, float)) else (1, 0, str(v)) for v in json.loads(shape_json).values())


def _speedup(x: float) -> str:
    """A speed-up cell: bold where we are faster, plain where the baseline is (a floor, say)."""
    return f"**{x:.2f}×**" if x >= 1 else f"{x:.2f}×"


def speedup_table(results: list, *, ours: str = "sparsefuse", baselines=("torch", "torch.compile"),
                  mode: str = "full", shape_keys: Optional[list] = None, device_baselines=()) -> str:
    """Markdown: one row per (op, dtype, shape); ms for each provider and our speed-up over each baseline.
    ``device_baselines`` adds our device time (:func:`device_time`) and the speed-up in device time
    over each of those baselines. "" when no row has a result of ``ours`` in ``mode``; the footer
    names the GPUs of the rows shown."""
    rows = {}
    for r in results:
        if r.mode != mode:
            continue
        key = (r.op, r.dtype, json.dumps(r.shape, sort_keys=True))
        rows.setdefault(key, {})[r.provider] = r
    keys = shape_keys
    head = ["op", "dtype", "shape", f"{ours} ms"] + [f"{b} ms" for b in baselines]
    head += [f"vs {b}" for b in baselines]
    if device_baselines:
        head += [f"{ours} device ms"] + [f"vs {b}, device" for b in device_baselines]
    head += [f"{ours} peak MiB", f"{ours} GB/s"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    shown = []
    for (op, dtype, shape_json), by in sorted(rows.items(), key=lambda kv: (kv[0][0], kv[0][1], _shape_order(kv[0][2]))):
        shape = json.loads(shape_json)
        us = by.get(ours)
        if us is None:
            continue
        shown += [us] + [by[b] for b in baselines if b in by]
        shape_txt = " ".join(f"{k}={shape[k]}" for k in (keys or shape))
        cells = [op, dtype, shape_txt, f"{us.ms:.3f}"]
        cells += [f"{by[b].ms:.3f}" if b in by else "—" for b in baselines]
        cells += [_speedup(by[b].ms / us.ms) if b in by else "—" for b in baselines]
        if device_baselines:
            cells.append(f"{us.device_ms:.3f}" if us.device_ms else "—")
            cells += [f"{by[b].device_ms / us.device_ms:.2f}×" if b in by and by[b].device_ms and us.device_ms
                      else "—" for b in device_baselines]
        misread = " (misread)" if "peak_below_results_mib" in us.extra else ""
        cells += [f"{us.peak_extra_mib:.0f}{misread}", f"{us.gbps:.0f}" if us.gbps else "—"]
        lines.append("| " + " | ".join(cells) + " |")
    if not shown:
        return ""
    gpus = sorted({r.gpu for r in shown})
    lines.append("")
    what = ("(forward + backward unless stated); peak MiB is the extra memory the call allocates, gradients included"
            if mode == "full" else "(no backward); peak MiB is the extra memory the call allocates")
    lines.append(f"Measured on {', '.join(gpus)}; median of `triton.testing.do_bench`; mode `{mode}` {what}.")
    if device_baselines:
        lines.append("Device ms: the median GPU time of a step with the host far ahead (`harness.device_time`); "
                     "where it is below the do_bench time, the step waited on the host.")
    return "\n".join(lines)


def rel_err(got, want) -> float:
    """The largest ``norm(a - b) / norm(b)`` over pairs of tensors, in float64: the families' CPU checks.
    NaN when any pair's is NaN (Python's ``max`` kept a NaN only in first place, so a NaN gradient
    after the loss read as a pass); the two lists must have the same length."""
    errs = [(a.detach().double() - b.detach().double()).norm() / b.detach().double().norm().clamp_min(1e-30)
            for a, b in zip(got, want, strict=True)]
    return float(torch.stack(errs).max())


def publish(family: str, text: str, results: list, *, out_dir: str, readme: str, title: str, x_key: str,
            mode: str = "full") -> str:
    """Put a family's rendered ``text`` into its README section and ``<out_dir>/<family>.md``, and plot
    ``results`` into ``<out_dir>/<family>.png``."""
    update_readme(family, text, readme)
    with open(os.path.join(out_dir, f"{family}.md"), "w") as f:
        f.write(text + "\n")
    plot(results, os.path.join(out_dir, f"{family}.png"), title=title, x_key=x_key, mode=mode)
    return text


def update_readme(section: str, text: str, readme: str = "README.md") -> bool:
    """Replace the text between ``<!-- bench:<section> -->`` and ``<!-- /bench:<section> -->``."""
    if not os.path.exists(readme):
        return False
    with open(readme) as f:
        content = f.read()
    start, end = f"<!-- bench:{section} -->", f"<!-- /bench:{section} -->"
    if start not in content or end not in content:
        return False
    head, rest = content.split(start, 1)
    _, tail = rest.split(end, 1)
    with open(readme, "w") as f:
        f.write(f"{head}{start}\n{text}\n{end}{tail}")
    return True


def _bars(sub: list, x_key: str) -> tuple:
    """(x labels, {provider: ms per label}, whether the labels are ``x_key`` alone) for one panel.
    A label is ``x_key``'s value while each value names one shape, else the whole shape: a --quick
    run saved beside the full one must not share the full one's bars."""
    shapes = sorted({json.dumps(r.shape, sort_keys=True): r.shape for r in sub}.values(),
                    key=lambda sh: (sh[x_key], _shape_order(json.dumps(sh))))
    alone = len({sh[x_key] for sh in shapes}) == len(shapes)

    def label(shape):
        return str(shape[x_key]) if alone else _shape_str(shape)

    xs = [label(sh) for sh in shapes]
    providers = sorted({r.provider for r in sub}, key=lambda p: (p != "sparsefuse", p))
    bars = {p: [next((r.ms for r in sub if r.provider == p and label(r.shape) == x), float("nan")) for x in xs]
            for p in providers}
    return xs, bars, alone


def plot(results: list, path: str, *, title: str, x_key: str, mode: str = "full") -> Optional[str]:
    """Bar chart of ms per provider against ``x_key``, one panel per (op, dtype)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    panels = sorted({(r.op, r.dtype) for r in results if r.mode == mode})
    if not panels:
        return None
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.6), squeeze=False)
    for ax, (op, dtype) in zip(axes[0], panels):
        xs, bars, alone = _bars([r for r in results if r.op == op and r.dtype == dtype and r.mode == mode], x_key)
        width = 0.8 / max(len(bars), 1)
        for i, (p, ms) in enumerate(bars.items()):
            ax.bar([j + i * width for j in range(len(xs))], ms, width, label=p)
        ax.set_xticks([j + width * (len(bars) - 1) / 2 for j in range(len(xs))], xs, fontsize=None if alone else 6)
        ax.set_xlabel(x_key if alone else "shape")
        ax.set_ylabel("ms (lower is better)")
        ax.set_title(f"{op} {dtype}")
        ax.legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
