"""A remote prefill's first token reaches the request's stream before any decode step's
output, however late the event loop gets back to the request.

The injected fault: the event loop stalls for a while right as the engine thread admits
the request, so the engine decodes several tokens before the request's handler runs
again (a loaded host; CI once saw it). The first token used to be published by the
handler when it resumed, behind those steps' outputs: the stream then rewound and sent
the decoded tokens twice. Real prefill worker process, real Mooncake TCP transfer, the
decode side in this process so its event loop can be stalled."""

from __future__ import annotations

import asyncio
import time

from pdpb.v1 import common_pb2, decode_pb2
from services.decode.mux import Outbox
from services.decode.responses import ResponseBuilder
from tests.engine.helpers import save_random_model
from tests.workers.procs import start_worker

STALL_S = 0.5
MAX_TOKENS = 12


def test_first_token_precedes_the_steps_decoded_while_the_loop_stalls(tmp_path):
    from services.common.server import WorkerContext
    from services.common.settings import WorkerSettings
    from services.decode.remote_prefill import PrefillPeers, RemotePrefill
    from services.engine import LLM, EngineConfig, SamplingParams

    model = str(save_random_model(tmp_path, "llama"))
    prompt = list(range(3, 40))
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    with LLM(model, num_kv_blocks=32) as colocated:
        (ref,) = [o.output.token_ids for o in colocated.generate([prompt], params)]

    prefill = start_worker("prefill", model=model)
    ctx = WorkerContext("decode", EngineConfig(model=model, role="decode"), WorkerSettings(port=0))
    ctx.load()
    ctx.ready.set()
    engine, loop = ctx.engine, ctx.loop
    stalls = []

    def admit_then_stall(*args, **kwargs):
        # on the engine thread: the event loop is made to stall before it can resume
        # the handler; the engine decodes meanwhile
        out = real_admit(*args, **kwargs)
        stalls.append(asyncio_loop.call_soon_threadsafe(time.sleep, STALL_S))
        return out

    real_admit = engine.admit_remote
    engine.admit_remote = admit_then_stall

    async def scenario():
        nonlocal asyncio_loop
        asyncio_loop = asyncio.get_running_loop()
        remote = RemotePrefill(ctx, PrefillPeers(ctx))
        stream = loop.open_stream("r")
        await remote.run(
            "r",
            prompt,
            params,
            common_pb2.SamplingParams(max_tokens=MAX_TOKENS),
            prefill.address,
            "t",
        )
        outputs = [await stream.get()]
        while not outputs[-1].finished:
            outputs.append(await stream.get())
        loop.close_stream("r")
        await remote.peers.close()
        return outputs

    asyncio_loop = None
    try:
        outputs = asyncio.run(scenario())
        assert stalls, "the fault was never injected"
        counts = [o.output.num_token_ids for o in outputs]
        assert counts[0] == 1, f"the first token came after decode steps: {counts}"
        assert counts == sorted(counts), f"the stream went back: {counts}"
        # what the client receives: every token once, in order
        request = decode_pb2.GenerateRequest(request_id="r")
        builder = ResponseBuilder(engine, "r", request, prompt, params)
        streamed = []
        outbox = Outbox()
        for out in outputs:
            builder.fill(out, outbox)
            for message in outbox.take():
                for resp in message.responses:
                    streamed.extend(resp.token_ids)
        assert streamed == ref
        assert engine.stats()["num_free_blocks"] == engine.stats()["num_total_blocks"]
    finally:
        ctx.close()
        prefill.stop()
