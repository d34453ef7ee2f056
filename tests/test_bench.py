"""The benchmark harness: round-robin rounds (``Case.rounds``, timing stubbed out) and the host profile."""

import math
import time
import types

import pytest
import torch

from sparsefuse.bench import harness


def test_rounds_are_round_robin_and_keep_the_median(monkeypatch):
    times = {"a": iter([5.0, 1.0, 3.0]), "b": iter([2.0]), "c": iter([9.0, 7.0, 8.0])}
    order = []

    def fake_measure(case):
        order.append(case.provider)
        return harness.Result(op=case.op, provider=case.provider, shape=case.shape, dtype=case.dtype,
                              mode=case.mode, ms=next(times[case.provider]), ms_q20=0.0, ms_q80=0.0,
                              peak_extra_mib=0.0)

    monkeypatch.setattr(harness, "measure", fake_measure)
    monkeypatch.setattr(harness, "_warm_gpu", lambda case: None)
    cases = [harness.Case(op="op", provider=p, shape={}, dtype="fp32", mode="fwd", make=lambda: None, rounds=r)
             for p, r in (("a", 3), ("b", 1), ("c", 3))]
    got = harness.run_cases(cases, log=lambda *a: None)
    assert order == ["a", "b", "c", "a", "c", "a", "c"]
    assert [(r.provider, r.ms) for r in got] == [("a", 3.0), ("b", 2.0), ("c", 8.0)]
    assert got[0].extra["rounds_ms"] == [1.0, 3.0, 5.0] and "rounds_ms" not in got[1].extra
    assert harness.run_cases([], log=None) == []


def test_a_run_stopped_in_a_later_round_keeps_the_rounds_it_measured(monkeypatch, tmp_path):
    """The CLI saves after every round (``on_round``): a run killed in round 2 leaves round 1 saved,
    and a finished run leaves each case's median round."""
    times = {"a": [4.0, 2.0, 3.0], "b": [6.0, 5.0, 7.0]}
    stop_at = [None]

    def fake_measure(case):
        got = times[case.provider]
        if stop_at[0] == (case.provider, len(got)):
            raise KeyboardInterrupt
        return harness.Result(op=case.op, provider=case.provider, shape={"K": 1}, dtype=case.dtype,
                              mode=case.mode, ms=got.pop(0), ms_q20=0.0, ms_q80=0.0, peak_extra_mib=0.0)

    monkeypatch.setattr(harness, "measure", fake_measure)
    monkeypatch.setattr(harness, "_warm_gpu", lambda case: None)

    def cases():
        return [harness.Case(op="op", provider=p, shape={"K": 1}, dtype="fp32", mode="full", make=lambda: None,
                             rounds=3) for p in ("a", "b")]

    def save(res):
        harness.save(res, "fam", str(tmp_path))

    stop_at[0] = ("b", 2)  # killed in round 2, after case a's second round
    with pytest.raises(KeyboardInterrupt):
        harness.run_cases(cases(), log=lambda *a: None, on_round=save)
    assert {r.provider: r.ms for r in harness.load("fam", str(tmp_path))} == {"a": 4.0, "b": 6.0}
    times.update(a=[4.0, 2.0, 3.0], b=[6.0, 5.0, 7.0])
    stop_at[0] = None
    harness.run_cases(cases(), log=lambda *a: None, on_round=save)
    saved = {r.provider: r for r in harness.load("fam", str(tmp_path))}
    assert {p: r.ms for p, r in saved.items()} == {"a": 3.0, "b": 6.0}
    assert saved["a"].extra["rounds_ms"] == [2.0, 3.0, 4.0]


def test_host_profile_reports_the_profiled_function():
    import io

    calls = []

    def step_under_profile():
        calls.append(1)

    out = io.StringIO()
    harness.host_profile(step_under_profile, n=7, top=5, stream=out)
    assert len(calls) == 7
    assert "step_under_profile" in out.getvalue() and "7 " in out.getvalue()


def _result(provider, ms, mode):
    return harness.Result(op="op", provider=provider, shape={"K": 8}, dtype="fp32", mode=mode, ms=ms, ms_q20=ms,
                          ms_q80=ms, peak_extra_mib=1.0, gpu="GPU")


def test_speedup_table_footer_describes_the_mode_it_shows():
    """A forward-only table must not say its times are forward + backward (the VQ EMA and search
    tables in README.md did: "mode `fwd` (forward + backward unless stated)")."""
    fwd = harness.speedup_table([_result("sparsefuse", 1.0, "fwd"), _result("torch", 2.0, "fwd")], mode="fwd")
    assert "**2.00×**" in fwd
    assert "forward + backward" not in fwd and "gradients included" not in fwd
    full = harness.speedup_table([_result("sparsefuse", 1.0, "full"), _result("torch", 3.0, "full")], mode="full")
    assert "**3.00×**" in full and "forward + backward" in full


def test_a_peak_below_the_results_size_is_flagged_in_the_table():
    """A call allocates its own results, so a peak reading below their size is a misreading (2.1 MiB
    for a call returning a 2 GiB gradient, in session 13): the table must not print it as a fact."""
    a, b = torch.zeros(64), torch.zeros(2, 8, dtype=torch.float64)
    assert harness._result_bytes((a, [b, a.view(8, 8)], None, 3)) == 64 * 4 + 16 * 8  # shared storage once
    ours = _result("sparsefuse", 1.0, "full")
    table = harness.speedup_table([ours, _result("torch", 2.0, "full")])
    assert "(misread)" not in table
    ours.extra["peak_below_results_mib"] = 2048.0
    assert "| 1 (misread) |" in harness.speedup_table([ours, _result("torch", 2.0, "full")])


# --- the family modules: what each case measures (no GPU needed) ------------------------------


def _keys(cases):
    import json

    return [(c.op, c.provider, json.dumps(c.shape, sort_keys=True), c.dtype, c.mode) for c in cases]


def test_no_two_cases_share_a_result_key(capsys):
    """Results are merged into the JSON by (op, provider, shape, dtype, mode, GPU, version): two
    cases of one run with the same key would overwrite each other."""
    from sparsefuse.bench import FAMILIES, family

    for name in FAMILIES:
        for quick in (False, True):
            keys = _keys(family(name).cases(quick=quick))
            assert keys and len(set(keys)) == len(keys), (name, quick)


def test_kd_make_targets_distinct_ids():
    """distinct=True (what "tail" timings need: it poisons a token whose unmasked ids repeat) draws K
    distinct ids per token in [0, V) above V = 4096 too, where the default draws repeat."""
    from sparsefuse.bench import kd

    N, K, V = 256, 64, 50000
    for distinct in (False, True):
        ids, _, m = kd.make_targets(N, K, V, "cpu", distinct=distinct)
        keys = torch.where(m, ids, -1 - torch.arange(K)).sort(1).values
        repeats = int((keys[:, 1:] == keys[:, :-1]).any(1).sum())
        assert (repeats == 0) == distinct, (distinct, repeats)
        assert 0 <= int(ids.min()) and int(ids.max()) < V


def test_kd_hidden_topk_baselines_use_only_the_k_gathered_logits():
    """normalize="topk" needs the K logits of each token only: the eager baseline must not compute
    the [N, V] logits (it did, h @ w.t(), and the published speed-up was against that), and it
    must give the loss and gradients of the reference."""
    import torch

    from sparsefuse.bench import kd
    from sparsefuse.kd import reference

    cases = {(c.op, c.provider) for c in kd.cases(quick=True)}
    assert {("hidden-topk", "torch"), ("hidden-topk", "torch.compile")} <= cases
    torch.manual_seed(0)
    N, H, V, K = 13, 8, 40, 5
    ids, t, m = kd.make_targets(N, K, V, "cpu")
    h = torch.randn(N, H, dtype=torch.float64, requires_grad=True)
    w = torch.randn(V, H, dtype=torch.float64, requires_grad=True)
    matmuls = []
    real_matmul = torch.Tensor.__matmul__

    def counting_matmul(a, b):
        matmuls.append(tuple(real_matmul(a, b).shape))
        return real_matmul(a, b)

    torch.Tensor.__matmul__ = counting_matmul
    try:
        got = kd._ref_hidden_topk(h, w, ids, t, m, "topk")
    finally:
        torch.Tensor.__matmul__ = real_matmul
    assert matmuls and all(V not in s for s in matmuls), matmuls
    want = reference.topk_kd_loss_from_logits(h @ w.t(), ids, t, m, normalize="topk")[0]
    torch.testing.assert_close(got, want)
    for a, b in zip(torch.autograd.grad(got, [h, w]), torch.autograd.grad(want, [h, w])):
        torch.testing.assert_close(a, b)


