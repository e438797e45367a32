"""Host cost per sequence per decode step on each side of the engine-process boundary,
in microseconds, on this CPU, with no GPU and no gRPC: the numbers that bound a decode
worker's steps at hundreds of streams once the GPU step is small (issue 20).

- engine: the engine process's loop (engine_core.py) with a tiny model on the CPU:
  schedule, launch, read the tokens, make the outputs, pickle them for the pipe; minus
  the model's forward and sampling (timed apart and taken out). The requests' lengths
  differ, so they finish over many steps and out of their batch order.
- worker: the decode worker's side (engine_client.py, decode/mux.py): unpickle a
  step's deltas, rebuild outputs, detokenize, hand them to their streams, fill each
  request's GenerateStream response, serialize the message.
- router reader: the router's side of that stream (router/mux.py): parse the
  worker's messages and hand each request its news (the worker side's messages, so
  `--side worker` runs it too).

    .venv/bin/python benchmarks/dummy_model.py --config benchmarks/configs/tiny-llama.json --out /tmp/tiny
    .venv/bin/python benchmarks/host_path_cost.py --model /tmp/tiny --seqs 512

Each side is run --rounds times and the best round is printed (a shared machine's noise
only adds).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import pickle
import time
from pathlib import Path

STEPS = 96


def engine_cost(model: str, seqs: int, rounds: int) -> float:
    from services.engine import LLM, SamplingParams

    llm = LLM(
        model, load_format="dummy", max_num_seqs=seqs, num_kv_blocks=8192, async_scheduling=True
    )
    engine = llm.engine
    engine.delta_outputs = True  # as in the engine process
    runner = engine.runner
    model_time = [0.0]

    def timed(fn):
        def call(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                model_time[0] += time.perf_counter() - start

        return call

    runner.decode_logits = timed(runner.decode_logits)
    runner.sampler.sample = timed(runner.sampler.sample)
    prompt = list(range(10, 18))

    def one_round(n: int) -> float:
        for i in range(n):
            # lengths from STEPS / 2 to STEPS: requests finish over the second half, out
            # of their batch order, as in serving (not all at once, first to last)
            params = SamplingParams(
                temperature=0, max_tokens=STEPS // 2 + (i * 37) % (STEPS // 2 + 1), ignore_eos=True
            )
            engine.add_request(f"r{time.monotonic_ns()}-{i}", prompt, params)
        # the prefill and the first steps stay out of the timing
        running = engine.scheduler.running
        while engine.scheduler.waiting or (running and running[0].num_output_tokens < 4):
            pickle.dumps(("out", engine.step()))
        model_time[0] = 0.0
        outputs = 0
        start = time.perf_counter()
        while engine.has_unfinished_requests():
            step = engine.step()
            outputs += len(step)
            pickle.dumps(("out", step))
        return (time.perf_counter() - start - model_time[0]) / outputs * 1e6

    gc.freeze()
    one_round(min(seqs, 64))  # warm
    return min(one_round(seqs) for _ in range(rounds))


def worker_cost(model: str, seqs: int, rounds: int, columns: bool) -> tuple[float, list]:
    """The worker side's cost, and the serialized messages of its best round (what a
    router reads)."""
    from pdpb.v1 import decode_pb2
    from services.common.engine_client import EngineCoreClient
    from services.decode.mux import Outbox, OutboxSink
    from services.decode.responses import ResponseBuilder
    from services.engine import SamplingParams
    from services.engine.output_deltas import make_delta
    from services.models.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(Path(model))
    vocab = min(tokenizer.vocab_size, 30000)
    params = SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True)
    prompt = list(range(10, 18))

    async def one_round(tag: int) -> tuple[float, list]:
        client = EngineCoreClient(None, None, None)  # its pipe reader's side, no process
        client.use_tokenizer(tokenizer)
        outbox = Outbox(columns=columns)
        rids = [f"cmpl-{tag}-{i:032x}" for i in range(seqs)]
        for rid in rids:
            builder = ResponseBuilder(None, rid, decode_pb2.GenerateRequest(request_id=rid),
                                      prompt, params)  # fmt: skip
            sink = OutboxSink(builder, outbox)
            sink.start()  # the prompt's KV is in place
            client.open_stream(rid, sink)
            client._expect(rid, params)
        messages = []
        for step in range(STEPS):
            last = step == STEPS - 1
            deltas = [
                make_delta(
                    rid,
                    [100 + (step * 7 + i) % (vocab - 100)],
                    "",
                    None,
                    last,
                    "length" if last else None,
                    None,
                    0,
                    (prompt, None) if step == 0 else None,
                )  # fmt: skip
                for i, rid in enumerate(rids)
            ]
            messages.append(pickle.dumps(("out", deltas)))
        written = []
        gc.collect()
        start = time.perf_counter()
        for message in messages:
            client._take(pickle.loads(message))
            await asyncio.sleep(0)  # the event loop delivers the step to its sinks
            for out in outbox.take():
                written.append(out.SerializeToString())
        return (time.perf_counter() - start) / (seqs * STEPS) * 1e6, written

    async def main() -> tuple[float, list]:
        await one_round(-1)  # warm
        return min([await one_round(r) for r in range(rounds)], key=lambda r: r[0])

    return asyncio.run(main())


def router_cost(messages: list[bytes], seqs: int, rounds: int) -> float:
    """The router's reader of one decode worker's stream (router/mux.py): parse each
    message and hand every request its responses (to a sink, as after its first);
    microseconds per request per step. The messages are the worker side's, read from
    a stand-in call (no gRPC)."""
    from pdpb.v1 import decode_pb2
    from router.mux import DecodeMux

    class Call:  # what stub.GenerateStream returns: the worker's messages, parsed here
        def __init__(self):
            self.elapsed = 0.0

        async def initial_metadata(self):
            return (("x-pdserve-batched-requests", "1"),)  # as the worker's

        def __aiter__(self):
            return self._messages()

        async def _messages(self):
            start = time.perf_counter()
            for data in messages:
                yield decode_pb2.GenerateStreamResponse.FromString(data)
            self.elapsed = time.perf_counter() - start

        def cancel(self):
            pass

    class Stub:
        def GenerateStream(self, requests, metadata=None):  # noqa: N802
            self.call = Call()
            return self.call

    rids = _first_ids(messages)  # each request's first response opens the run

    async def one_round() -> float:
        stub = Stub()
        mux = DecodeMux(stub)
        got = [0]

        def sink(resp):
            got[0] += len(resp.token_ids)

        requests = [mux.open(decode_pb2.GenerateRequest(request_id=rid), 600) for rid in rids]
        for r in requests:
            r.stream_to(sink)
        gc.collect()
        await mux._session.reader
        for r in requests:
            r.cancel()
        if got[0] != seqs * STEPS:
            raise RuntimeError(f"the router read {got[0]} tokens of {seqs * STEPS}")
        return stub.call.elapsed / (seqs * STEPS) * 1e6

    return min(asyncio.run(one_round()) for _ in range(rounds))


def _first_ids(messages: list[bytes]) -> list[str]:
    from pdpb.v1 import decode_pb2

    first = decode_pb2.GenerateStreamResponse.FromString(messages[0])
    return [r.request_id for r in first.responses]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="a model folder (tiny: see above)")
    ap.add_argument("--seqs", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--side", choices=["engine", "worker", "all"], default="all")
    ap.add_argument(
        "--messages",
        choices=["columns", "responses", "both"],
        default="both",
        help="the worker's GenerateStream messages: TokenDeltas columns (what the router "
        "asks for) or a GenerateResponse per request per step",
    )
    args = ap.parse_args()
    if args.side in ("engine", "all"):
        us = engine_cost(args.model, args.seqs, args.rounds)
        print(f"engine process: {us:.2f} us per sequence per step ({args.seqs} sequences)")
    if args.side in ("worker", "all"):
        kinds = ["columns", "responses"] if args.messages == "both" else [args.messages]
        for kind in kinds:
            us, written = worker_cost(args.model, args.seqs, args.rounds, kind == "columns")
            print(f"decode worker, {kind}: {us:.2f} us per output ({args.seqs} streams)")
            us = router_cost(written, args.seqs, args.rounds)
            print(f"router reader, {kind}: {us:.2f} us per output ({args.seqs} streams)")


if __name__ == "__main__":
    main()
