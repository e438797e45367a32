"""Prometheus metrics of one router app, in a registry the app owns.

With several API-server processes (--api-server-count) prometheus_client's
multiprocess mode sums them: every process writes its values to files in one
directory (PROMETHEUS_MULTIPROC_DIR, set by the supervisor before this module is
imported), and a scrape of any process reads them all."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.multiprocess import MultiProcessCollector

from pdpb.heap import PAUSE_BUCKETS

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"

_LATENCY = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 320, 640)
_TPOT = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56)


class WorkerCollector:
    """Per-worker gauges read from the registry at scrape time (no stale labels).

    counts=False leaves out this router's in-flight and sent counts: with several
    processes those are RouterMetrics' shared worker_inflight / worker_requests."""

    def __init__(self, workers: Callable[[], Iterable], counts: bool = True):
        self._workers = workers
        self._counts = counts

    def collect(self):
        labels = ["role", "address"]
        healthy = GaugeMetricFamily(
            "pdserve_router_worker_healthy", "1 when the worker passes health checks", labels=labels
        )
        inflight = GaugeMetricFamily(
            "pdserve_router_worker_inflight", "this router's requests on the worker", labels=labels
        )
        sent = CounterMetricFamily(
            "pdserve_router_worker_requests",
            "requests this router sent to the worker",
            labels=labels,
        )
        report = {
            name: GaugeMetricFamily(f"pdserve_router_worker_{name}", doc, labels=labels)
            for name, doc in (
                ("num_running", "running sequences (worker LoadReport)"),
                ("num_waiting", "waiting sequences (worker LoadReport)"),
                ("num_free_blocks", "free KV blocks (worker LoadReport)"),
                ("num_total_blocks", "total KV blocks (worker LoadReport)"),
                ("kv_transfers_ok", "KV transfers completed (worker LoadReport)"),
                ("kv_transfers_failed", "KV transfers failed (worker LoadReport)"),
                ("kv_transfer_bytes", "KV bytes transferred (worker LoadReport)"),
                ("prefill_fallbacks", "remote prefills recomputed locally (worker LoadReport)"),
                ("orphaned_kv_blocks", "KV blocks no known request holds: a leak, must be 0"),
                ("oldest_kv_reservation_seconds", "age of the worker's oldest KV reservation"),
            )
        }
        for w in self._workers():
            values = [w.role, w.address]
            healthy.add_metric(values, 1.0 if w.healthy else 0.0)
            inflight.add_metric(values, w.inflight)
            sent.add_metric(values, w.requests)
            if w.load is not None:
                for name, family in report.items():
                    family.add_metric(values, getattr(w.load, name))
        yield from (healthy, *((inflight, sent) if self._counts else ()), *report.values())


_VLLM_TTFT = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)
_VLLM_ITL = (
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
_VLLM_E2E = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)


class VllmRequestMetrics:
    """The request metrics vLLM's server exports, labelled model_name (the name the
    router answers with). A choice of an n > 1 request counts as a request, as vLLM
    counts its child requests."""

    def __init__(self, registry: CollectorRegistry):
        kw = {"labelnames": ["model_name"], "registry": registry}
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prefill tokens processed", **kw)
        self.generation_tokens = Counter(
            "vllm:generation_tokens", "Generation tokens processed", **kw
        )
        self.ttft = Histogram(
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds",
            buckets=_VLLM_TTFT,
            **kw,
        )
        self.itl = Histogram(
            "vllm:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds",
            buckets=_VLLM_ITL,
            **kw,
        )
        self.e2e = Histogram(
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds",
            buckets=_VLLM_E2E,
            **kw,
        )
        self.success = Counter(
            "vllm:request_success",
            "Count of successfully processed requests",
            labelnames=["model_name", "finished_reason"],
            registry=registry,
        )