def test_gbps_counts_the_traffic_the_docstrings_state():
    """GB/s is bytes_moved / time: the bytes must be the minimal traffic each module's docstring
    names (KD counted the logits twice and the hidden-topk rows three times; VQ three [K, D]
    tensors for the two of the state)."""
    from sparsefuse.bench import kd, sae, vq

    N, H, V, K = 1024, 512, 8192, 64  # kd quick
    teacher = N * K * (4 + 1)
    got = {c.op: c.bytes_moved for c in kd.cases(quick=True) if c.provider == "sparsefuse" and c.bytes_moved}
    assert got == {"gathered": N * K * 2 * 2 + teacher,
                   "logits-full": 2 * N * V * 2 + teacher + N * K * 8,
                   "hidden-topk": (N * K * H + V * H + 2 * N * H) * 2 + teacher + N * K * 8}
    for c in vq.cases(quick=True):
        if c.op.startswith("ema"):
            B, K, D = (c.shape[k] for k in "BKD")
            assert c.bytes_moved == B * D * 4 + B * 8 + 2 * (2 * K * D * 4)  # x, codes; codebook and sums in, out
    for c in sae.cases(quick=True):
        B, K, F, D = (c.shape[k] for k in "BKFD")
        assert c.bytes_moved == (B * K * D + B * D + F * D) * {"fp32": 4, "bf16": 2}[c.dtype]


def _res(op, provider, shape, ms, dtype="fp32", run="", gpu="GPU"):
    from sparsefuse.bench import harness

    return harness.Result(op=op, provider=provider, shape=shape, dtype=dtype, mode="full", ms=ms, ms_q20=ms,
                          ms_q80=ms, peak_extra_mib=1.0, gpu=gpu, run=run)


def test_sae_table_tells_a_quick_run_from_the_full_one(tmp_path):
    """Rows were labelled by K alone: a --quick run saved beside the full one gave two "K=32" rows,
    and the Hierarchical / TopK ratio could pair a quick time with a full one."""
    from sparsefuse.bench import harness, sae

    full, quick = dict(B=4096, K=32, F=65536, D=2304), dict(B=1024, K=32, F=8192, D=512)
    one = [_res("topk", "sparsefuse", full, 1.0), _res("hierarchical", "sparsefuse", full, 1.5),
           _res("topk", "torch", full, 4.0)]
    harness.save(one, "sae", str(tmp_path))
    text = sae.render(str(tmp_path), readme=str(tmp_path / "none.md"))
    assert "| topk | fp32 | K=32 |" in text and "fp32 K=32: 1.50×" in text
    harness.save([_res("topk", "sparsefuse", quick, 0.1), _res("hierarchical", "sparsefuse", quick, 0.3)], "sae",
                 str(tmp_path))
    text = sae.render(str(tmp_path), readme=str(tmp_path / "none.md"))
    assert "| topk | fp32 | B=4096 K=32 F=65536 D=2304 |" in text
    assert "| topk | fp32 | B=1024 K=32 F=8192 D=512 |" in text
    assert "fp32 K=32 B=4096 F=65536 D=2304: 1.50×" in text and "fp32 K=32 B=1024 F=8192 D=512: 3.00×" in text


def test_kd_targets_only_read_the_issue_shape():
    from sparsefuse.bench import kd

    quick = dict(N=1024, H=512, V=8192, K=64)
    assert kd._targets([_res("hidden-topk", "sparsefuse", quick, 0.1, "bf16")]) == ""
    full = dict(kd.ISSUE_SHAPE)
    lines = kd._targets([_res("hidden-topk", "sparsefuse", quick, 0.1, "bf16"),
                         _res("hidden-topk", "sparsefuse", full, 4.0, "bf16")])
    assert "**4.00 ms**" in lines and "0.10" not in lines


def test_sae_train_main_without_gpu_checks_instead_of_timing(monkeypatch, capsys):
    import torch

    from sparsefuse.bench import harness, sae_train

    from sparsefuse import cli

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(cli, "INTERPRET", True)  # as on a machine without a GPU (tests/conftest.py)
    monkeypatch.setattr(cli, "_interpreter_runs", lambda: True)
    monkeypatch.setattr(sae_train, "check", lambda log=print: True)
    monkeypatch.setattr(harness, "run_cases", lambda *a, **k: (_ for _ in ()).throw(AssertionError("timed")))
    assert sae_train.main(["--quick", "--out", "unused"]) == 0
    assert "No CUDA GPU found" in capsys.readouterr().out


def test_vq_step_baseline_uses_the_straight_through_gradient(monkeypatch):
    """vector-quantize-pytorch's VectorQuantize defaults to the rotation trick in recent versions:
    the baseline must be given ``rotation_trick=False`` where it takes it (ours is straight-through)."""
    import sys
    import types

    from sparsefuse.bench import vq

    for params, want in (("dim, codebook_size, rotation_trick=None", {"rotation_trick": False}),
                         ("dim, codebook_size", {})):
        fake = types.ModuleType("vector_quantize_pytorch")
        exec(f"class VectorQuantize:\n    def __init__(self, {params}): pass", fake.__dict__)
        monkeypatch.setitem(sys.modules, "vector_quantize_pytorch", fake)
        assert vq._vqtorch_straight_through() == want


def test_vq_step_baseline_gradient_matches_ours():
    """With the keyword, the installed vector-quantize-pytorch computes our step's gradient."""
    import pytest
    import torch

    vqp = pytest.importorskip("vector_quantize_pytorch")
    from sparsefuse import VectorQuantizer
    from sparsefuse.bench import vq

    B, K, D = 64, 16, 8
    torch.manual_seed(0)
    x = torch.randn(B, D, requires_grad=True)
    ours = VectorQuantizer(D, K, decay=0.99, threshold=vq.THRESHOLD, commitment_weight=0.25).train()
    theirs = vqp.VectorQuantize(dim=D, codebook_size=K, decay=0.99, commitment_weight=0.25,
                                threshold_ema_dead_code=vq.THRESHOLD, **vq._vqtorch_straight_through()).train()
    theirs._codebook.embed.data.copy_(ours.codebook[None])
    theirs._codebook.cluster_size.data.fill_(100.0)
    grads = []
    for mod, inp in ((ours, x), (theirs, x[None])):
        out, _, loss = mod(inp)
        grads.append(torch.autograd.grad(loss.sum() + out.float().square().mean(), x)[0])
    torch.testing.assert_close(grads[0], grads[1])


def test_speedup_table_device_columns():
    """Device times get their own columns and ratios; a result without one (saved before it was
    measured, or the host never got ahead) shows a dash rather than a ratio against nothing."""
    from sparsefuse.bench import harness

    ours = _result("sparsefuse", 1.0, "full")
    ours.device_ms = 0.5
    comp = _result("torch.compile", 3.0, "full")
    comp.device_ms = 2.9
    text = harness.speedup_table([ours, comp], baselines=("torch.compile",), device_baselines=("torch.compile",))
    head, _, row = text.splitlines()[:3]
    assert "sparsefuse device ms" in head and "vs torch.compile, device" in head
    assert "| **3.00×** | 0.500 | 5.80× |" in row
    comp.device_ms = None
    row = harness.speedup_table([ours, comp], baselines=("torch.compile",),
                                device_baselines=("torch.compile",)).splitlines()[2]
    assert "| **3.00×** | 0.500 | — |" in row
    assert "device" not in harness.speedup_table([ours, comp], baselines=("torch.compile",))


@pytest.mark.gpu
def test_device_time_reads_the_gpu_not_the_host():
    """A call that is mostly host time (2 ms of it, then one tiny launch) reads far less device time
    than do_bench time, and at least its 2 ms of host time; a call that is GPU work (a large matmul)
    reads about the same in both."""
    from triton.testing import do_bench

    from sparsefuse.bench import harness

    x = torch.ones(64, device="cuda")
    a = torch.randn(4096, 4096, device="cuda")

    def host_bound():
        time.sleep(0.002)
        x.add_(1)

    wall = do_bench(host_bound, warmup=20, rep=100)
    dev = harness.device_time(host_bound, wall)
    assert dev is not None and dev < 0.2 * wall, (dev, wall)
    assert harness.idle_host_ms(host_bound, 5) >= 2.0
    gpu_bound = lambda: a @ a  # noqa: E731
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < 0.5:  # clocks up first: a cold GPU ramps during do_bench
        gpu_bound()
        torch.cuda.synchronize()
    wall = do_bench(gpu_bound, warmup=20, rep=100)
    dev = harness.device_time(gpu_bound, wall)
    assert dev is not None and 0.8 * wall < dev < 1.2 * wall, (dev, wall)


def test_sae_ratio_lines_report_device_time_too(tmp_path):
    """Hierarchical over TopK and bf16 over fp32, each in do_bench time and in device time."""
    from sparsefuse.bench import sae

    shape = dict(B=4096, K=32, F=65536, D=2304)
    rs = [_res("topk", "sparsefuse", shape, 1.0), _res("hierarchical", "sparsefuse", shape, 1.5),
          _res("topk", "sparsefuse", shape, 0.9, dtype="bf16")]
    for r, dev in zip(rs, (0.5, 1.0, 0.4)):
        r.device_ms = dev
    text = sae._ratio_lines(rs)
    assert "fp32 K=32: 1.50× (device 2.00×)" in text
    assert "topk K=32: 0.90× (device 0.80×)" in text
    rs[1].device_ms = None
    assert "fp32 K=32: 1.50×\n" in sae._ratio_lines(rs)


# --- mutation audit: measure() and device_time() on a simulated GPU, tables, result files, the CLI


