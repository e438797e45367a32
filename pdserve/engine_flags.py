"""The engine's command-line flags (vLLM's names), shared by the worker, `chat` and
`tune-kernels` subcommands, and their EngineConfig."""

from __future__ import annotations

import argparse


def add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        default="smollm2-135m",
        help="model folder, Hugging Face Hub id (owner/name: fetched into the Hub cache; "
        "HF_TOKEN for gated repos, HF_HUB_OFFLINE=1 to use the cache only) or alias "
        "(default: the bundled SmolLM2-135M-Instruct)",
    )
    p.add_argument(
        "--revision",
        default=None,
        help="Hub id only: the branch, tag or commit to load (default: main)",
    )
    p.add_argument(
        "--download-dir",
        default=None,
        help="Hub id only: the cache folder to fetch into and load from (default: "
        "the Hugging Face cache, HF_HOME / HF_HUB_CACHE)",
    )
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    p.add_argument("--dtype", default="auto", help="auto, float32, bfloat16, float16")
    p.add_argument(
        "--kv-cache-dtype",
        default="auto",
        help="auto (the model's dtype) or fp8_e4m3 (alias fp8): KV stored as float8_e4m3fn "
        "with per-layer scales (the checkpoint's k_scale / v_scale, else 1.0): half the KV "
        "memory and transfer bytes of bf16; prefill and decode workers must agree",
    )
    p.add_argument(
        "--load-format",
        default="auto",
        help="auto or safetensors (the folder's *.safetensors), or dummy (random weights)",
    )
    p.add_argument(
        "--quantization",
        default=None,
        choices=["fp8"],
        help="fp8: quantize an unquantized checkpoint's linear layers to FP8 at load "
        "(per-channel weights, dynamic per-token activations). FP8 checkpoints (block-wise "
        "fp8, compressed-tensors FP8_DYNAMIC) load as FP8 without it",
    )
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-kv-blocks", type=int, default=None)
    p.add_argument(
        "--kv-cache-memory-gb",
        type=float,
        default=None,
        help="KV cache size in GiB (default: 1 on CPU; on GPU 90%% of the memory left "
        "after the weights, less 2 GiB)",
    )
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=4096)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument(
        "--kernel-backend",
        default="auto",
        help="auto (torch on CPU, tuned on GPU), torch, triton, aiter or tuned (per op, "
        "the candidate measured fastest on this GPU; see pdserve tune-kernels)",
    )
    p.add_argument(
        "--kernel-choices",
        default=None,
        help="tuned backend: override its picks, e.g. "
        "'paged_attention.prefill=sdpa,rms_norm=triton' (op[.class]=candidate,...)",
    )
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs for decode steps")
    p.add_argument(
        "--max-cudagraph-capture-size",
        type=int,
        default=None,
        help="largest decode batch run as a CUDA graph (vLLM's name); larger batches run "
        "eager (default 256)",
    )
    p.add_argument(
        "--max-cudagraph-mixed-tokens",
        type=int,
        default=None,
        help="steps mixing prefill chunks and decode rows run as CUDA graphs up to this "
        "many tokens (default: 2 x --max-num-seqs, at least 512; 0: eager)",
    )
    p.add_argument(
        "--scheduling-policy",
        choices=("fcfs", "priority"),
        default="fcfs",
        help="fcfs: first come, first served; priority: by each request's 'priority' "
        "(lower first; ties by arrival), preempting the last in that order when memory "
        "runs short. Set the same on prefill and decode workers",
    )
    p.add_argument(
        "--tensor-parallel-size",
        "-tp",
        type=int,
        default=1,
        help="ranks that split the model (one process and device each: cuda:N.. from "
        "--device; gloo between processes on CPU)",
    )
    p.add_argument(
        "--no-async-scheduling",
        action="store_true",
        help="GPU: wait for each decode step's tokens before launching the next "
        "(by default decode steps are launched one step ahead unless a request needs "
        "logprobs, penalties or min_tokens masking)",
    )


def engine_config_from_args(args, role: str):
    from services.engine import EngineConfig

    return EngineConfig(
        model=args.model,
        revision=args.revision,
        download_dir=args.download_dir,
        role=role,
        device=args.device,
        dtype=args.dtype,
        kv_cache_dtype=args.kv_cache_dtype,
        load_format=args.load_format,
        quantization=args.quantization,
        block_size=args.block_size,
        num_kv_blocks=args.num_kv_blocks,
        kv_cache_memory_gb=args.kv_cache_memory_gb,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        enable_prefix_caching=not args.no_prefix_caching,
        kernel_backend=args.kernel_backend,
        kernel_choices=args.kernel_choices,
        enforce_eager=args.enforce_eager,
        **(
            {}
            if args.max_cudagraph_capture_size is None
            else {"cuda_graph_max_batch": args.max_cudagraph_capture_size}
        ),
        **(
            {}
            if args.max_cudagraph_mixed_tokens is None
            else {"cuda_graph_mixed_max_tokens": args.max_cudagraph_mixed_tokens}
        ),
        async_scheduling=False if args.no_async_scheduling else None,
        tensor_parallel_size=args.tensor_parallel_size,
        scheduling_policy=args.scheduling_policy,
    )
