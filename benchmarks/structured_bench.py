"""What a structured output's token mask costs on the decode step.

N concurrent requests decode on the engine (LLMEngine, no servers), once unconstrained
and once each under a JSON schema (xgrammar); the decode step times are compared, and
the grammar's own work is timed apart:
- fill: the matcher computing the allowed next tokens (GrammarState.next_bitmask, on
  the host, once per request per step);
- apply: the sampler forbidding the other tokens in the logits (sampler._apply_grammar,
  once per step for the whole batch; on a GPU it is synchronized to be timed);
- accept: the matcher advancing with the sampled token (GrammarState.accept);
and the whole sampler call (Sampler.__call__, apply included) of both runs.
The rest of the difference is the sampler's general path, which constrained rows take
(fp32 logits, masks, no async scheduling).

--mask torch applies the mask with torch ops instead of xgrammar's CPU kernel (what the
sampler did on the CPU before, and still does on a GPU), to compare the two. Each
figure is given as min/median over every measured step (or call) of --repeats runs: on a
shared host other processes' load only ever adds, so the minimum is the quiet
machine's cost. --threads 1 keeps torch off a second core
that another process holds (its two-thread ops then wait on each other).

The schema asks for a long list of records (enum, bounded integer and number, bounded
string, a small array), long enough that no request ends inside the measured steps;
prompts differ, so the rows sit in different grammar states.

    .venv/bin/python benchmarks/structured_bench.py --batch 1 8 32 --steps 32
    python benchmarks/structured_bench.py --device cuda --batch 1 8 32 128
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

RECORD = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "score": {"type": "number", "minimum": 0, "maximum": 10},
        "color": {"enum": ["red", "green", "blue", "yellow"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
    },
    "required": ["name", "age", "score", "color", "tags"],
    "additionalProperties": False,
}
SCHEMA = {
    "type": "object",
    "properties": {"people": {"type": "array", "items": RECORD, "minItems": 64}},
    "required": ["people"],
    "additionalProperties": False,
}
TOPICS = ["a school class", "a football team", "a book club", "an office", "a choir"]


class Timers:
    """Wraps the grammar's three steps with wall-clock timers: each call's seconds."""

    KEYS = ("fill", "apply", "accept", "sampler")

    def __init__(self, sync):
        self.sync = sync
        self.calls: dict[str, list[float]] = {k: [] for k in self.KEYS}
        self.on = False

    def wrap(self, owner, attr: str, key: str, sync: bool = False) -> None:
        inner = getattr(owner, attr)

        def timed(*args, **kw):
            if not self.on:
                return inner(*args, **kw)
            t = time.perf_counter()
            out = inner(*args, **kw)
            if sync:
                self.sync()
            self.calls[key].append(time.perf_counter() - t)
            return out

        setattr(owner, attr, timed)


def torch_mask(logits, requests, rows):
    """The sampler's _apply_grammar with torch ops on every device."""
    from services.engine.sampler import _mask_with_torch

    words = torch.stack([requests[i].grammar_bitmask for i in rows]).to(logits.device)
    out = logits.clone()
    width = min(words.shape[1] * 32, out.shape[1])
    _mask_with_torch(out, words, rows, width)
    out[rows, width:] = float("-inf")
    return out