def test_measure_reports_the_median_and_quantiles(monkeypatch):
    """measure() on the CPU with the CUDA calls stubbed: ms is do_bench's median (not a quantile,
    not the mean), GB/s and TFLOP/s are per second of that median, the device time is
    device_time's, and a peak below the size of the call's results is flagged."""
    import triton.testing

    peak = [3 * 2**20]
    for name in ("synchronize", "empty_cache", "reset_peak_memory_stats"):
        monkeypatch.setattr(torch.cuda, name, lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda *a, **k: 2**20)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *a, **k: 2**20 + peak[0])
    monkeypatch.setattr(triton.testing, "do_bench", lambda fn, warmup, rep, quantiles: [0.5, 2.0, 8.0])
    monkeypatch.setattr(harness, "device_time", lambda fn, wall_ms: wall_ms / 4)
    out = torch.zeros(2**18)  # 1 MiB of results
    case = harness.Case(op="op", provider="sparsefuse", shape={"K": 8}, dtype="fp32", mode="full",
                        make=lambda: (lambda: out), bytes_moved=6 * 10**9, flops=4 * 10**12)
    res = harness.measure(case)
    assert (res.ms, res.ms_q20, res.ms_q80, res.device_ms) == (2.0, 0.5, 8.0, 0.5)
    assert res.run == harness.RUN != ""
    assert res.gbps == pytest.approx(3000.0) and res.tflops == pytest.approx(2000.0)
    assert res.peak_extra_mib == pytest.approx(3.0) and "peak_below_results_mib" not in res.extra
    peak[0] = 2**19
    res = harness.measure(case)
    assert res.extra["peak_below_results_mib"] == pytest.approx(1.0)


class _SimulatedGPU:
    """A GPU timeline (ms) and a host clock (ms) for device_time(): events stamp the GPU time, a
    sleep of c cycles lasts c / rate ms (the rate can change after the first sleep: clocks ramping
    up), each call of the timed function costs ``host_ms`` on the host and the next of ``gpu_ms`` on
    the GPU."""

    def __init__(self, monkeypatch, host_ms, gpu_ms, rates=(1000.0,)):
        import triton
        from types import SimpleNamespace

        self.gpu = self.host = 0.0
        self.rates, self.sleeps, self.calls = list(rates), 0, []
        self.host_ms, self.gpu_ms = host_ms, list(gpu_ms)
        sim = self

        class Event:
            def __init__(self, enable_timing=False):
                self.t = None

            def record(self):
                self.t = sim.gpu

            def elapsed_time(self, end):
                return end.t - self.t

        def sleep(cycles):
            sim.gpu += cycles / sim.rates[min(sim.sleeps, len(sim.rates) - 1)]
            sim.sleeps += 1
            if sim.sleeps > 1:
                sim.calls.append(0)  # one try starts

        driver = SimpleNamespace(get_empty_cache_for_benchmark=lambda: None, clear_cache=lambda cache: None)
        monkeypatch.setattr(triton.runtime, "driver", SimpleNamespace(active=driver))
        monkeypatch.setattr(torch.cuda, "Event", Event)
        monkeypatch.setattr(torch.cuda, "_sleep", sleep)
        monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
        monkeypatch.setattr(harness, "time", SimpleNamespace(perf_counter=lambda: sim.host / 1e3))

    def fn(self):
        self.host += self.host_ms
        self.gpu += self.gpu_ms[self.calls[-1] % len(self.gpu_ms)]
        self.calls[-1] += 1


def test_device_time_is_the_median_gpu_time_when_the_host_is_ahead(monkeypatch):
    gpu_ms = [0.3, 1.9, 0.7, 1.1, 0.2, 1.5, 0.9, 1.3, 0.5, 1.7, 0.4, 1.0, 0.6, 1.2, 0.8, 1.4, 0.1, 1.6, 1.8, 2.0]
    sim = _SimulatedGPU(monkeypatch, host_ms=0.01, gpu_ms=gpu_ms)
    got = harness.device_time(sim.fn, 1.0)
    assert sim.calls == [20]  # n = clamp(100 ms / wall_ms, 5, 20)
    assert got == pytest.approx(sorted(gpu_ms)[9])  # the lower median of the 20 calls


def test_device_time_retries_with_the_rate_the_sleep_showed(monkeypatch):
    """The GPU clocks up after the first (calibrating) sleep, so the next sleep is 4x shorter than
    asked and the host is not done when it ends: one retry with the new rate, same number of calls."""
    sim = _SimulatedGPU(monkeypatch, host_ms=1.0, gpu_ms=[0.25], rates=(1000.0, 4000.0))
    assert harness.device_time(sim.fn, 1.0) == pytest.approx(0.25)
    assert sim.calls == [20, 20]


def test_device_time_gives_up_with_none_when_the_host_never_gets_ahead(monkeypatch):
    """A host blocked on every call (10 ms each, the sleep as long as asked): half as many calls each
    try, down to three, and None after five tries (not a time that would read as the GPU's)."""
    sim = _SimulatedGPU(monkeypatch, host_ms=10.0, gpu_ms=[0.25])
    assert harness.device_time(sim.fn, 1.0) is None
    assert sim.calls == [20, 10, 5, 3, 3]


def _table_rows(text):
    lines = [line for line in text.splitlines() if line.startswith("| ")]
    head = [c.strip() for c in lines[0].strip("|").split("|")]
    return [dict(zip(head, (c.strip() for c in line.strip("|").split("|")))) for line in lines[1:]]


def test_speedup_table_columns_rows_and_order():
    """Each cell under its own header, only the results of the table's mode, shapes in numeric order
    (K=32 before K=128), and a baseline missing from a row shows a dash."""
    rs = []
    for K, ours_ms, torch_ms in ((128, 2.0, 5.0), (32, 1.0, 4.0)):
        ours = harness.Result(op="op", provider="sparsefuse", shape={"K": K}, dtype="fp32", mode="full", ms=ours_ms,
                              ms_q20=ours_ms, ms_q80=ours_ms, peak_extra_mib=10.0 * K, gbps=100.0 * K, gpu="GPU")
        rs += [ours, _res("op", "torch", {"K": K}, torch_ms)]
    rs.append(harness.Result(op="op", provider="sparsefuse", shape={"K": 64}, dtype="fp32", mode="fwd", ms=0.1,
                             ms_q20=0.1, ms_q80=0.1, peak_extra_mib=1.0, gpu="GPU"))
    rows = _table_rows(harness.speedup_table(rs))
    assert [r["shape"] for r in rows] == ["K=32", "K=128"]
    assert rows[0] == {"op": "op", "dtype": "fp32", "shape": "K=32", "sparsefuse ms": "1.000", "torch ms": "4.000",
                       "torch.compile ms": "—", "vs torch": "**4.00×**", "vs torch.compile": "—",
                       "sparsefuse peak MiB": "320", "sparsefuse GB/s": "3200"}
    assert rows[1]["vs torch"] == "**2.50×**" and rows[1]["sparsefuse peak MiB"] == "1280"
    fwd = _table_rows(harness.speedup_table(rs, mode="fwd"))
    assert [(r["shape"], r["sparsefuse ms"]) for r in fwd] == [("K=64", "0.100")]


def test_save_replaces_an_earlier_result_with_the_same_key(tmp_path):
    harness.save([_res("op", "sparsefuse", {"K": 8}, 1.0), _res("op", "torch", {"K": 8}, 3.0)], "fam", str(tmp_path))
    harness.save([_res("op", "sparsefuse", {"K": 8}, 2.0)], "fam", str(tmp_path))
    got = {(r.provider, r.ms) for r in harness.load("fam", str(tmp_path))}
    assert got == {("sparsefuse", 2.0), ("torch", 3.0)}


def test_a_row_measured_again_keeps_no_result_of_another_run(tmp_path):
    """A later run that lost a baseline (out of memory, not installed, another GPU) must not be
    compared with the earlier run's baseline: the row shows the baseline as missing. Results of one
    run, saved case by case, still merge; rows the new run did not measure stay; no temp file stays."""
    shape, other = {"K": 8}, {"K": 16}
    harness.save([_res("op", "sparsefuse", shape, 1.0, run="a", gpu="H200"), _res("op", "torch", shape, 4.0, run="a",
                  gpu="H200"), _res("op", "torch", other, 9.0, run="a", gpu="H200")], "fam", str(tmp_path))
    harness.save([_res("op", "sparsefuse", shape, 2.0, run="b", gpu="H100")], "fam", str(tmp_path))
    harness.save([_res("op", "torch.compile", shape, 3.0, run="b", gpu="H100")], "fam", str(tmp_path))
    got = {(r.provider, r.shape["K"], r.ms) for r in harness.load("fam", str(tmp_path))}
    assert got == {("sparsefuse", 8, 2.0), ("torch.compile", 8, 3.0), ("torch", 16, 9.0)}
    row = _table_rows(harness.speedup_table(harness.load("fam", str(tmp_path))))[0]
    assert row["torch ms"] == "—" and row["vs torch.compile"] == "**1.50×**"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fam.json"]


