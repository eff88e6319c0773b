"""Prometheus metrics for the server, in a registry of their own (not prometheus-client's global one)."""
from __future__ import annotations

import time
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from resin.core.engine import LLMEngine
from resin.core.outputs import RequestOutput

if TYPE_CHECKING:
    from resin.server.async_engine import AsyncEngine

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0,
                    20.0, 40.0, 80.0)


class ServerMetrics:
    def __init__(self, model_name: str):
        self.registry = CollectorRegistry()
        r, labels = self.registry, ["model_name"]

        def lab(metric):
            return metric.labels(model_name=model_name)

        self.ttft = lab(Histogram("resin:time_to_first_token_seconds", "Time to first token.", labels,
                                  registry=r, buckets=_LATENCY_BUCKETS))
        self.itl = lab(Histogram("resin:inter_token_latency_seconds", "Time between output tokens.", labels,
                                 registry=r, buckets=_LATENCY_BUCKETS))
        self.e2e = lab(Histogram("resin:e2e_request_latency_seconds", "Request latency, arrival to finish.",
                                 labels, registry=r, buckets=_LATENCY_BUCKETS))
        self.running = lab(Gauge("resin:num_requests_running", "Sequences in the running batch.", labels,
                                 registry=r))
        self.waiting = lab(Gauge("resin:num_requests_waiting", "Sequences waiting to be scheduled.", labels,
                                 registry=r))
        self.kv_usage = lab(Gauge("resin:kv_cache_usage_perc", "Fraction of KV cache blocks in use (0-1).",
                                  labels, registry=r))
        self.prefix_hit_rate = lab(Gauge("resin:prefix_cache_hit_rate", "Prefix-cache block hits / queries.",
                                         labels, registry=r))
        self.prefix_queries = lab(Counter("resin:prefix_cache_queries", "Prefix-cache blocks queried.", labels,
                                          registry=r))
        self.prefix_hits = lab(Counter("resin:prefix_cache_hits", "Prefix-cache blocks hit.", labels, registry=r))
        self.prompt_tokens = lab(Counter("resin:prompt_tokens", "Prompt tokens received.", labels, registry=r))
        self.generation_tokens = lab(Counter("resin:generation_tokens", "Tokens generated.", labels, registry=r))
        self.preemptions = lab(Counter("resin:num_preemptions", "Sequences preempted (recomputed later).", labels,
                                       registry=r))
        # Every user request ends in exactly one of these (the soak test checks that they add up to those sent).
        self.finished = lab(Counter("resin:request_success", "Requests finished normally.", labels, registry=r))
        self.aborted = lab(Counter("resin:request_aborted", "Requests aborted (client gone or stalled, shutdown).",
                                   labels, registry=r))
        self.failed = lab(Counter("resin:request_failed", "Requests ended by an error inside the engine.", labels,
                                  registry=r))
        self.rejected = lab(Counter("resin:request_rejected", "Requests refused before running (4xx, 503).",
                                    labels, registry=r))
        self._outcomes = {"success": self.finished, "aborted": self.aborted, "failed": self.failed,
                          "rejected": self.rejected}
        self.batch_size = lab(Histogram("resin:step_batch_size", "Sequences per engine step.", labels, registry=r,
                                        buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256)))
        self.step_tokens = lab(Histogram("resin:step_num_tokens", "Tokens per engine step.", labels, registry=r,
                                         buckets=(1, 4, 16, 64, 256, 1024, 4096, 16384)))
        self._seen = (0, 0)

    def outcome(self, name: str) -> None:
        self._outcomes[name].inc()

    def on_step(self, engine: LLMEngine) -> None:
        """Called by the engine thread after each step."""
        step = engine.last_step
        if step.num_seqs:
            self.batch_size.observe(step.num_seqs)
            self.step_tokens.observe(step.num_tokens)
        self.generation_tokens.inc(step.num_sampled)
        self.preemptions.inc(step.num_preempted)
        stats = engine.prefix_cache_stats  # counters read off the engine's totals
        queried, hits = self._seen
        self.prefix_queries.inc(stats.queried_blocks - queried)
        self.prefix_hits.inc(stats.hit_blocks - hits)
        self._seen = (stats.queried_blocks, stats.hit_blocks)

    def update_gauges(self, engine: AsyncEngine) -> None:
        """The gauges, read off the engine when /metrics is scraped (their only writer, so a scrape never sees a
        stale step's count). Waiting counts the sequences submitted but not yet taken by the step loop too."""
        self.running.set(engine.engine.num_running)
        self.waiting.set(engine.num_waiting)
        self.kv_usage.set(engine.engine.kv.usage)
        self.prefix_hit_rate.set(engine.engine.prefix_cache_stats.hit_rate)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class RequestTimer:
    """TTFT, inter-token latency and end-to-end latency of one user request into the histograms, and how it
    ended into exactly one outcome counter."""

    def __init__(self, metrics: ServerMetrics):
        self.metrics = metrics
        self.start = self.last = time.monotonic()
        self.tokens = 0
        self.outcome: str | None = None

    def observe(self, new: int) -> None:
        if new <= 0:
            return
        now = time.monotonic()
        if self.tokens == 0:
            self.metrics.ttft.observe(now - self.start)
        else:
            for _ in range(new):
                self.metrics.itl.observe((now - self.last) / new)
        self.tokens, self.last = self.tokens + new, now

    def observe_final(self, outputs: list[RequestOutput]) -> None:
        """A whole (non-streamed) response: its first-token time comes from the engine, later tokens are spread
        evenly over the rest of the time (they were never seen one by one here)."""
        firsts = [o.metrics["first_token_time"] for o in outputs if "first_token_time" in o.metrics]
        total = sum(len(c.token_ids) for o in outputs for c in o.outputs)
        if not firsts or total == 0:
            return
        first, now = min(firsts), time.monotonic()
        self.metrics.ttft.observe(max(first - self.start, 0.0))
        for _ in range(total - 1):
            self.metrics.itl.observe((now - first) / (total - 1))
        self.tokens, self.last = total, now

    def finish(self, outcome: str) -> None:
        """outcome: success, aborted (client gone, stalled, shutdown) or failed (an engine error). Once."""
        if self.outcome is None:
            self.outcome = outcome
            self.metrics.e2e.observe(time.monotonic() - self.start)
            self.metrics.outcome(outcome)


def outcome_of(outputs: list[RequestOutput]) -> str:
    if any(o.error for o in outputs):
        return "failed"
    if any(c.finish_reason == "abort" for o in outputs for c in o.outputs):
        return "aborted"
    return "success"
