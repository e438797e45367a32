"""Prometheus metrics of one worker, on a registry the worker owns (no globals).

Besides the pdserve_ metrics, the engine-side gauges of vLLM's names
(vllm:num_requests_running, vllm:num_requests_waiting, vllm:kv_cache_usage_perc,
labelled model_name) are exported here, so dashboards and autoscaling rules written
for vLLM read the workers unchanged. The per-request ones (tokens, latencies,
request_success) are the router's: it sees each request once, where a disaggregated
request passes through two workers."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from pdpb.heap import PAUSE_BUCKETS


class WorkerMetrics:
    def __init__(self, role: str, model_name: str = ""):
        self.registry = CollectorRegistry()
        labels = {"role": role}
        vllm = {"labelnames": ["model_name"], "registry": self.registry}
        self.vllm_running = Gauge(
            "vllm:num_requests_running", "Requests running on the engine", **vllm
        ).labels(model_name)
        self.vllm_waiting = Gauge(
            "vllm:num_requests_waiting", "Requests waiting to be scheduled", **vllm
        ).labels(model_name)
        self.vllm_kv_usage = Gauge(
            "vllm:kv_cache_usage_perc", "KV-cache usage, 1 = all blocks in use", **vllm
        ).labels(model_name)
        self.requests = Counter(
            "pdserve_worker_requests", "Requests by outcome", ["outcome"], registry=self.registry
        )
        self.kv_transfers = Counter(
            "pdserve_kv_transfers", "KV transfers by outcome", ["outcome"], registry=self.registry
        )
        self.kv_transfer_bytes = Counter(
            "pdserve_kv_transfer_bytes", "KV bytes transferred", registry=self.registry
        )
        self.kv_transfer_seconds = Histogram(
            "pdserve_kv_transfer_seconds", "KV transfer time", registry=self.registry
        )
        self.prefill_fallbacks = Counter(
            "pdserve_prefill_fallbacks",
            "Remote prefills that failed, by policy applied",
            ["policy"],
            registry=self.registry,
        )
        self.unconfirmed_aborts = Counter(
            "pdserve_unconfirmed_aborts",
            "Aborts of a remote prefill that the live prefill worker did not confirm in time "
            "(its blocks were reused while a write could still land)",
            registry=self.registry,
        )
        self.merged_responses = Counter(
            "pdserve_merged_responses",
            "Responses merged into one not yet written because the reader (the router) was "
            "behind the engine; steadily rising: the router is the bottleneck",
            registry=self.registry,
        )
        self.detokenizer_fallbacks = Counter(
            "pdserve_detokenizer_fallbacks",
            "Requests whose Rust incremental detokenizer (DecodeStream) failed and that "
            "went on detokenizing in Python (same text, slower)",
            registry=self.registry,
        )
        self._detokenizer_fallbacks_seen = 0
        self.running = Gauge(
            "pdserve_running_requests", "Running sequences", registry=self.registry
        )
        self.waiting = Gauge(
            "pdserve_waiting_requests", "Waiting sequences", registry=self.registry
        )
        self.free_blocks = Gauge("pdserve_free_kv_blocks", "Free KV blocks", registry=self.registry)
        self.total_blocks = Gauge("pdserve_total_kv_blocks", "KV blocks", registry=self.registry)
        self.orphaned_blocks = Gauge(
            "pdserve_orphaned_kv_blocks",
            "KV blocks held beyond what the worker's known requests hold (a leak; must be 0)",
            registry=self.registry,
        )
        self.oldest_reservation = Gauge(
            "pdserve_oldest_kv_reservation_seconds",
            "Age of the oldest KV reservation (blocks awaiting or sending a transfer)",
            registry=self.registry,
        )
        self.info = Gauge(
            "pdserve_worker_info", "Worker role", list(labels), registry=self.registry
        )
        self.info.labels(**labels).set(1)
        self.gc_pauses = Histogram(
            "pdserve_gc_pause_seconds",
            "Pauses of Python's cyclic garbage collector in this process, by generation",
            ["generation"],
            buckets=PAUSE_BUCKETS,
            registry=self.registry,
        )
        self.engine_gc_pauses = Histogram(
            "pdserve_engine_gc_pause_seconds",
            "Pauses of Python's cyclic garbage collector in the worker's engine process "
            "(--engine-process), by generation: each one stops the engine's steps",
            ["generation"],
            buckets=PAUSE_BUCKETS,
            registry=self.registry,
        )
        self.num_prefill_fallbacks = 0

    def observe_gc_pause(self, generation: int, seconds: float) -> None:
        self.gc_pauses.labels(str(generation)).observe(seconds)

    def observe_engine_gc_pause(self, generation: int, seconds: float) -> None:
        self.engine_gc_pauses.labels(str(generation)).observe(seconds)

    def count_fallback(self, policy: str) -> None:
        self.prefill_fallbacks.labels(policy).inc()
        self.num_prefill_fallbacks += 1

    def count_unconfirmed_abort(self) -> None:
        self.unconfirmed_aborts.inc()

    def update_load(self, stats: dict) -> None:
        self.running.set(stats["num_running"])
        self.waiting.set(stats["num_waiting"])
        self.free_blocks.set(stats["num_free_blocks"])
        self.total_blocks.set(stats["num_total_blocks"])
        if "orphaned_kv_blocks" in stats:
            self.orphaned_blocks.set(stats["orphaned_kv_blocks"])
            self.oldest_reservation.set(stats["oldest_kv_reservation_seconds"])
        fallbacks = stats.get("detokenizer_fallbacks", 0)  # the engine's running total
        if fallbacks > self._detokenizer_fallbacks_seen:
            self.detokenizer_fallbacks.inc(fallbacks - self._detokenizer_fallbacks_seen)
            self._detokenizer_fallbacks_seen = fallbacks
        self.vllm_running.set(stats["num_running"])
        self.vllm_waiting.set(stats["num_waiting"])
        total = stats["num_total_blocks"]
        # free blocks include prefix-cached ones that can be evicted, as vLLM counts them
        self.vllm_kv_usage.set(1.0 - stats["num_free_blocks"] / total if total else 0.0)

    def serve(self, host: str, port: int):
        """Start the /metrics HTTP endpoint; returns (server, thread)."""
        return start_http_server(port, addr=host, registry=self.registry)