def test_a_slower_baseline_is_bold_and_a_faster_one_is_not():
    rows = _table_rows(harness.speedup_table([_res("op", "sparsefuse", {"K": 8}, 2.0), _res("op", "torch", {"K": 8}, 4.0),
                                              _res("op", "torch.compile", {"K": 8}, 1.0)]))
    assert rows[0]["vs torch"] == "**2.00×**" and rows[0]["vs torch.compile"] == "0.50×"


def test_plot_bars_keep_a_quick_run_apart_from_the_full_one():
    """The plot took the first result with the same K, so a --quick run saved beside the full one
    drew its times as the full shape's."""
    full, quick = dict(B=4096, K=32), dict(B=1024, K=32)
    sub = [_res("topk", "sparsefuse", full, 0.8), _res("topk", "sparsefuse", quick, 0.1), _res("topk", "torch", full, 3.0)]
    xs, bars, alone = harness._bars(sub, "K")
    assert not alone and xs == ["B=1024 K=32", "B=4096 K=32"]
    assert bars["sparsefuse"] == [0.1, 0.8] and bars["torch"][1] == 3.0 and bars["torch"][0] != bars["torch"][0]
    xs, bars, alone = harness._bars([r for r in sub if r.shape == full], "K")
    assert alone and xs == ["32"] and bars == {"sparsefuse": [0.8], "torch": [3.0]}


def test_kd_target_verdicts_read_the_printed_numbers():
    """A hidden-topk time of 5.004 ms printed as 5.00 ms must not be called "not met" (target <= 5 ms)."""
    from sparsefuse.bench import kd

    full = dict(kd.ISSUE_SHAPE)
    lines = kd._targets([_res("hidden-topk", "sparsefuse", full, 5.004, "bf16"),
                         _res("gathered", "sparsefuse", full, 1.0, "bf16"), _res("gathered", "torch", full, 2.996, "bf16"),
                         _res("hidden-full", "sparsefuse", full, 1.1504, "bf16"), _res("hidden-full", "matmul", full, 1.0,
                                                                                       "bf16")])
    assert "**5.00 ms** (target ≤ 5 ms: met)" in lines
    assert "**3.00×** faster than eager" in lines and "target ≥ 3×: met" in lines
    assert "**1.150×** the bare LM-head matmuls" in lines and "target ≤ 1.15×: met" in lines


def test_bench_cli_without_gpu_reruns_its_check_under_the_interpreter(monkeypatch):
    """Without the interpreter, CPU tensors take the PyTorch reference: the CLI's check reruns in a
    process with TRITON_INTERPRET=1, so that it checks the Triton kernels, and returns its status."""
    import subprocess
    import sys

    from sparsefuse import cli

    seen = {}

    def run(argv, env):
        seen.update(argv=argv, interpret=env.get("TRITON_INTERPRET"))
        return subprocess.CompletedProcess(argv, 3)

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(cli.subprocess, "run", run)
    # the interpreter off, where it would work: rerun with it
    monkeypatch.setattr(cli, "INTERPRET", False)
    monkeypatch.setattr(cli, "_interpreter_runs", lambda: True)
    assert cli.main(["bench", "sae"]) == 3
    assert seen == dict(argv=[sys.executable, "-m", "sparsefuse", "bench", "sae"], interpret="1")
    # the interpreter on, where it breaks (NumPy >= 2.4): rerun without it, on the reference path
    monkeypatch.setattr(cli, "INTERPRET", True)
    monkeypatch.setattr(cli, "_interpreter_runs", lambda: False)
    assert cli.main(["bench", "sae"]) == 3 and seen["interpret"] == "0"


def test_bench_cli_without_gpu_or_a_working_interpreter_says_what_it_checks(monkeypatch, capsys):
    """Triton 3.6's interpreter breaks on NumPy >= 2.4: there the check runs in process, on the
    reference path, and says so, rather than crash in a kernel."""
    import types

    import sparsefuse.bench
    from sparsefuse import cli

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(cli, "INTERPRET", False)
    monkeypatch.setattr(cli, "_interpreter_runs", lambda: False)
    monkeypatch.setattr(cli.subprocess, "run", lambda *a, **k: pytest.fail("spawned the interpreter rerun"))
    monkeypatch.setattr(sparsefuse.bench, "family", lambda name: types.SimpleNamespace(check=lambda log=print: True))
    assert cli.main(["bench", "sae"]) == 0
    out = capsys.readouterr().out
    assert "does not run with NumPy" in out and "PyTorch reference" in out and "all checks passed" in out


def test_interpreter_runs_follows_the_numpy_version(monkeypatch):
    from sparsefuse import cli

    for version, runs in (("2.3.5", True), ("1.26.4", True), ("2.4.0", False), ("2.4.0rc1", False), ("3.0.1", False)):
        monkeypatch.setattr(cli.np, "__version__", version)
        assert cli._interpreter_runs() is runs


def test_bench_cli_quick_run_keeps_out_of_the_results_and_the_readme(monkeypatch, tmp_path):
    import types

    import sparsefuse.bench
    from sparsefuse import cli

    readme = tmp_path / "README.md"
    readme.write_text("<!-- bench:sae -->\nfull run\n<!-- /bench:sae -->\n")
    rendered = []

    def family(name):
        return types.SimpleNamespace(cases=lambda quick: [quick],
                                     render=lambda out, readme: rendered.append((out, readme)) or "table")

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(sparsefuse.bench, "family", family)
    monkeypatch.setattr(harness, "gpu_name", lambda: "GPU")
    def run_cases(cases, on_round):
        results = [_res("op", "sparsefuse", {"quick": cases[0]}, 1.0)]
        on_round(results)
        return results

    monkeypatch.setattr(harness, "run_cases", run_cases)
    assert cli.main(["bench", "sae", "--quick"]) == 0
    quick_dir = str(tmp_path / harness.RESULTS_DIR / "quick")
    assert rendered == [(harness.os.path.join(harness.RESULTS_DIR, "quick"), "")]
    assert harness.load("sae", quick_dir)[0].shape == {"quick": True}
    assert not (tmp_path / harness.RESULTS_DIR / "sae.json").exists()
    assert cli.main(["bench", "sae"]) == 0
    assert rendered[-1] == (harness.RESULTS_DIR, "README.md")


@pytest.mark.parametrize("results", [(True, True), (False, True), (True, False)])
def test_bench_cli_without_gpu_exit_status_follows_every_check(monkeypatch, capsys, results):
    """`sparsefuse bench a b` without a GPU runs the check of every family named (all of them, even
    after one fails) and exits 1 when any failed."""
    import types

    import sparsefuse.bench
    from sparsefuse import cli

    called = []

    def family(name):
        def check(log=print):
            called.append(name)
            return dict(zip(("sae", "vq"), results))[name]
        return types.SimpleNamespace(check=check)

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(cli, "INTERPRET", True)  # as on a machine without a GPU (tests/conftest.py)
    monkeypatch.setattr(cli, "_interpreter_runs", lambda: True)
    monkeypatch.setattr(sparsefuse.bench, "family", family)
    status = cli.main(["bench", "sae", "vq"])
    out = capsys.readouterr().out
    assert called == ["sae", "vq"]
    assert status == (0 if all(results) else 1)
    assert ("all checks passed" in out) == all(results) and ("SOME CHECKS FAILED" in out) != all(results)


# --- mutation pass over the benchmark code: what a published number, ratio or verdict is made of


def _stub_cuda_memory(monkeypatch, inputs_mib=10, temp_mib=2):
    """A caching allocator for measure(): ``inputs_mib`` held throughout, each live result tensor
    counted while it lives (freed by reference count), and a call peaking at what is live plus
    ``temp_mib`` of temporaries plus its result."""
    import weakref

    state = {"live": 0, "peak": 0}
    mib = 2**20

    def allocated():
        return inputs_mib * mib + state["live"]

    def call_with(out):
        state["peak"] = max(state["peak"], allocated() + temp_mib * mib + out.numel() * out.element_size())
        state["live"] += out.numel() * out.element_size()
        weakref.finalize(out, lambda n=out.numel() * out.element_size(): state.__setitem__("live", state["live"] - n))
        return out

    for name in ("synchronize", "empty_cache"):
        monkeypatch.setattr(torch.cuda, name, lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda *a, **k: state.__setitem__("peak", allocated()))
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda *a, **k: allocated())
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *a, **k: state["peak"])
    return call_with


def test_measure_reads_the_quantiles_it_asks_for_and_the_peak_of_the_call(monkeypatch):
    """do_bench returns the quantiles in the order they are asked for: ms must be the 0.5 quantile of
    the timings and q20 / q80 the 0.2 / 0.8 ones (a stub that ignores ``quantiles`` cannot tell).
    The peak is counted from the allocation before the measured call (inputs excluded, the call's
    own result and temporaries included), not from after it."""
    import triton.testing

    samples = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0, 11.0])

    def do_bench(fn, warmup, rep, quantiles):
        return torch.quantile(samples, torch.tensor(quantiles)).tolist()

    monkeypatch.setattr(triton.testing, "do_bench", do_bench)
    monkeypatch.setattr(harness, "device_time", lambda fn, wall_ms: None)
    call_with = _stub_cuda_memory(monkeypatch, inputs_mib=10, temp_mib=2)
    case = harness.Case(op="op", provider="sparsefuse", shape={"K": 8}, dtype="fp32", mode="full",
                        make=lambda: (lambda: call_with(torch.zeros(2**20))))  # a 4 MiB result
    res = harness.measure(case)
    assert (res.ms_q20, res.ms, res.ms_q80) == pytest.approx((3.0, 6.0, 9.0))
    assert res.peak_extra_mib == pytest.approx(6.0)  # 4 MiB result + 2 MiB of temporaries
    assert "peak_below_results_mib" not in res.extra


