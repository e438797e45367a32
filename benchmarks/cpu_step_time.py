"""Engine decode-step time on this CPU, per step rather than end to end: the minimum
and percentiles of many steps are far steadier on a shared machine than tokens per
second against transformers (benchmarks/engine_vs_transformers.py), so small changes
to the CPU path can be compared by running this before and after, alternately.

    .venv/bin/python benchmarks/cpu_step_time.py [--batch 1 16] [--steps 150]
    .venv/bin/python benchmarks/cpu_step_time.py --without-linears   # diagnostic

--without-linears replaces every linear layer's product by a zero tensor of its
output shape (the outputs are garbage): what is left is the step's cost besides the
weight products (attention, norms, rotary, sampling, scheduling, Python).
"""

from __future__ import annotations

import argparse
import time

import torch


def step_times(engine, prompt_ids, batch: int, steps: int) -> list[float]:
    from services.engine import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"step-{time.monotonic_ns()}-{i}", prompt_ids, params)
    engine.step()  # the prefill
    times = []
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    return sorted(times)


def without_linears(backend) -> None:
    zeros: dict[tuple[int, int], torch.Tensor] = {}

    def linear(x, layer):
        shape = (x.shape[0], layer.weight.shape[0])
        if shape not in zeros:
            zeros[shape] = torch.zeros(shape, dtype=x.dtype)
        return zeros[shape]

    backend.linear = linear


def main() -> None:
    from services.engine import LLM
    from services.kernels.cpu_info import cpu_model
    from services.models.default_model import default_model_dir

    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None, help="default: the bundled model")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--kernel-backend", default="auto")
    ap.add_argument("--kernel-choices", default=None)
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    ap.add_argument("--without-linears", action="store_true")
    args = ap.parse_args()
    llm = LLM(
        args.model or str(default_model_dir()),
        dtype=args.dtype,
        kernel_backend=args.kernel_backend,
        kernel_choices=args.kernel_choices,
    )
    engine = llm.engine
    if args.without_linears:
        without_linears(engine.runner.ops)
    prompt = llm.tokenizer.encode(
        "Write a detailed story about a lighthouse keeper who finds a message in a bottle."
    )
    ops = engine.runner.ops
    choices = getattr(ops, "choices", None)
    print(f"CPU: {cpu_model()}, torch threads {torch.get_num_threads()}, {args.dtype}, {ops.name}")
    if choices:
        print("choices:", {k: v for k, v in sorted(choices.items()) if k.startswith("linear.")})
    step_times(engine, prompt, 1, 10)  # warm-up
    print("| batch | steps | min | p20 | p50 |")
    print("|---|---|---|---|---|")
    for batch in args.batch:
        t = step_times(engine, prompt, batch, args.steps)
        p20, p50 = (t[int(q * len(t))] * 1e3 for q in (0.2, 0.5))
        print(f"| {batch} | {len(t)} | {t[0] * 1e3:.2f} ms | {p20:.2f} ms | {p50:.2f} ms |")


if __name__ == "__main__":
    main()
