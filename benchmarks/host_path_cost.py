"""Host cost per sequence per decode step on each side of the engine-process boundary,
in microseconds, on this CPU, with no GPU and no gRPC: the numbers that bound a decode
worker's steps at hundreds of streams once the GPU step is small (issue 20).

- engine: the engine process's loop (engine_core.py) with a tiny model on the CPU:
  schedule, launch, read the tokens, make the outputs, pickle them for the pipe; minus
  the model's forward and sampling (timed apart and taken out).
- worker: the decode worker's side (engine_client.py, decode/mux.py): unpickle a
  step's deltas, rebuild outputs, detokenize, hand them to their streams, fill each
  request's GenerateStream response, serialize the message.

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
    params = SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True)
    prompt = list(range(10, 18))

    def one_round(n: int) -> float:
        for i in range(n):
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


def worker_cost(model: str, seqs: int, rounds: int) -> float:
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

    async def one_round(tag: int) -> float:
        client = EngineCoreClient(None, None, None)  # its pipe reader's side, no process
        client.use_tokenizer(tokenizer)
        outbox = Outbox()
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
        gc.collect()
        start = time.perf_counter()
        for message in messages:
            client._take(pickle.loads(message))
            await asyncio.sleep(0)  # the event loop delivers the step to its sinks
            for out in outbox.take():
                out.SerializeToString()
        return (time.perf_counter() - start) / (seqs * STEPS) * 1e6

    async def main() -> float:
        await one_round(-1)  # warm
        return min([await one_round(r) for r in range(rounds)])

    return asyncio.run(main())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="a model folder (tiny: see above)")
    ap.add_argument("--seqs", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--side", choices=["engine", "worker", "both"], default="both")
    args = ap.parse_args()
    if args.side in ("engine", "both"):
        us = engine_cost(args.model, args.seqs, args.rounds)
        print(f"engine process: {us:.2f} us per sequence per step ({args.seqs} sequences)")
    if args.side in ("worker", "both"):
        us = worker_cost(args.model, args.seqs, args.rounds)
        print(f"decode worker: {us:.2f} us per output ({args.seqs} streams)")


if __name__ == "__main__":
    main()
