"""The service's ``/metrics`` text for vLLM's D3D proposer: its step counts are exported as
counters from the latest polled totals, and nothing is exported before a poll or for a count
the proposer does not keep."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from app.metrics import Metrics


def exported(metrics: Metrics) -> dict[str, float]:
    out = {}
    for fam in text_string_to_metric_families(metrics.render().decode()):
        for s in fam.samples:
            if s.name.startswith("d3d_vllm_"):
                out[s.name] = s.value
    return out


def test_the_proposers_step_counts_are_counters_of_the_latest_totals():
    totals: dict = {}
    m = Metrics()
    m.watch_proposer(lambda: totals.get("now"))
    assert exported(m) == {}  # not polled yet
    totals["now"] = {"plain_steps": 7, "speculative_steps": 3, "draft_fetches": 3, "errors": 0}
    assert exported(m) == {
        "d3d_vllm_plain_steps_total": 7.0,
        "d3d_vllm_speculative_steps_total": 3.0,
        "d3d_vllm_draft_fetches_total": 3.0,
    }
    totals["now"] = {"plain_steps": 9}  # a runner without the draft flag keeps no fetch count
    assert exported(m) == {"d3d_vllm_plain_steps_total": 9.0}
