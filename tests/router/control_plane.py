"""A control-plane-only gRPC server for registry tests: grpc.health.v1, GetLoad and
AddPrefillPeer. It has no Generate: it never stands in for a worker's generation (the
integration tests use real workers for that); it lets the tests drive health states,
pairing answers and a worker disappearing."""

from __future__ import annotations

import asyncio

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from pdpb.v1 import common_pb2, decode_pb2, decode_pb2_grpc, prefill_pb2_grpc

_ROLES = {"prefill": common_pb2.ROLE_PREFILL, "decode": common_pb2.ROLE_DECODE}


class _Load:
    def __init__(self, cp: ControlPlane):
        self.cp = cp

    async def GetLoad(self, request, context):
        if self.cp.slow_loads > 0:  # a busy worker: answers after the probe's deadline
            self.cp.slow_loads -= 1
            await asyncio.sleep(self.cp.slow_load_s)
        self.cp.load_calls += 1
        return common_pb2.LoadReport(
            role=_ROLES[self.cp.reported_role],
            model=self.cp.model,
            max_model_len=self.cp.max_model_len,
            num_free_blocks=90,
            num_total_blocks=100,
        )


class _Decode(_Load, decode_pb2_grpc.DecodeServiceServicer):
    async def AddPrefillPeer(self, request, context):
        self.cp.peer_calls.append(request.prefill_address)
        if request.prefill_address in self.cp.incompatible:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION, "KV layout mismatch: block_size 16 vs 32"
            )
        return decode_pb2.AddPrefillPeerResponse(session_id="s")


class _Prefill(_Load, prefill_pb2_grpc.PrefillServiceServicer):
    pass


class ControlPlane:
    def __init__(self, role: str, model: str = "m", max_model_len: int = 128):
        self.role = role
        self.reported_role = role
        self.model = model
        self.max_model_len = max_model_len
        self.incompatible: set[str] = set()
        self.peer_calls: list[str] = []
        self.slow_loads = 0  # the next this many GetLoad calls answer after slow_load_s
        self.slow_load_s = 0.0
        self.load_calls = 0  # answered in time or not
        self.port = 0
        self.server: grpc.aio.Server | None = None
        self.health: health.aio.HealthServicer | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def start(self, serving: bool = True) -> ControlPlane:
        self.server = grpc.aio.server()
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        if self.role == "decode":
            decode_pb2_grpc.add_DecodeServiceServicer_to_server(_Decode(self), self.server)
        else:
            prefill_pb2_grpc.add_PrefillServiceServicer_to_server(_Prefill(self), self.server)
        self.port = self.server.add_insecure_port(f"127.0.0.1:{self.port}")
        await self.set_serving(serving)
        await self.server.start()
        return self

    async def set_serving(self, serving: bool) -> None:
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if serving
            else (health_pb2.HealthCheckResponse.NOT_SERVING)
        )
        await self.health.set("", status)

    async def stop(self) -> None:
        await self.server.stop(None)