def test_an_even_number_of_rounds_keeps_the_lower_median():
    """A case that lost a round (out of memory) or a run saved part-way has an even count: the
    lower median is kept (the docstring's rule), for every even count."""
    def rounds(*ms):
        return [[_res("op", "sparsefuse", {"K": 8}, m) for m in ms]]

    assert [r.ms for r in harness._medians(rounds(4.0, 2.0))] == [2.0]
    assert [r.ms for r in harness._medians(rounds(4.0, 1.0, 3.0, 2.0))] == [2.0]
    assert harness._medians(rounds(4.0, 1.0, 3.0, 2.0))[0].extra["rounds_ms"] == [1.0, 2.0, 3.0, 4.0]


def test_save_replaces_only_the_rows_measured_again(tmp_path):
    """A table row is (op, dtype, shape, mode): a later run that measured the bf16 row must leave the
    fp32 row of the earlier run, both its providers, in place."""
    shape = {"K": 8}
    harness.save([_res("op", "sparsefuse", shape, 1.0, run="a"), _res("op", "torch", shape, 4.0, run="a"),
                  _res("op", "sparsefuse", shape, 0.5, "bf16", run="a")], "fam", str(tmp_path))
    harness.save([_res("op", "sparsefuse", shape, 0.6, "bf16", run="b")], "fam", str(tmp_path))
    got = {(r.provider, r.dtype, r.ms) for r in harness.load("fam", str(tmp_path))}
    assert got == {("sparsefuse", "fp32", 1.0), ("torch", "fp32", 4.0), ("sparsefuse", "bf16", 0.6)}


def test_speedup_table_pairs_each_dtype_with_its_own_baseline():
    shape = {"K": 8}
    rs = [_res("op", "sparsefuse", shape, 1.0), _res("op", "torch", shape, 4.0),
          _res("op", "sparsefuse", shape, 0.5, "bf16"), _res("op", "torch", shape, 3.0, "bf16")]
    rows = {r["dtype"]: r for r in _table_rows(harness.speedup_table(rs))}
    assert (rows["fp32"]["torch ms"], rows["fp32"]["vs torch"]) == ("4.000", "**4.00×**")
    assert (rows["bf16"]["torch ms"], rows["bf16"]["vs torch"]) == ("3.000", "**6.00×**")


_SECTIONS = ("sae_train", "sae", "kd", "vq")  # sae_train first: its marker starts with "<!-- bench:sae"


def _readme_with_every_section(path):
    text = "# title\n" + "".join(f"before {s}\n<!-- bench:{s} -->\nold {s}\n<!-- /bench:{s} -->\nafter {s}\n"
                                 for s in _SECTIONS) + "the end\n"
    path.write_text(text)
    return text


def test_update_readme_rewrites_its_own_section_and_keeps_the_rest(tmp_path):
    readme = tmp_path / "README.md"
    before = _readme_with_every_section(readme)
    assert harness.update_readme("sae", "NEW TABLE", str(readme))
    want = before.replace("<!-- bench:sae -->\nold sae\n", "<!-- bench:sae -->\nNEW TABLE\n")
    assert readme.read_text() == want
    assert not harness.update_readme("missing", "x", str(readme)) and readme.read_text() == want
    assert not harness.update_readme("sae", "x", str(tmp_path / "absent.md"))


def _family_results(name):
    if name == "sae":
        shape = dict(B=4096, K=32, F=65536, D=2304)
        return [_res("topk", "sparsefuse", shape, 1.0), _res("topk", "torch", shape, 2.0)]
    if name == "sae_train":
        shape = dict(B=4096, K=64, F=65536, D=2304)
        return [_res("topk", "sparsefuse", shape, 1.0, "bf16"), _res("topk", "torch.compile", shape, 2.0, "bf16")]
    if name == "kd":
        shape = dict(N=8192, K=64)
        return [_res("gathered", "sparsefuse", shape, 1.0, "bf16"), _res("gathered", "torch", shape, 4.0, "bf16")]
    shape = dict(B=65536, K=1024, D=128)
    rs = [_res("search", "sparsefuse", shape, 1.0), _res("search", "torch", shape, 2.0)]
    for r in rs:
        r.mode = "fwd"
    return rs


@pytest.mark.parametrize("name", ["sae", "vq", "kd", "sae_train"])
def test_each_family_render_rewrites_its_own_readme_section(tmp_path, name):
    """render() of a family writes its table between its own markers and nowhere else."""
    from sparsefuse.bench import family

    readme = tmp_path / "README.md"
    before = _readme_with_every_section(readme)
    harness.save(_family_results(name), name, str(tmp_path))
    text = family(name).render(str(tmp_path), readme=str(readme))
    assert text and ("**2.00×**" in text or "**4.00×**" in text)
    want = before.replace(f"<!-- bench:{name} -->\nold {name}\n", f"<!-- bench:{name} -->\n{text}\n")
    assert readme.read_text() == want


def _closure_fn(case):
    import inspect

    return inspect.getclosurevars(case.make).nonlocals["fn"]


def test_sae_and_kd_cases_time_the_provider_they_name(monkeypatch):
    """Each case's callable is the provider's: ours for ``sparsefuse``, the eager reference for
    ``torch``, the reference under torch.compile for ``torch.compile`` (a swap would publish a
    speed-up against the wrong baseline, or against ourselves)."""
    import inspect

    from sparsefuse import topk_kd_loss
    from sparsefuse.bench import kd, sae

    monkeypatch.setattr(torch, "compile", lambda f, **kw: ("compiled", f))
    for c in sae.cases(quick=True):
        ours, ref = sae.OPS[c.op]
        assert _closure_fn(c) == {"sparsefuse": ours, "torch": ref, "torch.compile": ("compiled", ref)}[c.provider], c
    refs = {"gathered": kd._ref_gathered, "logits-full": kd._ref_logits, "hidden-full": kd._ref_hidden,
            "hidden-topk": kd._ref_hidden_topk}
    for c in kd.cases(quick=True):
        if c.provider == "matmul":
            continue
        fn, ref = _closure_fn(c), refs[c.op]
        if c.provider == "torch":
            assert fn is ref, c
        elif c.provider == "torch.compile":
            assert fn == ("compiled", ref), c
        else:
            assert fn not in refs.values() and not isinstance(fn, tuple), c
            if c.op == "gathered":
                assert fn is topk_kd_loss
    nz = {c.op: inspect.getclosurevars(c.make).nonlocals["normalize"] for c in kd.cases(quick=True)
          if c.op.startswith("hidden") and c.provider != "matmul"}
    assert nz == {"hidden-full": "full", "hidden-topk": "topk"}


def test_sae_hierarchical_over_topk_pairs_within_one_dtype():
    from sparsefuse.bench import sae

    shape = dict(B=4096, K=32, F=65536, D=2304)
    rs = [_res("topk", "sparsefuse", shape, 1.0), _res("hierarchical", "sparsefuse", shape, 1.5),
          _res("topk", "sparsefuse", shape, 0.5, "bf16"), _res("hierarchical", "sparsefuse", shape, 0.6, "bf16")]
    text = sae._ratio_lines(rs)
    assert "bf16 K=32: 1.20×" in text and "fp32 K=32: 1.50×" in text
    assert "hierarchical K=32: 0.40×" in text and "topk K=32: 0.50×" in text


def test_kd_target_verdicts_read_our_peak_its_threshold_and_device_time():
    """The peak verdict reads our step's peak (not the matmul's) against 1.5 GiB; a speed-up of
    2.96x is printed and judged as 2.96x (not rounded up to a met 3x); the device-time speed-up is
    eager over ours, like the do_bench one."""
    from sparsefuse.bench import kd

    full = dict(kd.ISSUE_SHAPE)

    def step(peak_gib):
        us, mm = _res("hidden-full", "sparsefuse", full, 1.1, "bf16"), _res("hidden-full", "matmul", full, 1.0, "bf16")
        us.peak_extra_mib, mm.peak_extra_mib = peak_gib * 1024, 0.1 * 1024
        return [us, mm]

    assert "peak extra 1.60 GiB (target ≤ 1.5 GiB: not met)" in kd._targets(step(1.6))
    assert "peak extra 1.50 GiB (target ≤ 1.5 GiB: met)" in kd._targets(step(1.5))
    assert "peak extra 0.50 GiB (target ≤ 1.5 GiB: met)" in kd._targets(step(0.5))
    assert "peak extra 2.00 GiB (target ≤ 1.5 GiB: not met)" in kd._targets(step(2.0))
    us, ref = _res("gathered", "sparsefuse", full, 1.0, "bf16"), _res("gathered", "torch", full, 2.96, "bf16")
    us.device_ms, ref.device_ms = 0.1, 0.4
    line = kd._targets([us, ref])
    assert "**2.96×** faster than eager" in line and "target ≥ 3×: not met" in line
    assert "in device time 4.00× (0.100 vs 0.400 ms)" in line


