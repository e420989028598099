"""`/metrics`: the engine's counters and the server's latencies in Prometheus's text format.

Each app has its own `CollectorRegistry` (never the process-wide default one), so two
servers in one process (tests) never share series. The engine's gauges and counters are
read from `EngineClient.stats()` at scrape time; the latency histograms are observed by
the server as outputs arrive:

- `axcore_time_to_first_token_seconds`: from a request's arrival at the server to the
  first output holding a generated token (one observation per engine request);
- `axcore_inter_token_latency_seconds`: per choice, the time between two of its outputs
  divided by the tokens the later one added (one observation per token after the first).
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from axcore.engine.requests import EngineClient

# Histogram buckets in seconds: a CPU decode step is milliseconds to a second, a first token up to tens of seconds.
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class EngineCollector:
    """Reads `engine.stats()` once per scrape into gauges and counters (`axcore_*`)."""

    def __init__(self, engine: EngineClient):
        self.engine = engine

    def describe(self):
        return []  # Collected at scrape time only (the registry must not call stats() when registering).

    def collect(self):
        s = self.engine.stats()
        gauges = [
            ("axcore_requests_waiting", "Requests waiting to start in the engine", s.waiting),
            ("axcore_sequences_running", "Sequences in the engine's running batch", s.running),
            ("axcore_kv_blocks_used", "KV-cache blocks holding a live sequence's tokens", s.kv_blocks_used),
            ("axcore_kv_blocks_free", "KV-cache blocks free (cached but unused ones included)", s.kv_blocks_free),
            ("axcore_prefix_cache_hit_rate", "Prompt blocks found in the prefix cache / blocks looked up "
             "(0 before any lookup)", s.prefix_cache_hits / s.prefix_cache_queries if s.prefix_cache_queries else 0.0),
            ("axcore_compiled_programs", "Compiled model programs (shape buckets) so far", s.compiled_programs),
            ("axcore_compiled_programs_cap", "Cap on the compiled programs", s.compiled_programs_cap),
        ]
        for name, doc, value in gauges:
            yield GaugeMetricFamily(name, doc, value=value)
        counters = [
            ("axcore_prompt_tokens", "Prompt tokens computed", s.prompt_tokens),
            ("axcore_generation_tokens", "Tokens generated", s.generation_tokens),
            ("axcore_prefix_cache_queries", "Prompt blocks looked up in the prefix cache", s.prefix_cache_queries),
            ("axcore_prefix_cache_hits", "Prompt blocks found in the prefix cache", s.prefix_cache_hits),
            ("axcore_preemptions", "Sequences preempted (blocks freed, recomputed later)", s.preemptions),
        ]
        for name, doc, value in counters:
            yield CounterMetricFamily(name, doc, value=value)


class ServerMetrics:
    """The registry behind `/metrics`: the engine's collector, the latency histograms, the server's queue."""

    def __init__(self, engine: EngineClient):
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(EngineCollector(engine))
        self.ttft = Histogram("axcore_time_to_first_token_seconds", "From a request's arrival to its first token",
                              buckets=TTFT_BUCKETS, registry=self.registry)
        self.itl = Histogram("axcore_inter_token_latency_seconds", "Between two tokens of one choice",
                             buckets=ITL_BUCKETS, registry=self.registry)
        self.pending = Gauge("axcore_server_pending_requests", "Requests the server accepted that have no "
                             "output yet (the bound of --max-waiting)", registry=self.registry)

    def exposition(self) -> bytes:
        """The current values in Prometheus's text format."""
        return generate_latest(self.registry)


class LatencyClock:
    """Observes one engine request's time to first token and its choices' inter-token latencies."""

    def __init__(self, metrics: ServerMetrics, arrival: float):
        self.metrics, self.arrival = metrics, arrival
        self.first_seen = False
        # Per choice index: (tokens seen, time of the output that brought the last of them).
        self.last: dict[int, tuple[int, float]] = {}

    def observe(self, token_counts: list[int]) -> None:
        """Records an output whose choice `i` now holds `token_counts[i]` tokens."""
        now = time.monotonic()
        if not self.first_seen and any(token_counts):
            self.first_seen = True
            self.metrics.ttft.observe(now - self.arrival)
        for index, count in enumerate(token_counts):
            seen, at = self.last.get(index, (0, now))
            if count > seen:
                if seen:  # Tokens after the choice's first: the wait shared among them.
                    for _ in range(count - seen):
                        self.metrics.itl.observe((now - at) / (count - seen))
                elif count > 1:  # A first output with several tokens: the rest came with no wait between.
                    for _ in range(count - 1):
                        self.metrics.itl.observe(0.0)
                self.last[index] = (count, now)
