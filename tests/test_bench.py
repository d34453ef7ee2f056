"""The benchmark harness: round-robin rounds (``Case.rounds``, timing stubbed out) and the host profile."""

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
