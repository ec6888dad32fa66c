"""Prometheus metrics of an API server (`prometheus-client`). With several API-server processes the
launcher sets PROMETHEUS_MULTIPROC_DIR, so any process's `/metrics` reports the sum over all of
them; engine-wide gauges (running, waiting, KV usage, prefix cache) take the most recent value."""
from __future__ import annotations

import os
import time

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client import multiprocess

from nanoserve.protocol import SchedulerStats

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)


def _gauge(name: str, doc: str) -> Gauge:
    return Gauge(name, doc, multiprocess_mode="mostrecent")


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
        self.running = _gauge("nanoserve:num_requests_running", "Requests in the running batch")
        self.waiting = _gauge("nanoserve:num_requests_waiting", "Requests waiting to be scheduled")
        self.kv_usage = _gauge("nanoserve:kv_cache_usage_perc", "Fraction of KV-cache blocks in use")
        self.prefix_queries = _gauge("nanoserve:prefix_cache_queries", "Prompt tokens looked up in the prefix cache")
        self.prefix_hits = _gauge("nanoserve:prefix_cache_hits", "Prompt tokens found in the prefix cache")
        self.prefix_hit_rate = _gauge("nanoserve:prefix_cache_hit_rate", "Prefix-cache hits / queries")
        self.preemptions = _gauge("nanoserve:num_preemptions", "Requests preempted since start")
        self.engine_idle = _gauge("nanoserve:engine_idle_seconds",
                                  "Engine-core loop time spent waiting for input with nothing to run")
        self.spec_drafts = _gauge("nanoserve:spec_decode_num_draft_tokens", "Speculative draft tokens verified")
        self.spec_accepted = _gauge("nanoserve:spec_decode_num_accepted_tokens", "Speculative draft tokens accepted")

    def update_engine(self, stats: SchedulerStats) -> None:
        self.running.set(stats.num_running)
        self.waiting.set(stats.num_waiting)
        self.kv_usage.set(stats.kv_cache_usage)
        self.prefix_queries.set(stats.prefix_queried_tokens)
        self.prefix_hits.set(stats.prefix_hit_tokens)
        self.prefix_hit_rate.set(stats.prefix_hit_tokens / stats.prefix_queried_tokens
                                 if stats.prefix_queried_tokens else 0.0)
        self.preemptions.set(stats.num_preemptions)
        self.engine_idle.set(stats.idle_seconds)
        self.spec_drafts.set(stats.spec_draft_tokens)
        self.spec_accepted.set(stats.spec_accepted_tokens)

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
