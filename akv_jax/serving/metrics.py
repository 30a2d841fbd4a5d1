"""Prometheus metrics: HTTP-side counters/histograms plus engine statistics read at scrape time.

Each app gets its own ``CollectorRegistry`` (not the global one) so several servers can live in
one process, as they do in tests. Engine numbers are pulled from ``Engine.stats()`` when
/metrics is scraped instead of being pushed by the engine: the engine stays free of any
Prometheus dependency and the numbers are always current.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import generate_latest

log = logging.getLogger(__name__)

PREFIX = "akv"
CONTENT_TYPE = CONTENT_TYPE_LATEST

# engine stats key -> (metric name without prefix, kind, help)
ENGINE_METRICS: dict[str, tuple[str, str, str]] = {
    "cache_queries": ("cache_queries", "counter", "Requests matched against the radix cache."),
    "cache_query_tokens": (
        "cache_query_tokens", "counter", "Prompt tokens looked up in the radix cache."
    ),
    "cache_hit_tokens": (
        "cache_hit_tokens", "counter", "Prompt tokens whose KV was reused from the cache."
    ),
    "evictions": ("cache_evictions", "counter", "KV pages freed by cache eviction."),
    "dead_evictions": (
        "cache_evicted_dead_pages", "counter",
        "Evicted KV pages that no stored path attends to again (dropped or superseded).",
    ),
    "restores": ("cache_restores", "counter", "One-pass restores of evicted cache prefixes."),
    "restored_tokens": (
        "cache_restored_tokens", "counter", "Tokens recomputed by one-pass restores."
    ),
    "requests_finished": ("engine_requests_finished", "counter", "Requests the engine ended."),
    "pool_used_pages": ("kv_pool_used_pages", "gauge", "KV pool pages in use."),
    "pool_total_pages": ("kv_pool_total_pages", "gauge", "KV pool pages in total."),
    "host_used_pages": ("kv_host_used_pages", "gauge", "Host-tier KV pages in use."),
    "host_total_pages": ("kv_host_total_pages", "gauge", "Host-tier KV pages in total."),
    "offloaded_pages": (
        "kv_offloaded_pages", "counter", "Evicted live KV pages copied to the host tier."
    ),
    "reloaded_pages": (
        "kv_reloaded_pages", "counter", "KV pages copied back from the host tier (not recomputed)."
    ),
    "host_evicted_pages": (
        "kv_host_evicted_pages", "counter", "Host-tier pages evicted (their KV is gone)."
    ),
    "host_dead_evictions": (
        "kv_host_evicted_dead_pages", "counter", "Host-tier pages evicted that held dead KV."
    ),
    "preemptions": (
        "engine_preemptions", "counter", "Decoding requests swapped out for lack of pages."
    ),
    "resumes": ("engine_resumes", "counter", "Preempted requests resumed."),
    "admission_waits": (
        "engine_admission_waits", "counter",
        "Steps in which the next queued request could not be admitted (memory or protection).",
    ),
    "admission_wait_seconds": (
        "engine_admission_wait_seconds", "counter", "Queueing time of admitted requests, summed."
    ),
    "running": ("num_running_requests", "gauge", "Requests being prefilled or decoded."),
    "waiting": ("num_waiting_requests", "gauge", "Requests queued for admission."),
}

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
TOKEN_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5)


class EngineCollector:
    """Turns one ``stats()`` dict into metric families on every scrape."""

    def __init__(self, stats_fn: Callable[[], Mapping[str, Any]]):
        self.stats_fn = stats_fn

    def describe(self) -> list[Metric]:
        # Empty: registration must not call stats() (the engine may not be running yet).
        return []

    def collect(self) -> Iterator[Metric]:
        try:
            stats = dict(self.stats_fn())
        except Exception:  # a scrape must never fail the server
            log.exception("engine stats() failed")
            return
        for key, value in sorted(stats.items()):
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            name, kind, doc = ENGINE_METRICS.get(
                key, (_sanitize(f"engine_{key}"), "gauge", f"Engine statistic {key!r}.")
            )
            family = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
            yield family(f"{PREFIX}_{name}", doc, value=value)
        hit, query = stats.get("cache_hit_tokens"), stats.get("cache_query_tokens")
        if isinstance(hit, (int, float)) and isinstance(query, (int, float)):
            yield GaugeMetricFamily(
                f"{PREFIX}_cache_hit_rate",
                "Cache hit tokens / cache query tokens since start (0 before any query).",
                value=hit / query if query else 0.0,
            )
        used, total = stats.get("pool_used_pages"), stats.get("pool_total_pages")
        if isinstance(used, (int, float)) and isinstance(total, (int, float)):
            yield GaugeMetricFamily(
                f"{PREFIX}_kv_pool_usage", "Fraction of KV pool pages in use.",
                value=used / total if total else 0.0,
            )


def _sanitize(name: str) -> str:
    return re.sub(r"[^a-zA-Z0-9_]", "_", name)


class ServerMetrics:
    def __init__(self, stats_fn: Callable[[], Mapping[str, Any]]):
        self.registry = CollectorRegistry(auto_describe=False)
        r = self.registry
        self.http_requests = Counter(
            f"{PREFIX}_http_requests", "HTTP requests by route and status code.",
            ["method", "path", "status"], registry=r,
        )
        self.request_latency = Histogram(
            f"{PREFIX}_request_latency_seconds",
            "End-to-end latency of generation requests (to the last token).",
            ["endpoint"], buckets=LATENCY_BUCKETS, registry=r,
        )
        self.ttft = Histogram(
            f"{PREFIX}_time_to_first_token_seconds", "Time from request to first token.",
            ["endpoint"], buckets=LATENCY_BUCKETS, registry=r,
        )
        self.tpot = Histogram(
            f"{PREFIX}_time_per_output_token_seconds",
            "Mean time per output token after the first, per request.",
            ["endpoint"], buckets=TOKEN_LATENCY_BUCKETS, registry=r,
        )
        self.finished = Counter(
            f"{PREFIX}_requests_finished", "Generation requests finished, by finish reason.",
            ["endpoint", "finish_reason"], registry=r,
        )
        self.prompt_tokens = Counter(
            f"{PREFIX}_prompt_tokens", "Prompt tokens of finished requests.", registry=r
        )
        self.cached_tokens = Counter(
            f"{PREFIX}_cached_prompt_tokens",
            "Prompt tokens of finished requests served from the cache.", registry=r,
        )
        self.generation_tokens = Counter(
            f"{PREFIX}_generation_tokens", "Tokens generated.", registry=r
        )
        r.register(EngineCollector(stats_fn))

    def observe_request(
        self,
        endpoint: str,
        *,
        latency: float,
        ttft: float | None,
        completion_tokens: int,
        prompt_tokens: int,
        cached_tokens: int,
        finish_reason: str | None,
    ) -> None:
        self.request_latency.labels(endpoint).observe(latency)
        if ttft is not None:
            self.ttft.labels(endpoint).observe(ttft)
            if completion_tokens > 1:
                self.tpot.labels(endpoint).observe((latency - ttft) / (completion_tokens - 1))
        # No finish reason: the stream ended early (client gone).
        self.finished.labels(endpoint, finish_reason or "cancelled").inc()
        self.prompt_tokens.inc(prompt_tokens)
        self.cached_tokens.inc(cached_tokens)
        self.generation_tokens.inc(completion_tokens)

    def render(self) -> bytes:
        return generate_latest(self.registry)