def test_vq_search_gbps_counts_bytes_of_its_dtype():
    from sparsefuse.bench import vq

    got = {(c.provider, c.dtype): c for c in vq.cases(quick=True) if c.op == "search"}
    assert {d for _, d in got} == {"fp32", "bf16"}
    for (_, dtype), c in got.items():
        B, K, D = (c.shape[k] for k in "BKD")
        assert c.bytes_moved == (B * D + K * D) * {"fp32": 4, "bf16": 2}[dtype], c.provider
        assert c.flops == 2 * B * K * D


def test_vq_render_puts_each_provider_and_dtype_in_its_table(tmp_path):
    from sparsefuse.bench import vq

    shape = dict(B=65536, K=1024, D=128)
    rs = [_res("search", p, shape, ms) for p, ms in
          (("sparsefuse", 1.0), ("sparsefuse-fast", 0.5), ("torch", 2.0), ("torch.compile", 1.6),
           ("torch.compile-tf32", 1.5), ("sparsefuse-ieee", 1.2))]
    rs += [_res("search", p, shape, ms, "bf16") for p, ms in (("sparsefuse", 0.3), ("torch", 0.9), ("torch.compile", 0.6))]
    for r in rs:
        r.mode = "fwd"
    harness.save(rs, "vq", str(tmp_path))
    text = vq.render(str(tmp_path), readme="")
    exact, rest = text.split("**Nearest-code search, fast fp32**")
    fast, bf16 = rest.split("**Nearest-code search, bf16**")
    exact_row, = _table_rows(exact)
    assert (exact_row["dtype"], exact_row["sparsefuse ms"], exact_row["vs torch"]) == ("fp32", "1.000", "**2.00×**")
    fast_row, = _table_rows(fast)
    assert (fast_row["sparsefuse-fast ms"], fast_row["vs torch.compile-tf32"]) == ("0.500", "**3.00×**")
    bf16_row, = _table_rows(bf16)
    assert (bf16_row["dtype"], bf16_row["sparsefuse ms"], bf16_row["vs torch"]) == ("bf16", "0.300", "**3.00×**")


def _cpu_make_state(monkeypatch):
    from sparsefuse.bench import vq

    real = vq.make_state
    monkeypatch.setattr(vq, "make_state", lambda B, K, D, device, **kw: real(B, K, D, "cpu", **kw))


def test_vq_baselines_run_the_precision_and_semantics_of_their_row(monkeypatch):
    """The exact-fp32 search baselines run with TF32 off, only ``-tf32`` with it on (else the exact
    table compares our fp32-accurate search with a TF32 one); each EMA baseline runs the reference
    with the semantics of its op."""
    from sparsefuse.bench import vq

    _cpu_make_state(monkeypatch)
    monkeypatch.setattr(torch, "compile", lambda f, **kw: f)
    tf32 = []
    monkeypatch.setattr(vq, "_search_torch", lambda x, c: tf32.append(torch.backends.cuda.matmul.allow_tf32))
    active = []
    monkeypatch.setattr(vq.reference, "ema_update", lambda *a, **kw: active.append(kw["active"]))
    seen = set()
    for c in vq.cases(quick=True):
        if not c.provider.startswith("torch"):
            continue
        if c.op == "search":
            c.make()()
            assert tf32.pop() == c.provider.endswith("tf32"), c.provider
        elif c.op.startswith("ema"):
            c.make()()
            assert active.pop() == (c.op == "ema_active"), (c.op, c.provider)
        seen.add((c.op, c.provider))
    assert {("search", "torch.compile-tf32"), ("search", "torch"), ("ema_laplace", "torch"),
            ("ema_active", "torch.compile")} <= seen


def test_sae_train_shares_line():
    from sparsefuse.bench import sae_train

    shape = dict(B=4096, K=64, F=65536, D=2304)
    rs = [_res("topk", p, shape, ms, "bf16") for p, ms in (("sparsefuse", 10.0), ("sparsefuse+compile", 8.0),
                                                              ("torch.compile", 24.0), ("sparsefuse-decoder-only", 16.0))]
    rs.append(_res("topk-decoder", "sparsefuse", shape, 2.0, "bf16"))
    line = sae_train.shares(rs)
    assert "step 10.00 ms (8.00 ms with its forward compiled)" in line
    assert "torch.compile 24.00 ms (**3.00×** with the forward compiled, 2.40× without)" in line
    assert "with the dense encoder backward kept, 16.00 ms (1.50×)" in line
    assert "the fused decoder loss is 2.00 ms, 20% of the step" in line
    rs[1].ms = 12.0  # the compiled step slower: the ratio uses the eager one
    assert "torch.compile 24.00 ms (**2.40×**)" in sae_train.shares(rs)


def test_sae_train_providers_build_the_step_they_name(monkeypatch):
    from sparsefuse.bench import sae_train

    monkeypatch.setattr(sae_train, "make_step", lambda loss, decoder, encoder, compiled, *a: (decoder, encoder, compiled))
    want = {"sparsefuse": ("fused", "sparse", False), "sparsefuse+compile": ("fused", "sparse", True),
            "sparsefuse-decoder-only": ("fused", "dense", False), "torch": ("reference", "dense", False),
            "torch.compile": ("reference", "dense", True)}
    got = {c.provider: c.make() for c in sae_train.cases(quick=True) if c.op in sae_train.LOSSES}
    assert got == want


def test_sae_train_main_quick_run_keeps_out_of_the_results(monkeypatch, tmp_path):
    import types

    from sparsefuse.bench import sae_train

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(harness, "gpu_name", lambda: "GPU")
    monkeypatch.setattr(sae_train, "cases", lambda quick: [types.SimpleNamespace(quick=quick)])
    monkeypatch.setattr(harness, "run_cases", lambda cases: [_res("topk", "sparsefuse", {"quick": cases[0].quick}, 1.0)])
    rendered = []
    monkeypatch.setattr(sae_train, "render", lambda out, readme: rendered.append((out, readme)) or "table")
    assert sae_train.main(["--quick"]) == 0
    assert rendered == [(harness.QUICK_DIR, "")]
    assert harness.load("sae_train", harness.QUICK_DIR)[0].shape == {"quick": True}
    assert not (tmp_path / harness.RESULTS_DIR / "sae_train.json").exists()


def test_bench_cli_render_reads_the_folder_of_the_run(monkeypatch):
    import types

    import sparsefuse.bench
    from sparsefuse import cli

    rendered = []
    monkeypatch.setattr(sparsefuse.bench, "family",
                        lambda name: types.SimpleNamespace(render=lambda out, readme: rendered.append((out, readme))))
    assert cli.main(["bench", "sae", "--render", "--quick"]) == 0
    assert cli.main(["bench", "sae", "--render", "--out", "elsewhere"]) == 0
    assert cli.main(["bench", "sae", "--render"]) == 0
    assert rendered == [(harness.QUICK_DIR, ""), ("elsewhere", "README.md"), (harness.RESULTS_DIR, "README.md")]


def test_kd_peak_verdict_is_not_given_for_a_misread_peak():
    """A peak that measure() flagged as below the call's own results (the 2.1 MiB reading of session
    14) gets no "met": the target line says it was misread, as the table does."""
    from sparsefuse.bench import kd

    full = dict(kd.ISSUE_SHAPE)

    def mk(provider, ms, peak):
        return harness.Result(op="hidden-full", provider=provider, shape=full, dtype="bf16", mode="full", ms=ms,
                              ms_q20=ms, ms_q80=ms, peak_extra_mib=peak, gpu="GPU")

    us, mm = mk("sparsefuse", 1.1, 2.1), mk("matmul", 1.0, 1100.0)
    assert "target ≤ 1.5 GiB: met" in kd._targets([us, mm])
    us.extra["peak_below_results_mib"] = 1064.0
    line = kd._targets([us, mm])
    assert "1.5 GiB: met" not in line and "1.5 GiB: not met" not in line and "peak extra misread" in line


def test_speedup_table_footer_names_only_the_gpus_of_its_rows_and_is_empty_without_rows():
    """The footer's GPUs are those of the rows shown (a fwd-mode result measured elsewhere is not in
    a full-mode table), and a table with no result of ours is "" rather than a bare header (the VQ
    CUDA-graph section printed one when a run had no graph results)."""
    ours, base = _res("op", "sparsefuse", {"K": 8}, 1.0), _res("op", "torch", {"K": 8}, 2.0)
    other = _res("op", "sparsefuse", {"K": 8}, 1.0)
    other.mode, other.gpu = "fwd", "Other GPU"
    text = harness.speedup_table([ours, base, other])
    assert "Other GPU" not in text and f"Measured on {ours.gpu};" in text
    assert harness.speedup_table([base]) == ""
    assert harness.speedup_table([other]) == ""


