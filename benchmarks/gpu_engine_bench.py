"""Engine speed on one GPU with random weights of a real model shape (no downloads).

Decode: time per step at batch B with ~ctx-token contexts, and model-bandwidth
utilisation (weight bytes + KV bytes read per step / step time / copy bandwidth).
Prefill: N prompts of L tokens, model FLOP rate.

Mixtures of experts count what a step touches: every non-expert weight, and of the
experts' weights the share that at least one of B tokens routes to, estimated for
uniform routing as 1 - (1 - k/E)^B (dummy weights route close to uniformly); prefill
FLOPs count the active parameters (non-expert + k/E of the experts).

    python benchmarks/gpu_engine_bench.py --config benchmarks/configs/llama3-8b.json \\
        --batch 1 8 64 256 --ctx 1024 --kernel-backend triton

FP8 weights: a config with a quantization_config (llama3-8b-fp8.json,
llama3-70b-fp8.json: block-wise 128 x 128, as Qwen3-*-FP8 / DeepSeek-V3 ship) makes the
dummy weights FP8 with random block scales; `--quantization fp8` makes any config's
linears per-channel FP8 (online quantization's format). Weight bytes, and so the floor,
count what is in memory: one byte per FP8 weight, plus scales and the bf16 embeddings
and LM head.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path

import torch


def copy_bandwidth(device) -> float:
    x = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(10):
        y.copy_(x)
    torch.cuda.synchronize()
    return 2 * x.numel() * 10 / (time.perf_counter() - t)  # read + write bytes/s


def profile_decode(engine, steps: int) -> dict:
    """Where a batch-1 decode step goes: graph replay alone vs the whole engine step,
    and the kernels by total GPU time (torch profiler)."""
    out = {}
    g = engine.runner.graph_runner
    if g is not None and 1 in g.graphs:
        from services.kernels.timing import replay_ms

        out["graph_replay_ms"] = replay_ms(g.graphs[1], steps)
        print(f"  graph replay alone: {out['graph_replay_ms']:.3f} ms", flush=True)
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=25)
    print(table, flush=True)
    from services.kernels.triton._launch import PDL_ENV

    if os.environ.get(PDL_ENV, "1") != "0" and torch.version.hip is None:
        # a kernel launched early under PDL is charged for its wait on the one before
        # (an RMSNorm read 15.5 us a call where its own time is 2.2 us)
        print(f"  (kernel times include PDL waits: {PDL_ENV}=0 gives each its own)", flush=True)
    out["kernels"] = table
    return out


def model_dir(config_path: str) -> Path:
    d = Path(tempfile.mkdtemp(prefix="pdserve-dummy-"))
    shutil.copy(config_path, d / "config.json")
    return d


def closed_loop(engine, prompts: list[list[int]], concurrency: int, output_len: int) -> dict:
    """The serving benchmark's workload without the router and gRPC: `concurrency`
    requests in flight, a new prompt added as soon as one finishes, until all are done.
    What the engine alone delivers on the work `serving_bench.py --max-concurrency`
    sends, prefills of the arriving prompts included."""
    from services.engine import SamplingParams

    sp = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    engine.block_manager.reset_prefix_cache()
    added = done = steps = 0
    while added < min(concurrency, len(prompts)):
        engine.add_request(f"loop-{added}", prompts[added], sp)
        added += 1
    torch.cuda.synchronize()
    t = time.perf_counter()
    while done < len(prompts):
        steps += 1
        for out in engine.step():
            if out.finished:
                done += 1
                if added < len(prompts):
                    engine.add_request(f"loop-{added}", prompts[added], sp)
                    added += 1
    torch.cuda.synchronize()
    dt = time.perf_counter() - t
    return {
        "concurrency": concurrency,
        "prompts": len(prompts),
        "seconds": dt,
        "output_tokens_per_s": len(prompts) * output_len / dt,
        "ms_per_step": dt / steps * 1e3,
    }


def main() -> None:
    from services.engine import LLM, SamplingParams

    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="benchmarks/configs/llama3-8b.json")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 64, 256])
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--decode-steps", type=int, default=16)
    ap.add_argument("--prefill-prompts", type=int, default=8)
    ap.add_argument("--prefill-len", type=int, default=2048)
    ap.add_argument("--kernel-backend", default="triton")
    ap.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    ap.add_argument(
        "--quantization",
        default=None,
        choices=["fp8"],
        help="per-channel FP8 linears (as online quantization makes them); FP8 block-wise "
        "weights come from a config with a quantization_config instead",
    )
    ap.add_argument(
        "--kv-cache-dtype", default="auto", help="auto (bf16) or fp8_e4m3: KV bytes halve"
    )
    ap.add_argument("--kernel-choices", default=None, help="tuned backend overrides")
    ap.add_argument(
        "--no-async-scheduling", action="store_true", help="read each step's tokens first"
    )
    ap.add_argument(
        "--profile",
        action="store_true",
        help="at batch 1: time the decode graph replay alone and list the top kernels",
    )
    ap.add_argument(
        "--closed-loop",
        type=int,
        nargs="+",
        default=[],
        metavar="C",
        help="also run serving_bench's workload on the engine alone at these concurrencies: "
        "3 x C prompts of --input-len tokens, --output-len tokens each",
    )
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args()
    # the engine's start-up phases (kernel tuning, weights, graph capture) with their times
    logging.basicConfig(format="%(message)s", level=logging.WARNING)
    logging.getLogger("services.engine.startup").setLevel(logging.INFO)
    max_seqs = max(args.batch + args.closed_loop)

    device = torch.device("cuda")
    bw = copy_bandwidth(device)
    cfg = json.loads(Path(args.config).read_text())
    llm = LLM(
        str(model_dir(args.config)),
        load_format="dummy",
        device="cuda",
        dtype="bfloat16",
        kernel_backend=args.kernel_backend,
        kernel_choices=args.kernel_choices,
        quantization=args.quantization,
        kv_cache_dtype=args.kv_cache_dtype,
        max_num_seqs=max_seqs,
        cuda_graph_max_batch=max_seqs,
        max_num_batched_tokens=max(8192, args.prefill_len),
        enforce_eager=args.enforce_eager,
        async_scheduling=False if args.no_async_scheduling else None,
    )
    engine = llm.engine
    weight_bytes = sum(p.numel() * p.element_size() for p in engine.runner.model.parameters())
    params = sum(p.numel() for p in engine.runner.model.parameters())
    moe = [m for m in engine.runner.model.modules() if hasattr(m, "num_experts")]
    expert_params = sum(m.w13.numel() + m.w2.numel() for m in moe)
    expert_bytes = sum(
        m.w13.numel() * m.w13.element_size() + m.w2.numel() * m.w2.element_size() for m in moe
    )
    fp8_bytes = sum(
        p.numel() for p in engine.runner.model.parameters() if p.dtype == torch.float8_e4m3fn
    )
    quant = cfg.get("quantization_config", {}).get("quant_method") or args.quantization
    route_share = moe[0].top_k / moe[0].num_experts if moe else 1.0
    active_params = params - expert_params + expert_params * route_share

    def touched_bytes(batch: int) -> float:
        return weight_bytes - expert_bytes + expert_bytes * (1 - (1 - route_share) ** batch)

    kv_token_bytes = engine.runner.kv_spec.block_bytes // engine.config.block_size
    results = {
        "copy_bandwidth_GBps": bw / 1e9,
        "weight_GB": weight_bytes / 1e9,
        "active_params_B": active_params / 1e9,
        "kernel_backend": args.kernel_backend,
        "kv_cache_dtype": args.kv_cache_dtype,
        "weights": f"{quant} ({fp8_bytes / 1e9:.2f} GB in FP8)" if quant else "bfloat16",
        "async_scheduling": engine.config.async_scheduling_enabled,
        "decode": [],
        "closed_loop": [],
        "prefill": None,
    }
    print(
        f"copy bandwidth {bw / 1e9:.0f} GB/s, weights {weight_bytes / 1e9:.2f} GB "
        f"({results['weights']}), "
        f"floor {touched_bytes(1) / bw * 1e3:.2f} ms/step at batch 1"
        + (f" (MoE: {len(moe)} layers, {expert_bytes / 1e9:.1f} GB of experts)" if moe else ""),
        flush=True,
    )
    vocab = cfg["vocab_size"]
    gen = torch.Generator().manual_seed(0)

    for b in args.batch:
        prompts = [
            torch.randint(10, vocab - 10, (args.ctx,), generator=gen).tolist() for _ in range(b)
        ]
        # Prompts prefill a few per step (max_num_batched_tokens), and the first ones
        # decode meanwhile: room for those steps, so none finishes before the timing ends.
        prefill_steps = -(-b * args.ctx // engine.config.max_num_batched_tokens) + b
        sp = SamplingParams(
            temperature=0, max_tokens=args.decode_steps + 8 + prefill_steps, ignore_eos=True
        )
        for i, p in enumerate(prompts):
            engine.add_request(f"b{b}-{i}", p, sp)
        while any(
            s.num_computed_tokens < s.num_prompt_tokens or s.num_output_tokens < 2
            for s in engine.scheduler.running + list(engine.scheduler.waiting)
        ):
            engine.step()
        torch.cuda.synchronize()
        t = time.perf_counter()
        running = []
        for _ in range(args.decode_steps):
            engine.step()
            running.append(len(engine.scheduler.running))
        torch.cuda.synchronize()
        step = (time.perf_counter() - t) / args.decode_steps
        short = min(running) < b  # the KV cache holds fewer: the row would overstate
        if args.profile and b == 1 and not short:
            results["profile_b1"] = profile_decode(engine, args.decode_steps)
        for i in range(b):  # the margin above is not needed any more
            engine.abort_request(f"b{b}-{i}")
        while engine.has_unfinished_requests():
            engine.step()
        if short:
            print(
                f"decode batch {b}: only {min(running)}-{max(running)} sequences ran at once "
                f"(KV cache: {engine.block_manager.num_blocks} blocks of "
                f"{engine.config.block_size} tokens); row left out",
                flush=True,
            )
            continue
        kv_bytes = b * (args.ctx + 8) * kv_token_bytes
        mbu = (touched_bytes(b) + kv_bytes) / step / bw
        floor_ms = (touched_bytes(b) + kv_bytes) / bw * 1e3
        row = {
            "batch": b,
            "ms_per_step": step * 1e3,
            "floor_ms": floor_ms,
            "tokens_per_s": b / step,
            "mbu": mbu,
        }
        results["decode"].append(row)
        print(
            f"decode batch {b:4d} ctx {args.ctx}: {step * 1e3:8.2f} ms/step "
            f"{b / step:9.0f} tok/s  MBU {mbu:.2%}  ({step * 1e3 / floor_ms:.2f}x the floor)",
            flush=True,
        )

    for c in args.closed_loop:
        prompts = [
            torch.randint(10, vocab - 10, (args.input_len,), generator=gen).tolist()
            for _ in range(3 * c)
        ]
        closed_loop(engine, prompts[:c], c, args.output_len)  # warm-up: the same shapes
        row = closed_loop(engine, prompts, c, args.output_len)
        results["closed_loop"].append(row)
        print(
            f"closed loop {c:4d} x {args.input_len} -> {args.output_len}: "
            f"{row['output_tokens_per_s']:9.0f} output tok/s, {row['ms_per_step']:.2f} ms/step",
            flush=True,
        )

    n, L = args.prefill_prompts, args.prefill_len
    prompts = [torch.randint(10, vocab - 10, (L,), generator=gen).tolist() for _ in range(n)]
    engine.block_manager.reset_prefix_cache()
    sp = SamplingParams(temperature=0, max_tokens=1)
    llm.generate(prompts[:1], sp)  # warm-up
    engine.block_manager.reset_prefix_cache()
    torch.cuda.synchronize()
    t = time.perf_counter()
    llm.generate(prompts, sp)
    torch.cuda.synchronize()
    dt = time.perf_counter() - t
    layers, heads = cfg["num_hidden_layers"], cfg["num_attention_heads"]
    hd = cfg.get("head_dim") or cfg["hidden_size"] // heads  # Qwen2 / Phi-3 configs have none
    # GEMMs of the active parameters + causal attention
    flops = 2 * active_params * n * L + 2 * 2 * layers * heads * hd * n * L * L / 2
    results["prefill"] = {"prompts": n, "len": L, "seconds": dt, "tflops": flops / dt / 1e12}
    print(f"prefill {n} x {L}: {dt * 1e3:.1f} ms, {flops / dt / 1e12:.0f} TFLOP/s", flush=True)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
