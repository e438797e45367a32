"""`pdserve prefill`: a prefill worker process."""

from __future__ import annotations

import asyncio

from pdpb.v1 import prefill_pb2_grpc
from services.common.server import serve
from services.prefill.service import PrefillServicer


def run(engine_config, settings) -> None:
    def add(server, ctx):
        prefill_pb2_grpc.add_PrefillServiceServicer_to_server(PrefillServicer(ctx), server)
        return ["pdpb.v1.PrefillService"]

    asyncio.run(serve("prefill", engine_config, settings, add))