class RouterMetrics:
    def __init__(
        self, workers: Callable[[], Iterable] | None = None, multiprocess_dir: str | None = None
    ):
        if multiprocess_dir is not None and os.environ.get(MULTIPROC_ENV) != multiprocess_dir:
            # prometheus_client picks file-backed values when it is imported
            raise ValueError(f"{MULTIPROC_ENV} must be {multiprocess_dir!r} before the import")
        self.registry = CollectorRegistry()
        self.multiprocess_dir = multiprocess_dir
        self._workers = workers
        r = self.registry
        self.requests = Counter(
            "pdserve_router_requests",
            "HTTP requests by endpoint and status code",
            ["endpoint", "status"],
            registry=r,
        )
        self.stream_errors = Counter(
            "pdserve_router_stream_errors",
            "streams ended by an error event after the first token",
            registry=r,
        )
        self.retries = Counter(
            "pdserve_router_retries", "attempts retried on another pair", ["code"], registry=r
        )
        self.inflight = Gauge(
            "pdserve_router_inflight_requests",
            "generation requests in flight",
            registry=r,
            multiprocess_mode="livesum",
        )
        self.ttft = Histogram(
            "pdserve_router_time_to_first_token_seconds",
            "request arrival to first token, per choice",
            buckets=_LATENCY,
            registry=r,
        )
        self.tpot = Histogram(
            "pdserve_router_time_per_output_token_seconds",
            "time per output token after the first, per choice",
            buckets=_TPOT,
            registry=r,
        )
        self.e2e = Histogram(
            "pdserve_router_e2e_request_latency_seconds",
            "request arrival to last token",
            buckets=_LATENCY,
            registry=r,
        )
        self.queue = Histogram(
            "pdserve_router_queue_time_seconds",
            "time of a remote prefill call outside compute and KV transfer: queueing and "
            "gRPC (worker Timings)",
            buckets=_LATENCY,
            registry=r,
        )
        self.prefill = Histogram(
            "pdserve_router_prefill_time_seconds",
            "prefill time on the prefill worker (worker Timings)",
            buckets=_LATENCY,
            registry=r,
        )
        self.kv_transfer = Histogram(
            "pdserve_router_kv_transfer_time_seconds",
            "KV transfer time (worker Timings)",
            buckets=_LATENCY,
            registry=r,
        )
        self.prefill_fallbacks = Counter(
            "pdserve_router_prefill_fallbacks",
            "requests whose remote prefill failed and ran on the decode worker",
            registry=r,
        )
        self.prompt_tokens = Counter(
            "pdserve_router_prompt_tokens", "prompt tokens processed", registry=r
        )
        self.generation_tokens = Counter(
            "pdserve_router_generation_tokens", "tokens generated", registry=r
        )
        # vLLM's per-request metrics under its names and labels, so dashboards and
        # autoscaling rules written for vLLM work; the engine-side gauges
        # (vllm:num_requests_running, ...) are the workers' (services/common/metrics.py).
        self.vllm = VllmRequestMetrics(r)
        self.gc_pauses = Histogram(
            "pdserve_router_gc_pause_seconds",
            "Pauses of Python's cyclic garbage collector in the router, by generation",
            ["generation"],
            buckets=PAUSE_BUCKETS,
            registry=r,
        )
        # per-worker counts summed over processes (one process: WorkerCollector's)
        self.worker_inflight: Gauge | None = None
        self.worker_requests: Counter | None = None
        if multiprocess_dir is not None:
            labels = ["role", "address"]
            self.worker_inflight = Gauge(
                "pdserve_router_worker_inflight",
                "this router's requests on the worker",
                labels,
                registry=r,
                multiprocess_mode="livesum",
            )
            self.worker_requests = Counter(
                "pdserve_router_worker_requests",
                "requests this router sent to the worker",
                labels,
                registry=r,
            )
        elif workers is not None:
            r.register(WorkerCollector(workers))

    def worker_started(self, worker) -> None:
        """A request sent to `worker` (a registry Worker or the local prefill)."""
        worker.inflight += 1
        worker.requests += 1
        if self.worker_inflight is not None and worker.address:
            self.worker_inflight.labels(worker.role, worker.address).inc()
            self.worker_requests.labels(worker.role, worker.address).inc()

    def worker_done(self, worker) -> None:
        """A request sent to `worker` no longer on it."""
        worker.inflight -= 1
        if self.worker_inflight is not None and worker.address:
            self.worker_inflight.labels(worker.role, worker.address).dec()

    def observe_gc_pause(self, generation: int, seconds: float) -> None:
        self.gc_pauses.labels(str(generation)).observe(seconds)

    def observe_timings(self, timings) -> None:
        """A finished choice's worker Timings (pdpb.v1.Timings)."""
        if timings.prefill_seconds:  # a remote prefill ran (colocated: none of these)
            self.queue.observe(timings.queue_seconds)
            self.prefill.observe(timings.prefill_seconds)
        if timings.kv_transfer_seconds:
            self.kv_transfer.observe(timings.kv_transfer_seconds)
        if timings.prefill_fallback:
            self.prefill_fallbacks.inc()

    def render(self) -> bytes:
        if self.multiprocess_dir is None:
            return generate_latest(self.registry)
        every = CollectorRegistry()
        MultiProcessCollector(every, path=self.multiprocess_dir)
        if self._workers is not None:  # worker health and LoadReports: any process's view
            every.register(WorkerCollector(self._workers, counts=False))
        return generate_latest(every)
