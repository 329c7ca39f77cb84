"""The soak's pass criteria (``eval.soak``) on made-up runs: windows, memory growth after the
warm-up, p99 of the last window against the reference window, errors, the per-minute table."""

from __future__ import annotations

import pytest

from eval.soak import criteria, per_minute, windows

W30 = windows(30)


def flat(t: float) -> float:
    return 1000.0


def run(minutes: float, latency, rss=flat, status=lambda t: 200):
    """A request finishing every second and a sample every 10 s over ``minutes``, shaped by
    ``latency(t)``, ``rss(t)`` and ``status(t)``."""
    end = int(minutes * 60)
    requests = [[float(t), status(t), latency(t), 0.01, 10] for t in range(1, end + 1)]
    samples = [{"t": float(t), "rss": rss(t), "kv": 100} for t in range(0, end + 1, 10)]
    return requests, samples


def test_windows_of_the_issue_and_scaled_ones_for_short_runs():
    w = windows(30)
    assert (w.warm, w.ref_end, w.last_start, w.end, w.scaled) == (300, 600, 1500, 1800, False)
    w = windows(60)
    assert (w.warm, w.ref_end, w.last_start, w.end, w.scaled) == (300, 600, 3300, 3600, False)
    w = windows(15)  # the shortest run the fixed windows fit
    assert (w.warm, w.ref_end, w.last_start, w.scaled) == (300, 600, 600, False)
    w = windows(2)  # scaled by 2/30: warm-up 20 s, reference 20-40 s, last 100-120 s
    assert (w.warm, w.ref_end, w.last_start, w.end) == pytest.approx((20, 40, 100, 120))
    assert w.scaled


def test_a_steady_run_passes():
    c = criteria(*run(30, lambda t: 1.0 + 0.001 * (t % 7)), W30)
    assert c["errors_ok"] and c["memory_ok"] and c["p99_ok"] and c["passed"]
    assert c["memory_growth"] == 0 and c["p99_ratio"] == pytest.approx(1.0)


def test_memory_growth_counts_from_the_end_of_the_warm_up():
    doubling_in_warm_up = criteria(*run(30, flat, lambda t: 500 + min(t, 300) * 10), W30)
    assert doubling_in_warm_up["memory_ok"]
    leak = criteria(*run(30, flat, lambda t: 1000 * (1 + 0.06 * max(t - 300, 0) / 1500)), W30)
    assert not leak["memory_ok"] and leak["memory_growth"] == pytest.approx(0.06)
    assert not leak["passed"]
    spike = criteria(*run(30, flat, lambda t: 1060 if t == 900 else 1000), W30)
    assert not spike["memory_ok"]  # the peak counts, not only the end
    small = criteria(*run(30, flat, lambda t: 1000 * (1 + 0.04 * max(t - 300, 0) / 1500)), W30)
    assert small["memory_ok"]


def test_p99_of_the_last_window_against_minutes_5_to_10():
    slower = criteria(*run(30, lambda t: 1.2 if t >= 1500 else 1.0), W30)
    assert not slower["p99_ok"] and slower["p99_ratio"] == pytest.approx(1.2)
    assert criteria(*run(30, lambda t: 1.09 if t >= 1500 else 1.0), W30)["p99_ok"]
    assert criteria(*run(30, lambda t: 0.5 if t >= 1500 else 1.0), W30)["p99_ok"]  # faster
    assert criteria(*run(30, lambda t: 9.0 if t < 300 else 1.0), W30)["p99_ok"]  # warm-up


def test_a_single_error_fails_and_a_short_run_uses_scaled_windows():
    c = criteria(*run(2, flat, status=lambda t: 503 if t == 77 else 200), windows(2))
    assert c["errors"] == 1 and not c["errors_ok"] and not c["passed"]
    assert c["windows"]["scaled"] and c["memory_ok"] and c["p99_ok"]
    slower_last_20s = criteria(*run(2, lambda t: 1.5 if t >= 100 else 1.0), windows(2))
    assert not slower_last_20s["p99_ok"]


def test_no_requests_in_a_window_is_no_pass():
    c = criteria([], [{"t": 0.0, "rss": 1}], W30)
    assert c["errors_ok"] and not c["memory_ok"] and not c["p99_ok"]


def test_per_minute_rows_take_the_tail_into_the_last_minute():
    reqs, samples = run(2, lambda t: 1.0, lambda t: 1000 + t)
    reqs.append([123.0, 500, 0.0, 0.0, 0])  # finished after the end: the last minute's
    rows = per_minute(reqs, samples, end=120.0)
    assert [r["minute"] for r in rows] == [1, 2]
    assert [r["requests"] for r in rows] == [59, 62] and [r["errors"] for r in rows] == [0, 1]
    assert rows[0]["tokens_per_s"] == pytest.approx(590 / 60)
    assert rows[1]["p99_s"] == pytest.approx(1.0) and rows[1]["kv_max"] == 100
    assert rows[1]["rss_mib"] == pytest.approx((1000 + 120) / 2**20)
