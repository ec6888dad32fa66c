"""Prometheus metrics of an API server (`prometheus-client`). With several API-server processes the
launcher sets PROMETHEUS_MULTIPROC_DIR, so any process's `/metrics` reports the sum over all of
them; engine-wide gauges (running, waiting, KV usage, prefix cache) take the most recent value, as a total
over the data-parallel engine cores and per core (`nanoserve:per_engine_*{engine="i"}`)."""
from __future__ import annotations

import os
import time

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client import multiprocess

from nanoserve.protocol import SchedulerStats

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)


# Engine-wide gauges: (name, help, how N engines' values combine into the unlabelled total). Each also has a
# `nanoserve:per_engine_<name>{engine="i"}` series per data-parallel engine core.
ENGINE_GAUGES = (
    ("num_requests_running", "Requests in the running batch", "sum"),
    ("num_requests_waiting", "Requests waiting to be scheduled", "sum"),
    ("kv_cache_usage_perc", "Fraction of KV-cache blocks in use", "mean"),
    ("prefix_cache_queries", "Prompt tokens looked up in the prefix cache", "sum"),
    ("prefix_cache_hits", "Prompt tokens found in the prefix cache", "sum"),
    ("prefix_cache_hit_rate", "Prefix-cache hits / queries", "ratio"),
    ("num_preemptions", "Requests preempted since start", "sum"),
    ("engine_idle_seconds", "Engine-core loop time spent waiting for input with nothing to run", "sum"),
    ("spec_decode_num_draft_tokens", "Speculative draft tokens verified", "sum"),
    ("spec_decode_num_accepted_tokens", "Speculative draft tokens accepted", "sum"),
)


def engine_gauge_values(stats: SchedulerStats) -> dict[str, float]:
    hit_rate = stats.prefix_hit_tokens / stats.prefix_queried_tokens if stats.prefix_queried_tokens else 0.0
    return {"num_requests_running": stats.num_running, "num_requests_waiting": stats.num_waiting,
            "kv_cache_usage_perc": stats.kv_cache_usage, "prefix_cache_queries": stats.prefix_queried_tokens,
            "prefix_cache_hits": stats.prefix_hit_tokens, "prefix_cache_hit_rate": hit_rate,
            "num_preemptions": stats.num_preemptions, "engine_idle_seconds": stats.idle_seconds,
            "spec_decode_num_draft_tokens": stats.spec_draft_tokens,
            "spec_decode_num_accepted_tokens": stats.spec_accepted_tokens}


class Metrics:
    def __init__(self):
        self.requests = Counter("nanoserve:request_success", "Finished requests by finish reason",
                                ["finished_reason"])
        self.prompt_tokens = Counter("nanoserve:prompt_tokens", "Prompt tokens processed")
        self.generation_tokens = Counter("nanoserve:generation_tokens", "Tokens generated")
        self.ttft = Histogram("nanoserve:time_to_first_token_seconds", "Time to first token",
                              buckets=LATENCY_BUCKETS)
        self.itl = Histogram("nanoserve:inter_token_latency_seconds", "Time between output tokens",
                             buckets=LATENCY_BUCKETS)
        self.e2e = Histogram("nanoserve:e2e_request_latency_seconds", "End-to-end request latency",
                             buckets=LATENCY_BUCKETS)
        # Engine-wide: most recent value of any API server (each hears every core's stats).
        self.totals = {name: Gauge(f"nanoserve:{name}", doc, multiprocess_mode="mostrecent")
                       for name, doc, _ in ENGINE_GAUGES}
        self.per_engine = {name: Gauge(f"nanoserve:per_engine_{name}", f"{doc}, per engine core", ["engine"],
                                       multiprocess_mode="mostrecent") for name, doc, _ in ENGINE_GAUGES}

    def update_engines(self, stats: list[SchedulerStats]) -> None:
        """Per-engine series, and totals: sums, the mean KV usage, the hit rate over all cores' tokens."""
        values = [engine_gauge_values(s) for s in stats]
        for name, _, combine in ENGINE_GAUGES:
            column = [v[name] for v in values]
            for i, value in enumerate(column):
                self.per_engine[name].labels(engine=str(i)).set(value)
            if combine == "mean":
                total = sum(column) / len(column)
            elif combine == "ratio":
                queries = sum(s.prefix_queried_tokens for s in stats)
                total = sum(s.prefix_hit_tokens for s in stats) / queries if queries else 0.0
            else:
                total = sum(column)
            self.totals[name].set(total)

    @staticmethod
    def render() -> tuple[bytes, str]:
        if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
            registry = CollectorRegistry()
            multiprocess.MultiProcessCollector(registry)
            return generate_latest(registry), CONTENT_TYPE_LATEST
        return generate_latest(), CONTENT_TYPE_LATEST


class RequestTimer:
    """Per-request latency bookkeeping: first token, gaps between tokens, end to end."""

    def __init__(self, metrics: Metrics):
        self.metrics = metrics
        self.start = self.last = time.perf_counter()
        self.first = True

    def tokens(self, count: int) -> None:
        if not count:
            return
        now = time.perf_counter()
        if self.first:
            self.metrics.ttft.observe(now - self.start)
            self.first = False
        else:
            self.metrics.itl.observe((now - self.last) / count)
        self.last = now
        self.metrics.generation_tokens.inc(count)

    def finish(self, reasons: list[str]) -> None:
        self.metrics.e2e.observe(time.perf_counter() - self.start)
        for reason in reasons:
            self.metrics.requests.labels(finished_reason=reason).inc()
