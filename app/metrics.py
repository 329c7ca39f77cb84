"""Prometheus metrics: one registry per app, names shaped after vLLM's.

Request counts and latency by route and status, time to first token, generated tokens and
tokens/s, queue depth, running batch size and the target KV it holds, speculative decoding counters with vLLM's names
(``num_drafts``, ``num_draft_tokens``, ``num_accepted_tokens``, accepted tokens per position),
async-drafting branch hits and misses (when the decode statistics carry them), and the keep ratio
of compressed documents, and the drafter worker's state (``d3d_drafter_worker_up``,
``d3d_drafter_worker_restarts_total``, read from its supervisor at each scrape). An engine with
metrics of its own (vLLM's ``vllm:*``) adds its registry, rendered after the service's.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

LATENCY = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 20, 40, 80, 160, 320)


class Metrics:
    """All service metrics in their own registry (several apps can live in one process)."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter(
            "d3d_requests", "HTTP requests", ["route", "method", "status"], registry=r
        )
        self.latency = Histogram(
            "d3d_request_latency_seconds",
            "HTTP request latency (to the last byte)",
            ["route", "method", "status"],
            buckets=LATENCY,
            registry=r,
        )
        self.ttft = Histogram(
            "d3d_time_to_first_token_seconds",
            "Submission to first generated token",
            buckets=LATENCY,
            registry=r,
        )
        self.prompt_tokens = Counter("d3d_prompt_tokens", "Prompt tokens prefilled", registry=r)
        self.generation_tokens = Counter("d3d_generation_tokens", "Tokens generated", registry=r)
        self.tokens_per_second = Histogram(
            "d3d_request_tokens_per_second",
            "Per-request decode speed",
            buckets=(1, 2, 5, 10, 20, 40, 80, 160, 320, 640),
            registry=r,
        )
        self.queue_depth = Gauge("d3d_queue_depth", "Requests waiting for a batch slot", registry=r)
        self.running = Gauge("d3d_running_requests", "Requests in the running batch", registry=r)
        self.kv_in_use = Gauge(
            "d3d_kv_tokens_in_use", "Target KV tokens reserved by the running requests", registry=r
        )
        self.rejected = Counter("d3d_rejected_requests", "Refused: queue full", registry=r)
        self.drafts = Counter("d3d_spec_decode_num_drafts", "Speculative rounds", registry=r)
        self.draft_tokens = Counter(
            "d3d_spec_decode_num_draft_tokens", "Draft tokens proposed", registry=r
        )
        self.accepted_tokens = Counter(
            "d3d_spec_decode_num_accepted_tokens", "Draft tokens accepted", registry=r
        )
        self.accepted_per_pos = Counter(
            "d3d_spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens accepted at each block position",
            ["position"],
            registry=r,
        )
        self.branch_hits = Counter("d3d_spec_decode_branch_hits", "Async branch hits", registry=r)
        self.branch_misses = Counter(
            "d3d_spec_decode_branch_misses", "Async branch misses", registry=r
        )
        self.keep_ratio = Histogram(
            "d3d_compression_keep_ratio",
            "Kept fraction of document tokens",
            buckets=(0.05, 0.1, 0.2, 0.3, 0.5, 0.7, 0.9, 1.0),
            registry=r,
        )

        self._extra: list[Callable[[], CollectorRegistry]] = []

    def watch_worker(self, status: Callable[[], dict | None]) -> None:
        """Export the drafter worker's state from ``status()`` (its supervisor's ``status``)."""
        self.registry.register(_WorkerCollector(status))

    def watch_proposer(self, totals: Callable[[], dict | None]) -> None:
        """Export the step counts of vLLM's D3D proposer from ``totals()`` (its latest
        ``totals``: :class:`d3d.vllm.stats.StatsPoller`)."""
        self.registry.register(_ProposerCollector(totals))

    def add_registry(self, registry: Callable[[], CollectorRegistry]) -> None:
        """Render another registry (an engine's own metrics) after this one."""
        self._extra.append(registry)

    def observe_request(self, route: str, method: str, status: int, seconds: float) -> None:
        labels = (route, method, str(status))
        self.requests.labels(*labels).inc()
        self.latency.labels(*labels).observe(seconds)

    def observe_stats(self, stats: dict) -> None:
        """Fold one finished request's decode statistics (``DecodeStats.to_dict()``) in."""
        self.prompt_tokens.inc(stats.get("prompt_tokens", 0))
        self.generation_tokens.inc(stats.get("num_tokens", 0))
        if stats.get("tokens_per_second"):
            self.tokens_per_second.observe(stats["tokens_per_second"])
        self.drafts.inc(stats.get("num_drafts", 0))
        self.draft_tokens.inc(stats.get("num_draft_tokens", 0))
        self.accepted_tokens.inc(stats.get("num_accepted_tokens", 0))
        for i, n in enumerate(stats.get("accepted_per_position", []) or []):
            if n:
                self.accepted_per_pos.labels(str(i)).inc(n)
        self.branch_hits.inc(stats.get("branch_hits", 0) or 0)
        self.branch_misses.inc(stats.get("branch_misses", 0) or 0)

    def render(self) -> bytes:
        return b"".join(
            [generate_latest(self.registry), *(generate_latest(r()) for r in self._extra)]
        )


class _WorkerCollector(Collector):
    """The drafter worker's gauge and restart counter, read at scrape time."""

    def __init__(self, status: Callable[[], dict | None]):
        self.status = status

    def collect(self) -> Iterator:
        s = self.status()
        if s is None:  # no drafter worker: nothing to report
            return
        up = GaugeMetricFamily("d3d_drafter_worker_up", "1 while the drafter worker is up")
        up.add_metric([], 1.0 if s.get("state") == "up" else 0.0)
        yield up
        restarts = CounterMetricFamily(
            "d3d_drafter_worker_restarts", "Drafter workers replaced (died, hung, never ready)"
        )
        restarts.add_metric([], float(s.get("restarts", 0)))
        yield restarts


class _ProposerCollector(Collector):
    """vLLM's steps as the D3D proposer counts them, read at scrape time: steps in which no
    request drafted (vLLM's plain path, :mod:`d3d.vllm.plain_steps`), speculative steps, and
    the engine core's round trips for drafts (none after a step without drafts,
    :mod:`d3d.vllm.draft_fetch`)."""

    COUNTERS = (
        ("plain_steps", "vLLM steps in which no request drafted (its plain path)"),
        ("speculative_steps", "vLLM steps that verified drafts"),
        ("draft_fetches", "Round trips of vLLM's engine core for drafts"),
    )

    def __init__(self, totals: Callable[[], dict | None]):
        self.totals = totals

    def collect(self) -> Iterator:
        t = self.totals()
        if not isinstance(t, dict):  # no proposer, or not polled yet
            return
        for key, doc in self.COUNTERS:
            if key in t:
                c = CounterMetricFamily(f"d3d_vllm_{key}", doc)
                c.add_metric([], float(t[key]))
                yield c
