"""The `pdserve` console script: one entry point, one subcommand per process kind."""

from __future__ import annotations

import argparse
import sys


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        default="smollm2-135m",
        help="model folder or alias (default: the bundled SmolLM2-135M-Instruct)",
    )
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    p.add_argument("--dtype", default="auto", help="auto, float32, bfloat16, float16")
    p.add_argument("--load-format", default="auto", help="auto or dummy (random weights)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-kv-blocks", type=int, default=None)
    p.add_argument("--kv-cache-memory-gb", type=float, default=1.0)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=4096)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--no-prefix-caching", action="store_true")


def engine_config_from_args(args, role: str):
    from services.engine import EngineConfig

    return EngineConfig(
        model=args.model,
        role=role,
        device=args.device,
        dtype=args.dtype,
        load_format=args.load_format,
        block_size=args.block_size,
        num_kv_blocks=args.num_kv_blocks,
        kv_cache_memory_gb=args.kv_cache_memory_gb,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        enable_prefix_caching=not args.no_prefix_caching,
    )


def _cmd_chat(args) -> int:
    """Interactive chat with a colocated engine: the simplest way to see it work."""
    from services.engine import LLM, SamplingParams

    llm = LLM(**vars(engine_config_from_args(args, "both")))
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens)
    history: list[dict] = []
    prompts = [args.prompt] if args.prompt else None
    while True:
        if prompts is not None:
            if not prompts:
                return 0
            text = prompts.pop()
        else:
            try:
                text = input("you> ")
            except EOFError:
                return 0
        history.append({"role": "user", "content": text})
        answer = llm.chat(history, params)[0].output.text
        history.append({"role": "assistant", "content": answer})
        print(answer if prompts is not None else f"model> {answer}", flush=True)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    chat = sub.add_parser("chat", help="chat with a colocated engine in this terminal")
    _add_engine_args(chat)
    chat.add_argument("--prompt", help="answer this one message and exit")
    chat.add_argument("--temperature", type=float, default=0.0)
    chat.add_argument("--max-tokens", type=int, default=256)
    chat.set_defaults(func=_cmd_chat)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ValueError as e:
        print(f"pdserve: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