def test_rel_err_keeps_a_nan_in_any_place():
    """The families' no-GPU checks compare [loss, *gradients] with rel_err: a NaN in any entry must
    fail them. Python's max kept a NaN only in first place, so a NaN gradient read as a pass."""
    a, b = torch.ones(3), torch.full((3,), 2.0)
    assert harness.rel_err([a, a], [a, a]) == 0
    assert harness.rel_err([a, b], [a, a]) == pytest.approx(1.0)
    nan = torch.tensor([1.0, float("nan"), 1.0])
    for got in ([a, nan], [nan, a], [a, a, nan]):
        assert math.isnan(harness.rel_err(got, [a] * len(got))), got
    with pytest.raises(ValueError):
        harness.rel_err([a], [a, a])


def test_sae_check_fails_a_nan_gradient(monkeypatch):
    """``sparsefuse bench sae`` without a GPU: an op whose loss is right but whose vals gradient is NaN
    is reported as FAILED, and the check returns False."""
    from sparsefuse.bench import sae
    from sparsefuse.sae import reference

    def nan_vals_grad(idx, w, v, b, t):  # (0 v)^(1/2) adds 0 to the loss and 0 * inf = NaN to its gradient
        return reference.topk_sae_loss(idx, w, v, b, t) + (0 * v).sqrt().sum()

    monkeypatch.setattr(sae, "OPS", {"topk": (nan_vals_grad, reference.topk_sae_loss)})
    lines = []
    assert sae.check(log=lines.append) is False
    assert "FAILED" in lines[0] and "nan" in lines[0], lines


# Rare paths the session 52 mutation pass found untested (benchmarks/logs/mutation_session52_launch_harness.md).

# --- measure() and the timing helpers ---------------------------------------------------------


def _stub_timing(monkeypatch):
    import triton.testing

    monkeypatch.setattr(triton.testing, "do_bench", lambda fn, warmup, rep, quantiles: [1.0, 2.0, 3.0])
    monkeypatch.setattr(harness, "device_time", lambda fn, wall_ms: None)


def test_a_peak_equal_to_the_results_size_is_not_a_misreading(monkeypatch):
    """A call that allocates its result and nothing else peaks at exactly the result's size: that is
    the expected reading, not one to flag in the table."""
    _stub_timing(monkeypatch)
    call_with = _stub_cuda_memory(monkeypatch, inputs_mib=10, temp_mib=0)
    case = harness.Case(op="op", provider="sparsefuse", shape={"K": 8}, dtype="fp32", mode="fwd",
                        make=lambda: (lambda: call_with(torch.zeros(2**20))))
    res = harness.measure(case)
    assert res.peak_extra_mib == pytest.approx(4.0) and "peak_below_results_mib" not in res.extra


def test_result_bytes_count_the_whole_storage_of_a_view():
    """A result that is a slice of a larger buffer holds the whole buffer."""
    buf = torch.zeros(64)
    assert harness._result_bytes(buf[:8]) == 64 * 4
    assert harness._result_bytes([buf[8:16], buf[:8]]) == 64 * 4


def test_measure_runs_the_measured_call_with_the_collector_off(monkeypatch):
    """The peak is read from the call with the garbage collector disabled (a collection during it
    would hand freed memory to its allocations), and the collector is on again afterwards."""
    import gc

    _stub_timing(monkeypatch)
    call_with = _stub_cuda_memory(monkeypatch)
    seen = []

    def make():
        def call():
            seen.append(gc.isenabled())
            return call_with(torch.zeros(16))
        return call

    harness.measure(harness.Case(op="op", provider="sparsefuse", shape={}, dtype="fp32", mode="fwd", make=make))
    assert seen == [True, False] and gc.isenabled()


def test_measure_without_byte_or_flop_counts_reports_no_rates(monkeypatch):
    _stub_timing(monkeypatch)
    call_with = _stub_cuda_memory(monkeypatch)
    case = harness.Case(op="op", provider="sparsefuse", shape={}, dtype="fp32", mode="fwd",
                        make=lambda: (lambda: call_with(torch.zeros(16))))
    res = harness.measure(case)
    assert res.gbps is None and res.tflops is None


class _Clock:
    """``harness.time`` with a clock that only the timed function moves."""

    def __init__(self, monkeypatch):
        self.t = 0.0
        monkeypatch.setattr(harness, "time", types.SimpleNamespace(perf_counter=lambda: self.t))
        monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)


def test_idle_host_ms_is_the_median_of_its_calls(monkeypatch):
    clock = _Clock(monkeypatch)
    costs = iter([0.001, 0.002, 0.001, 0.050, 0.003])

    def fn():
        clock.t += next(costs)

    assert harness.idle_host_ms(fn, n=5) == pytest.approx(2.0)  # ms; the mean would read 11.4


def test_host_us_is_microseconds_of_the_timed_calls_only(monkeypatch):
    clock = _Clock(monkeypatch)
    calls = [0]

    def fn():
        calls[0] += 1
        clock.t += 1.0 if calls[0] <= 3 else 2e-6  # the warm-up calls are slow (compiling, say)

    assert harness.host_us(fn, n=10, warmup=3) == pytest.approx(2.0)
    assert calls[0] == 13


def test_device_time_times_at_least_five_calls(monkeypatch):
    """A 50 ms call: 100 ms / 50 ms is 2 calls, raised to the floor of 5 (a median of fewer is noise)."""
    sim = _SimulatedGPU(monkeypatch, host_ms=0.01, gpu_ms=[0.25])
    assert harness.device_time(sim.fn, 50.0) == pytest.approx(0.25)
    assert sim.calls == [5]


@pytest.mark.parametrize("clear_ms, rates, calls", [(0.5, (1000.0,), [20]), (0.6, (1000.0, 1500.0), [20, 20])],
                         ids=["host-work-per-call", "clock-ramp-1.5x"])
def test_device_time_sleep_covers_the_hosts_own_work_and_reads_a_clock_ramp(monkeypatch, clear_ms, rates, calls):
    """Each call also costs the host an L2 flush and two event records besides ``fn``: the sleep is
    sized with room for them (twice the calls' wall time), so a host-bound step (host time = wall
    time) is timed in one try. A sleep two thirds as long as asked (clocks up 1.5x) is a clock
    change, retried with the same number of calls, not a blocked host (half as many)."""
    sim = _SimulatedGPU(monkeypatch, host_ms=1.0, gpu_ms=[0.25], rates=rates)

    def clear_cache(cache):
        sim.host += clear_ms

    import triton as _triton

    monkeypatch.setattr(_triton.runtime.driver.active, "clear_cache", clear_cache)
    assert harness.device_time(sim.fn, 1.0) == pytest.approx(0.25)
    assert sim.calls == calls


# --- run_cases, save, tables, README, plots ---------------------------------------------------


