"""The server's Prometheus metrics (GET /metrics, text exposition format).

    kiln_requests_total{endpoint, status}      requests answered, by HTTP status
    kiln_prompt_tokens_total                    prompt tokens of finished requests
    kiln_generation_tokens_total                generated tokens of finished requests
    kiln_time_to_first_token_seconds            request arrival to its first text piece
    kiln_inter_token_latency_seconds            between consecutive text pieces of a request
    kiln_request_duration_seconds               request arrival to its last piece
    kiln_queue_depth                            requests waiting for a KV slot
    kiln_kv_slots_in_use / kiln_kv_slots_total  the engine's KV rows busy / compiled
    kiln_kv_blocks_in_use / kiln_kv_blocks_free  a paged cache's blocks holding requests / free
    kiln_kv_preemptions_total                   requests preempted when the block pool ran out

Each app owns its registry, so several servers (tests) in one process do not collide. Latencies
are measured per streamed text piece, which is one token except where a character spans tokens.
"""

from __future__ import annotations

import time

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
)


class ServerMetrics:
    """The metric objects, and the live gauges read from the engine at scrape time."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self, engine=None):
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("kiln_requests", "Requests answered", ["endpoint", "status"], registry=r)
        self.prompt_tokens = Counter("kiln_prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.generation_tokens = Counter("kiln_generation_tokens", "Generated tokens of finished requests", registry=r)
        self.ttft = Histogram(
            "kiln_time_to_first_token_seconds", "Arrival to first text piece", buckets=LATENCY_BUCKETS, registry=r
        )
        self.inter_token = Histogram(
            "kiln_inter_token_latency_seconds", "Between consecutive text pieces", buckets=LATENCY_BUCKETS, registry=r
        )
        self.duration = Histogram(
            "kiln_request_duration_seconds", "Arrival to last text piece", buckets=LATENCY_BUCKETS, registry=r
        )
        if engine is not None:
            Gauge("kiln_queue_depth", "Requests waiting for a KV slot", registry=r).set_function(
                lambda: engine.queue_depth
            )
            Gauge("kiln_kv_slots_in_use", "KV cache rows holding a request", registry=r).set_function(
                lambda: engine.slots_in_use
            )
            Gauge("kiln_kv_slots_total", "KV cache rows compiled (max_batch)", registry=r).set(engine.max_batch)
            if getattr(engine, "paged", None):
                self._block_gauges(engine)

    def _block_gauges(self, engine) -> None:
        """A paged KV cache's blocks (runtime/kv_blocks.py) and the preemptions it caused."""
        r = self.registry
        Gauge("kiln_kv_blocks_in_use", "Paged KV blocks holding a request", registry=r).set_function(
            lambda: engine.blocks_in_use
        )
        Gauge("kiln_kv_blocks_free", "Paged KV blocks free (cached prefixes among them)", registry=r).set_function(
            lambda: engine.blocks_free
        )
        Gauge("kiln_kv_preemptions_total", "Requests preempted when the block pool ran out", registry=r).set_function(
            lambda: engine.preemptions
        )

    def exposition(self) -> bytes:
        return generate_latest(self.registry)

    def timer(self) -> RequestTimer:
        """Latency bookkeeping for one request, started now."""
        return RequestTimer(self)


class RequestTimer:
    """Observes one request's TTFT, gaps between pieces, and token counts."""

    def __init__(self, metrics: ServerMetrics):
        self.metrics = metrics
        self.started = time.perf_counter()
        self.last: float | None = None

    def piece(self) -> None:
        now = time.perf_counter()
        if self.last is None:
            self.metrics.ttft.observe(now - self.started)
        else:
            self.metrics.inter_token.observe(now - self.last)
        self.last = now

    def finished(self, prompt_tokens: int, generated_tokens: int) -> None:
        self.metrics.prompt_tokens.inc(prompt_tokens)
        self.metrics.generation_tokens.inc(generated_tokens)
        self.metrics.duration.observe((self.last or time.perf_counter()) - self.started)
