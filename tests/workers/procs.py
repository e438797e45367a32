"""Start real worker processes on loopback and talk to them."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdpb.v1 import common_pb2, decode_pb2_grpc, prefill_pb2_grpc

# `python -m pdserve` rather than the console script: also works from a plain
# checkout on PYTHONPATH (the GPU machines run the tests that way).
PDSERVE = [sys.executable, "-m", "pdserve"]


@dataclass
class Worker:
    role: str
    proc: subprocess.Popen
    address: str = ""
    log: list[str] = field(default_factory=list)
    # a TLS worker: how the test talks to it (grpc.ssl_channel_credentials, and the
    # grpc.ssl_target_name_override option when needed)
    credentials: grpc.ChannelCredentials | None = None
    channel_options: tuple = ()

    def channel(self) -> grpc.Channel:
        if self.credentials is not None:
            return grpc.secure_channel(self.address, self.credentials, list(self.channel_options))
        return grpc.insecure_channel(self.address)

    def load(self) -> common_pb2.LoadReport:
        with self.channel() as ch:
            stub = (
                prefill_pb2_grpc.PrefillServiceStub(ch)
                if self.role == "prefill"
                else decode_pb2_grpc.DecodeServiceStub(ch)
            )
            return stub.GetLoad(common_pb2.GetLoadRequest(), timeout=10)

    def healthy(self) -> bool:
        try:
            with self.channel() as ch:
                resp = health_pb2_grpc.HealthStub(ch).Check(
                    health_pb2.HealthCheckRequest(service=""), timeout=2
                )
            return resp.status == health_pb2.HealthCheckResponse.SERVING
        except grpc.RpcError:
            return False

    def wait_all_blocks_free(self, timeout: float = 1.0) -> common_pb2.LoadReport:
        deadline = time.monotonic() + timeout
        while True:
            report = self.load()
            if report.num_free_blocks == report.num_total_blocks or time.monotonic() > deadline:
                # leak accounting agrees: nothing held beyond the known requests
                assert report.orphaned_kv_blocks == 0, report
                return report
            time.sleep(0.05)

    def wait_for_log(self, text: str, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if any(text in line for line in self.log):
                return True
            time.sleep(0.02)
        return False

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def start_worker(
    role: str,
    *args: str,
    model: str,
    timeout: float = 120,
    env: dict | None = None,
    warmup: bool = False,
) -> Worker:
    """warmup: run the start-up warm-up (the shipped default). Off here unless a test
    checks it: it adds a few forward passes to every one of the suite's worker starts."""
    cmd = [*PDSERVE, role, "--model", model, "--port", "0", "--num-kv-blocks", "256", *args]
    if not warmup:
        cmd.append("--skip-warmup")
    env = {**os.environ, "GLOG_minloglevel": "2", **(env or {})}
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
    )
    worker = Worker(role, proc)
    ready = threading.Event()

    def pump():
        for line in proc.stdout:
            worker.log.append(line)
            if line.startswith("PDSERVE "):
                event = json.loads(line[len("PDSERVE ") :])
                worker.address = event["address"]
                if event["event"] == "ready":
                    ready.set()

    threading.Thread(target=pump, daemon=True).start()
    if not ready.wait(timeout):
        worker.stop()
        raise RuntimeError(f"{role} worker did not become ready:\n{''.join(worker.log[-30:])}")
    return worker


@contextlib.contextmanager
def worker_pair(model: str, prefill_args=(), decode_args=()):
    """A prefill and a decode worker for the duration of the block; stopped after."""
    workers = []
    try:
        workers.append(start_worker("prefill", *prefill_args, model=model))
        workers.append(start_worker("decode", *decode_args, model=model))
        yield tuple(workers)
    finally:
        for w in workers:
            w.stop()