def test_run_cases_goes_on_after_a_case_runs_out_of_memory(monkeypatch):
    """The eager reference can exceed the card at large K: that case is logged and left out, and
    the cases after it (and its later rounds' companions) are still measured."""
    def fake_measure(case):
        if case.provider == "torch":
            raise torch.cuda.OutOfMemoryError("CUDA out of memory")
        return _res(case.op, case.provider, case.shape, 1.0)

    monkeypatch.setattr(harness, "measure", fake_measure)
    monkeypatch.setattr(harness, "_warm_gpu", lambda case: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    cases = [harness.Case(op="op", provider=p, shape={"K": 8}, dtype="fp32", mode="full", make=lambda: None,
                          rounds=2) for p in ("sparsefuse", "torch", "torch.compile")]
    lines = []
    got = harness.run_cases(cases, log=lines.append)
    assert [r.provider for r in got] == ["sparsefuse", "torch.compile"]
    assert sum("out of memory" in line for line in lines) == 2


def test_a_forward_run_keeps_the_full_rows_of_another_run(tmp_path):
    """A table row includes its mode: measuring an op forward-only must not drop its full-mode
    results of an earlier run."""
    shape = {"K": 8}
    harness.save([_res("op", "sparsefuse", shape, 1.0, run="a"), _res("op", "torch", shape, 4.0, run="a")], "fam",
                 str(tmp_path))
    fwd = _res("op", "sparsefuse", shape, 0.4, run="b")
    fwd.mode = "fwd"
    harness.save([fwd], "fam", str(tmp_path))
    got = {(r.provider, r.mode, r.ms) for r in harness.load("fam", str(tmp_path))}
    assert got == {("sparsefuse", "full", 1.0), ("torch", "full", 4.0), ("sparsefuse", "fwd", 0.4)}


def test_speedup_table_row_without_our_device_time():
    """Our result saved before device times were measured, the baseline's with one: dashes, not a
    crash on None."""
    ours, comp = _res("op", "sparsefuse", {"K": 8}, 1.0), _res("op", "torch.compile", {"K": 8}, 3.0)
    comp.device_ms = 2.9
    row, = _table_rows(harness.speedup_table([ours, comp], baselines=("torch.compile",), device_baselines=("torch.compile",)))
    assert row["sparsefuse device ms"] == "—" and row["vs torch.compile, device"] == "—"
    assert row["vs torch.compile"] == "**3.00×**"


def test_speedup_table_footer_names_the_gpu_of_every_provider_shown():
    """Results saved before runs were recorded (run "") merge as one run: a row can hold a baseline
    measured on another GPU, and the footer must name it."""
    ours, base = _res("op", "sparsefuse", {"K": 8}, 1.0, gpu="H200"), _res("op", "torch", {"K": 8}, 2.0, gpu="H100")
    assert "Measured on H100, H200;" in harness.speedup_table([ours, base])


def test_update_readme_leaves_a_section_without_its_end_marker(tmp_path):
    readme = tmp_path / "README.md"
    text = "# t\n<!-- bench:sae -->\nold\nno end marker\n"
    readme.write_text(text)
    assert harness.update_readme("sae", "NEW", str(readme)) is False
    assert readme.read_text() == text


def test_publish_writes_the_family_markdown_and_a_forward_mode_plot(tmp_path):
    """publish() writes the rendered text to ``<family>.md`` and plots the results of its mode (a
    forward-only family, such as VQ's, got no PNG when the plot read mode "full")."""
    rs = [_res("search", p, {"K": k}, ms)
          for p, k, ms in (("sparsefuse", 8, 1.0), ("torch", 8, 2.0), ("sparsefuse", 16, 1.5))]
    for r in rs:
        r.mode = "fwd"
    harness.publish("fam", "TABLE TEXT", rs, out_dir=str(tmp_path), readme="", title="t", x_key="K", mode="fwd")
    assert (tmp_path / "fam.md").read_text() == "TABLE TEXT\n"
    assert (tmp_path / "fam.png").stat().st_size > 0


def test_plot_draws_a_panel_per_op_of_its_mode_only_and_ours_first(tmp_path, monkeypatch):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = []
    real = plt.subplots

    def subplots(nrows, ncols, **kw):
        panels.append(ncols)
        return real(nrows, ncols, **kw)

    monkeypatch.setattr(plt, "subplots", subplots)
    rs = [_res("a", p, {"K": 8}, 1.0) for p in ("torch", "sparsefuse", "matmul")]  # matmul: KD's, sorts before ours
    fwd_only = _res("b", "sparsefuse", {"K": 8}, 1.0)
    fwd_only.mode = "fwd"
    assert harness.plot(rs + [fwd_only], str(tmp_path / "p.png"), title="t", x_key="K") is not None
    assert panels == [1]
    _, bars, _ = harness._bars(rs, "K")
    assert list(bars) == ["sparsefuse", "matmul", "torch"]  # ours first (the first colour in every panel)


def test_rel_err_of_an_exact_zero_is_zero():
    """A reference gradient that is exactly zero (and ours too) is a match, not 0/0 = NaN (which the
    families' checks report as FAILED)."""
    z = torch.zeros(3)
    assert harness.rel_err([z, torch.ones(2)], [z, torch.ones(2)]) == 0.0
    assert harness.rel_err([torch.full((3,), 1e-3)], [z]) > 1  # still an error against a zero reference


# --- the SAE family: its inputs, cases and no-GPU check ---------------------------------------


def test_sae_inputs_have_distinct_latents_sorted_by_activation():
    """Each row's K latents are distinct and its values sorted largest first, as a TopK encoder
    hands them over (repeated latents would time atomics on one row, and the Hierarchical loss's
    prefixes depend on the order)."""
    from sparsefuse.bench import sae

    idx, weight, vals, bias, target = sae.make_inputs(9, 12, 16, 4, torch.float32, "cpu")
    assert idx.dtype == torch.int32 and idx.shape == (9, 12) and vals.shape == (9, 12)
    assert all(len(set(row.tolist())) == 12 for row in idx)
    assert ((vals[:, :-1] >= vals[:, 1:]).all() and (vals[:, 0] > vals[:, -1]).all())
    assert weight.shape == (16, 4) and bias.shape == (4,) and target.shape == (9, 4)


def _sae_cases(monkeypatch):
    from sparsefuse.bench import sae

    monkeypatch.setattr(torch, "compile", lambda f, **kw: f)
    return sae.cases(quick=True)


def test_sae_cases_cover_both_dtypes_in_the_same_rounds_ours_back_to_back(monkeypatch):
    """Every (K, op) has each provider in fp32 and bf16, all timed in ROUNDS rounds (every provider
    of a comparison alike), and our fp32 and bf16 cases run back to back (the targets compare them)."""
    from sparsefuse.bench import sae

    cases = _sae_cases(monkeypatch)
    assert {c.rounds for c in cases} == {sae.ROUNDS} and sae.ROUNDS > 1
    groups = {}
    for c in cases:
        groups.setdefault((c.shape["K"], c.op), []).append((c.provider, c.dtype))
    assert set(groups) == {(K, op) for K in (32, 64, 128) for op in sae.OPS}
    for order in groups.values():
        assert order == [(p, d) for p in ("sparsefuse", "torch", "torch.compile") for d in ("fp32", "bf16")]


@pytest.mark.parametrize("bad", ["first", "last"])
def test_sae_check_fails_an_op_off_by_a_relative_1e4(monkeypatch, bad):
    """The no-GPU check compares each op with the float64 reference (not with itself in float64) at
    a tolerance of 1e-5: a loss 1e-4 too large fails it, whichever op it is."""
    from sparsefuse.bench import sae
    from sparsefuse.sae import reference

    def off(idx, w, v, b, t):
        return reference.topk_sae_loss(idx, w, v, b, t) * (1 + 1e-4)

    ops = {"topk": (off if bad == "first" else reference.topk_sae_loss, reference.topk_sae_loss),
           "hierarchical": (off if bad == "last" else reference.topk_sae_loss, reference.topk_sae_loss)}
    monkeypatch.setattr(sae, "OPS", ops)
    lines = []
    assert sae.check(log=lines.append) is False
    assert ["FAILED" in line for line in lines] == [bad == "first", bad == "last"], lines


def test_sae_table_shows_our_device_time_against_torch_compile(tmp_path):
    """The SAE section compares device times with torch.compile's (the small-K steps are close to
    host-bound, so the do_bench ratio alone understates the kernels)."""
    from sparsefuse.bench import sae

    shape = dict(B=4096, K=32, F=65536, D=2304)
    rs = [_res("topk", "sparsefuse", shape, 1.0), _res("topk", "torch.compile", shape, 3.0)]
    rs[0].device_ms, rs[1].device_ms = 0.5, 2.0
    harness.save(rs, "sae", str(tmp_path))
    row, = _table_rows(sae.render(str(tmp_path), readme=""))
    assert row["sparsefuse device ms"] == "0.500" and row["vs torch.compile, device"] == "4.00×"


def test_a_zero_device_time_reads_as_not_measured():
    """A device time of 0 (events around a call that queued no GPU work) gives dashes in the table
    and no device ratio in the SAE ratio lines, not a division by zero."""
    from sparsefuse.bench import sae

    shape = dict(B=4096, K=32, F=65536, D=2304)
    ours, comp = _res("topk", "sparsefuse", shape, 1.0), _res("topk", "torch.compile", shape, 3.0)
    ours.device_ms, comp.device_ms = 0.0, 2.0
    row, = _table_rows(harness.speedup_table([ours, comp], baselines=("torch.compile",), device_baselines=("torch.compile",)))
    assert row["sparsefuse device ms"] == "—" and row["vs torch.compile, device"] == "—"
    hier = _res("hierarchical", "sparsefuse", shape, 1.5)
    hier.device_ms = 1.0
    assert "fp32 K=32: 1.50×\n" in sae._ratio_lines([ours, hier, _res("topk", "sparsefuse", shape, 0.9, "bf16")])


# --- the CLI ----------------------------------------------------------------------------------


def test_bench_cli_refuses_an_unknown_family(monkeypatch, capsys):
    import sparsefuse.bench
    from sparsefuse import cli

    monkeypatch.setattr(sparsefuse.bench, "family", lambda name: pytest.fail(f"ran family {name}"))
    assert cli.main(["bench", "sae", "nope"]) == 2
    err = capsys.readouterr().err
    assert "unknown benchmark family ['nope']" in err and "sae, vq, kd, sae_train" in err


def test_bench_cli_defaults_to_every_family_and_honours_readme(monkeypatch):
    """``sparsefuse bench`` with no family names every family; ``--readme`` picks the README whose
    tables are rewritten (``''``: none), for a full run and a quick one alike."""
    import sparsefuse.bench
    from sparsefuse import cli

    rendered = []
    monkeypatch.setattr(sparsefuse.bench, "family", lambda name: types.SimpleNamespace(
        render=lambda out, readme: rendered.append((name, out, readme))))
    assert cli.main(["bench", "--render"]) == 0
    assert [name for name, _, _ in rendered] == list(sparsefuse.bench.FAMILIES)
    rendered.clear()
    assert cli.main(["bench", "sae", "--render", "--readme", "OTHER.md"]) == 0
    assert cli.main(["bench", "sae", "--render", "--readme", ""]) == 0
    assert cli.main(["bench", "sae", "--render", "--quick", "--readme", "OTHER.md"]) == 0
    assert rendered == [("sae", harness.RESULTS_DIR, "OTHER.md"), ("sae", harness.RESULTS_DIR, ""),
                        ("sae", harness.QUICK_DIR, "OTHER.md")]