def decode_steps(engine, n: int, steps: int, constrained: bool, timers: Timers) -> list[float]:
    """Per-step seconds of `steps` decode steps of n requests (after their prefill)."""
    from services.engine import SamplingParams, StructuredOutput, apply_chat_template

    so = StructuredOutput("json", SCHEMA) if constrained else None
    ids = []
    for i in range(n):
        ask = f"List the people of {TOPICS[i % len(TOPICS)]} number {i} as JSON."
        prompt = apply_chat_template(engine.tokenizer, [{"role": "user", "content": ask}])
        params = SamplingParams(
            temperature=0, max_tokens=steps + 8, ignore_eos=True, structured_output=so
        )
        ids.append(f"{'c' if constrained else 'u'}{n}-{i}")
        engine.add_request(ids[-1], prompt, params)
    while any(engine.get_sequence(r).num_output_tokens == 0 for r in ids):
        engine.step()  # prefill (and a first decode step or two for early rows)
    engine.step()  # warm: an async pipeline is full from here on
    times = []
    timers.on = True
    for _ in range(steps):
        t = time.perf_counter()
        outs = engine.step()
        timers.sync()
        times.append(time.perf_counter() - t)
        assert not any(o.finished for o in outs), "a request ended inside the measurement"
    timers.on = False
    for r in ids:
        engine.abort_request(r)
    while engine.has_unfinished_requests():
        engine.step()
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="default: SmolLM2-135M (converted once)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=2, help="runs per point")
    ap.add_argument("--mask", choices=["auto", "torch"], default="auto")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    from services.engine import EngineConfig, LLMEngine, StructuredOutput
    from services.engine import sampler as sampler_mod
    from services.engine.structured import GrammarState

    model = args.model
    if model is None:
        from services.models.default_model import default_model_dir

        model = str(default_model_dir())
    engine = LLMEngine(EngineConfig(model=model, device=args.device))
    cuda = args.device.startswith("cuda")
    timers = Timers(torch.cuda.synchronize if cuda else (lambda: None))
    timers.wrap(GrammarState, "next_bitmask", "fill")
    timers.wrap(GrammarState, "accept", "accept")
    if args.mask == "torch":
        sampler_mod._apply_grammar = torch_mask
    timers.wrap(sampler_mod, "_apply_grammar", "apply", sync=cuda)
    timers.wrap(sampler_mod.Sampler, "__call__", "sampler", sync=cuda)
    engine.grammars.compile(StructuredOutput("json", SCHEMA))  # compile outside the timing

    rows = []
    print(
        f"{'N':>4} {'free ms/step':>13} {'json ms/step':>13} {'overhead ms':>12} "
        f"{'fill us/tok':>11} {'apply us/tok':>12} {'accept us/tok':>13} {'mask us/tok':>11} "
        f"{'sampler ms free/json (min)':>26}"
    )
    for n in args.batch:
        decode_steps(engine, n, 4, False, timers)  # first sight of batch n (kernel tuning)
        for calls in timers.calls.values():
            calls.clear()
        free = [
            t
            for _ in range(args.repeats)
            for t in decode_steps(engine, n, args.steps, False, timers)
        ]
        free_sampler = timers.calls["sampler"][:]
        for calls in timers.calls.values():
            calls.clear()
        json_ = [
            t
            for _ in range(args.repeats)
            for t in decode_steps(engine, n, args.steps, True, timers)
        ]
        # per request per token: fill and accept run per row, apply once per step
        per_token = {
            "fill": [t * 1e6 for t in timers.calls["fill"]],
            "apply": [t * 1e6 / n for t in timers.calls["apply"]],
            "accept": [t * 1e6 for t in timers.calls["accept"]],
        }
        row = {"n": n}
        for stat, f in (("min", min), ("median", statistics.median)):
            row[stat] = {
                "free_ms": f(free) * 1e3,
                "json_ms": f(json_) * 1e3,
                "free_sampler_ms": f(free_sampler) * 1e3,
                "json_sampler_ms": f(timers.calls["sampler"]) * 1e3,
                **{f"{k}_us": f(v) for k, v in per_token.items()},
            }
            r = row[stat]
            r["overhead_ms"] = r["json_ms"] - r["free_ms"]
            r["mask_us"] = r["fill_us"] + r["apply_us"]
        rows.append(row)
        lo, med = row["min"], row["median"]

        def both(key: str, fmt: str, lo=lo, med=med) -> str:
            return f"{lo[key]:{fmt}}/{med[key]:{fmt}}"

        print(
            f"{n:>4} {both('free_ms', '.1f'):>13} {both('json_ms', '.1f'):>13} "
            f"{both('overhead_ms', '.1f'):>12} {both('fill_us', '.0f'):>11} "
            f"{both('apply_us', '.0f'):>12} {both('accept_us', '.0f'):>13} "
            f"{both('mask_us', '.0f'):>11} "
            f"{lo['free_sampler_ms']:>17.2f}/{lo['json_sampler_ms']:.2f}"
        )
    print("(each cell: min/median over every measured step or call)")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({**vars(args), "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
