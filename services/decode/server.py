"""`pdserve decode`: a decode worker process (also the colocated worker when no
prefill worker is named in a request)."""

from __future__ import annotations

import asyncio

from pdpb.v1 import decode_pb2_grpc
from services.common.server import serve
from services.decode.service import DecodeServicer


def run(engine_config, settings) -> None:
    def add(server, ctx):
        decode_pb2_grpc.add_DecodeServiceServicer_to_server(DecodeServicer(ctx), server)
        return ["pdpb.v1.DecodeService"]

    asyncio.run(serve("decode", engine_config, settings, add))
