"""Decode throughput of the pdserve engine vs transformers' generate() on this CPU.

Same model (default SmolLM2-135M), same dtype (fp32), greedy, fixed output length.
Single request and N concurrent requests (transformers: one left-padded batch).

    .venv/bin/python benchmarks/engine_vs_transformers.py --concurrency 1 16
"""

from __future__ import annotations

import argparse
import time

import torch

PROMPT = "Write a detailed story about a lighthouse keeper who finds a message in a bottle."


def bench_pdserve(model_dir, n: int, max_tokens: int) -> float:
    from services.engine import LLM, SamplingParams

    llm = LLM(str(model_dir))
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=4))  # warm-up
    llm.engine.block_manager.reset_prefix_cache()
    prompts = [f"{i}: {PROMPT}" for i in range(n)]
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    return sum(len(o.output.token_ids) for o in outs) / elapsed


@torch.inference_mode()
def bench_transformers(model_dir, n: int, max_tokens: int) -> float:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    prompts = [f"{i}: {PROMPT}" for i in range(n)]
    batch = tok(prompts, return_tensors="pt", padding=True)
    kwargs = dict(
        do_sample=False,
        max_new_tokens=max_tokens,
        min_new_tokens=max_tokens,
        top_k=None,
        top_p=None,
        temperature=None,
        pad_token_id=tok.pad_token_id,
    )
    model.generate(
        **tok(prompts[:1], return_tensors="pt"),
        **{**kwargs, "max_new_tokens": 4, "min_new_tokens": 4},
    )
    start = time.perf_counter()
    out = model.generate(**batch, **kwargs)
    elapsed = time.perf_counter() - start
    return (out.shape[1] - batch["input_ids"].shape[1]) * n / elapsed


def main() -> None:
    from services.models.default_model import default_model_dir

    parser = argparse.ArgumentParser()
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--max-tokens", type=int, default=128)
    args = parser.parse_args()
    model_dir = default_model_dir()
    print(f"torch threads: {torch.get_num_threads()}")
    print("| concurrency | transformers tok/s | pdserve tok/s | speedup |")
    print("|---|---|---|---|")
    for n in args.concurrency:
        hf = bench_transformers(model_dir, n, args.max_tokens)
        ours = bench_pdserve(model_dir, n, args.max_tokens)
        print(f"| {n} | {hf:.1f} | {ours:.1f} | {ours / hf:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
