"""Decode throughput of the pdserve engine vs transformers' generate() on this CPU.

Same model (default SmolLM2-135M), same dtype (fp32 by default, or --dtype bfloat16 for
both), greedy; output tokens per second. pdserve runs its default kernel backend (on a
CPU: `tuned`, which measures the CPU's own candidates first; --kernel-backend overrides).

    .venv/bin/python benchmarks/engine_vs_transformers.py --max-tokens 64 [--dtype bfloat16]

Workloads (N concurrent requests, all submitted at once):
- equal:  N copies of one prompt shape, each exactly --max-tokens new tokens: the best
          case for a static batch.
- varied: prompts of 10..~90 words and outputs of 16..--max-tokens tokens, as real
          traffic has; only each request's own tokens count.
transformers serves N requests two ways: "batched" (one left-padded generate() call that
runs until the longest request is done) and "sequential" (one generate() per request,
what generate() behind a server without a batcher does). pdserve runs them with
continuous batching. Each row runs both sides --repeats times in turns and gives the
medians (and ranges): a single run of either moved by 10-30% on a shared 2-core machine.
"""

from __future__ import annotations

import argparse
import time
from statistics import median

import torch

STORY = (
    "Write a detailed story about a lighthouse keeper who finds a message in a bottle. "
    "The keeper has lived alone on the rock for eleven winters, keeps a careful log of "
    "every ship that passes, and talks to the gulls when the fog rolls in from the sea. "
    "One morning after a storm a green bottle lies wedged between the rocks below the "
    "lamp room, sealed with wax, and inside is a letter addressed to him by name"
)


def workload(kind: str, n: int, max_tokens: int) -> tuple[list[str], list[int]]:
    words = STORY.split()
    if kind == "equal":
        return [f"{i}: {STORY}" for i in range(n)], [max_tokens] * n
    prompts = [f"{i}: " + " ".join(words[: 10 + (i * 37) % (len(words) - 10)]) for i in range(n)]
    lows = 16 if max_tokens > 16 else 1
    outs = [lows + (i * 29) % (max_tokens - lows + 1) for i in range(n)]
    outs[0] = max_tokens  # the batch runs as long as its longest request
    return prompts, outs


def bench_pdserve(llm, prompts: list[str], out_lens: list[int]) -> float:
    from services.engine import SamplingParams

    llm.engine.block_manager.reset_prefix_cache()
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in out_lens]
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    assert [len(o.output.token_ids) for o in outs] == out_lens
    return sum(out_lens) / elapsed


@torch.inference_mode()
def bench_transformers(model, tok, prompts: list[str], out_lens: list[int], mode: str) -> float:
    def generate(texts, new_tokens):
        batch = tok(texts, return_tensors="pt", padding=True)
        model.generate(
            **batch,
            do_sample=False,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            top_k=None,
            top_p=None,
            temperature=None,
            pad_token_id=tok.pad_token_id,
        )

    start = time.perf_counter()
    if mode == "batched":
        generate(prompts, max(out_lens))  # shorter requests are cut from the result
    else:
        for p, m in zip(prompts, out_lens):
            generate([p], m)
    return sum(out_lens) / (time.perf_counter() - start)


def main() -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from services.engine import LLM, SamplingParams
    from services.models.default_model import default_model_dir

    parser = argparse.ArgumentParser()
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--workloads", nargs="+", default=["equal", "varied"])
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--kernel-backend", default="auto")
    parser.add_argument("--kernel-choices", default=None, help="tuned backend overrides")
    parser.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="runs of each side per row, in turns; the table gives medians (and ranges)",
    )
    parser.add_argument(
        "--sequential-repeats",
        type=int,
        default=1,
        help="runs of transformers' slow sequential mode per row (of --repeats)",
    )
    args = parser.parse_args()
    if args.repeats < 1 or not 1 <= args.sequential_repeats <= args.repeats:
        parser.error("--repeats must be >= 1 and --sequential-repeats in [1, --repeats]")
    model_dir = default_model_dir()
    tok = AutoTokenizer.from_pretrained(model_dir, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, args.dtype))
    model.eval()
    start = time.perf_counter()
    llm = LLM(
        str(model_dir),
        dtype=args.dtype,
        kernel_backend=args.kernel_backend,
        kernel_choices=args.kernel_choices,
    )
    ready_s = time.perf_counter() - start
    ops = llm.engine.runner.ops
    # warm-up both (first calls allocate and pick kernels)
    bench_transformers(model, tok, ["warm up"], [4], "batched")
    llm.generate(["warm up"], SamplingParams(temperature=0, max_tokens=4))

    from services.kernels.cpu_info import cpu_model

    print(
        f"CPU: {cpu_model()}, torch threads: {torch.get_num_threads()}, dtype {args.dtype}, "
        f"pdserve backend {ops.name} (engine ready in {ready_s:.1f} s)"
    )
    if getattr(ops, "choices", None):
        linear = {k: v for k, v in ops.choices.items() if k.startswith(("linear", "paged"))}
        print(f"tuned choices: {linear}")
    print(
        "| requests | workload | transformers mode | transformers tok/s | pdserve tok/s | speedup |"
    )
    print("|---|---|---|---|---|---|")
    for n in args.concurrency:
        for kind in args.workloads if n > 1 else ["equal"]:
            prompts, outs = workload(kind, n, args.max_tokens)
            modes = ("batched", "sequential") if n > 1 else ("batched",)
            ours, theirs = [], {mode: [] for mode in modes}
            for _ in range(args.repeats):  # in turns: a shared machine's drift hits both
                ours.append(bench_pdserve(llm, prompts, outs))
                for mode in modes:
                    if mode == "batched" or len(theirs[mode]) < args.sequential_repeats:
                        theirs[mode].append(bench_transformers(model, tok, prompts, outs, mode))
            for mode in modes:
                hf, us = median(theirs[mode]), median(ours)
                print(
                    f"| {n} | {kind} | {mode if n > 1 else 'one call'} | {_spread(theirs[mode])} "
                    f"| {_spread(ours)} | {us / hf:.2f}x |",
                    flush=True,
                )


def _spread(values: list[float]) -> str:
    """The median, and the range when there are several runs."""
    if len(values) == 1:
        return f"{values[0]:.1f}"
    return f"{median(values):.1f} ({min(values):.1f}-{max(values):.1f})"


if __name__ == "__main__":
    main()
