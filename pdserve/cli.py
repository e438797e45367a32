"""The `pdserve` console script: one entry point, one subcommand per process kind.

Only the chosen subcommand imports its package (services, router), lazily."""

from __future__ import annotations

import argparse
import os
import sys

from pdserve.engine_flags import add_engine_args, engine_config_from_args


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


def _add_worker_args(p: argparse.ArgumentParser, role: str) -> None:
    add_engine_args(p)
    p.add_argument("--host", default="127.0.0.1", help="gRPC listen address")
    p.add_argument(
        "--served-model-name",
        default=None,
        help="the model_name label of the worker's vllm:* metrics (default: --model), "
        "as vLLM's flag names its model; the router's own flag names it to clients",
    )
    p.add_argument(
        "--port",
        type=int,
        default=50061 if role == "prefill" else 50071,
        help="gRPC port (0: pick a free one; the chosen one is printed)",
    )
    p.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        help="serve Prometheus /metrics on this port (0: any free port)",
    )
    p.add_argument("--transfer-backend", default="mooncake")
    p.add_argument("--transfer-protocol", default="tcp", help="tcp, rdma or nvlink_intra")
    p.add_argument(
        "--transfer-hostname",
        default="127.0.0.1",
        help="address other workers reach this worker's transfer engine at",
    )
    p.add_argument(
        "--transfer-metadata",
        default="P2PHANDSHAKE",
        help="P2PHANDSHAKE or a metadata server URL (etcd://..., http://...)",
    )
    p.add_argument("--transfer-device", default="", help="RDMA device names, comma-separated")
    p.add_argument(
        "--transfer-write-mode",
        default="auto",
        choices=["auto", "direct", "thread"],
        help="which thread calls the transfer engine for KV writes: the request's own "
        "(direct) or a writer thread per peer that a timed-out call can be abandoned on; "
        "auto: direct for nvlink_intra",
    )
    p.add_argument("--kv-transfer-timeout", type=float, default=30.0)
    p.add_argument(
        "--drain-timeout",
        type=float,
        default=30.0,
        help="on SIGTERM, seconds in-flight requests get before they are aborted",
    )
    p.add_argument(
        "--skip-warmup",
        action="store_true",
        help="report SERVING without the warm-up batches (faster start; the first "
        "request of each batch shape then compiles kernels on the serving path)",
    )
    p.add_argument(
        "--log-level",
        default="info",
        type=str.lower,  # DEBUG or debug: Python's names in either case
        choices=["debug", "info", "warning", "error", "critical"],
        help="pdserve's log level; debug also shows the transfer engine's (Mooncake) "
        "own lines, which otherwise appear only as warnings and errors",
    )
    _add_worker_tls_args(p, role)
    if role == "decode":
        p.add_argument(
            "--prefill-timeout",
            type=float,
            default=60.0,
            help="deadline of a remote prefill (compute + KV transfer)",
        )
        p.add_argument(
            "--prefill-failure-policy", default="recompute", choices=["recompute", "fail"]
        )
        p.add_argument(
            "--engine-process",
            action=argparse.BooleanOptionalAction,
            default=None,
            help="run the engine (model, KV cache, scheduler, KV transfer engine) in a "
            "process of its own, as vLLM's engine core: gRPC and response building then "
            "no longer share its GIL (default: on with a GPU, off on CPU)",
        )
        p.add_argument(
            "--reserve-timeout",
            type=float,
            default=30.0,
            help="how long a request may wait for free KV blocks",
        )


def _add_worker_tls_args(p: argparse.ArgumentParser, role: str) -> None:
    ca_help = "mutual TLS: clients must present a certificate this CA signed"
    if role == "decode":
        ca_help += "; it also verifies prefill workers"
    flags = [
        ("--tls-cert-file", "server certificate (turns TLS on)"),
        ("--tls-key-file", "its private key"),
        ("--tls-ca-file", ca_help),
    ]
    if role == "decode":  # only the decode worker dials other workers
        flags += [
            ("--tls-client-cert-file", "presented to prefill workers (default: --tls-cert-file)"),
            ("--tls-client-key-file", "its private key"),
            ("--tls-server-name", "name in prefill workers' certificates, if not the host dialed"),
        ]
    group = p.add_argument_group("TLS on the gRPC port (default: plaintext; PEM files)")
    for flag, text in flags:
        group.add_argument(flag, default=None, metavar=flag.split("-")[-1].upper(), help=text)


def _engine_process(args) -> bool:
    """--engine-process, or by default: on a GPU the engine steps fast enough that the
    host work of hundreds of streams would cap it under one GIL (on one H200 the tiny
    model served 1.2-1.7x the tokens in its own process); on CPU the model is the cost
    and a second process only adds start-up time."""
    if args.engine_process is not None:
        return args.engine_process
    return args.device.startswith("cuda")


def _cmd_worker(args) -> int:
    import logging

    from kvtransfer.faults import TransferFaults
    from services.common.native_log import NativeStderrRouter, glog_minloglevel
    from services.common.settings import WorkerSettings

    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    # before Mooncake's library loads: glog reads it once, at load time
    os.environ["GLOG_minloglevel"] = glog_minloglevel(args.log_level, os.environ)
    role = args.command
    settings = WorkerSettings(
        host=args.host,
        served_model_name=args.served_model_name,
        port=args.port,
        metrics_port=args.metrics_port,
        transfer_backend=args.transfer_backend,
        transfer_protocol=args.transfer_protocol,
        transfer_hostname=args.transfer_hostname,
        transfer_metadata=args.transfer_metadata,
        transfer_device=args.transfer_device,
        transfer_write_mode=args.transfer_write_mode,
        kv_transfer_timeout_s=args.kv_transfer_timeout,
        drain_timeout_s=args.drain_timeout,
        skip_warmup=args.skip_warmup,
        fault_pause_mid_transfer_s=float(os.environ.get("PDSERVE_FAULT_PAUSE_MID_TRANSFER_S", 0)),
        transfer_faults=TransferFaults.from_env(),
        **{k: v for k, v in vars(args).items() if k.startswith("tls_")},
        **(
            {}
            if role == "prefill"
            else dict(
                prefill_timeout_s=args.prefill_timeout,
                prefill_failure_policy=args.prefill_failure_policy,
                reserve_timeout_s=args.reserve_timeout,
                engine_process=_engine_process(args),
            )
        ),
    )
    config = engine_config_from_args(args, role)
    if role == "prefill":
        from services.prefill.server import run
    else:
        from services.decode.server import run
    from services.common.server import WorkerFailed

    native = NativeStderrRouter()  # Mooncake's glog lines through our logging
    native.start()
    try:
        run(config, settings)
    except WorkerFailed as e:
        print(f"pdserve {role}: {e}", file=sys.stderr)
        return 1
    finally:
        native.stop()
    return 0


def _cmd_tune_kernels(args) -> int:
    """Measure every kernel candidate at the model's shapes on this device, save the
    choices where the tuned backend looks for them, and print the table."""
    import logging

    from services.engine.model_runner import kernel_shapes
    from services.kernels.tuner import tune
    from services.models.loader import load_hf_config, resolve_model_path

    logging.basicConfig(level=logging.WARNING)
    config = engine_config_from_args(args, "both")
    hf_config = load_hf_config(
        resolve_model_path(config.model, config.revision, config.download_dir)
    )
    shapes = kernel_shapes(config, hf_config)
    result = tune(shapes, config.device, retune=not args.use_cache)
    print(f"{result.device_name}, {shapes.dtype}, block size {shapes.block_size}; microseconds")
    print(result.table())
    for key, why in sorted(result.rejected.items()):
        for name, reason in sorted(why.items()):
            print(f"rejected {key} {name}: {reason}")
    return 0


def _cmd_router(args) -> int:
    from router.cli import run_router

    return run_router(args)


def _cmd_up(args) -> int:
    from pdserve.launcher import run_up

    if args.prefill < 0 or args.decode < 1:
        raise ValueError("--prefill must be >= 0 and --decode >= 1")
    return run_up(args, args.worker_args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    chat = sub.add_parser("chat", help="chat with a colocated engine in this terminal")
    add_engine_args(chat)
    chat.add_argument("--prompt", help="answer this one message and exit")
    chat.add_argument("--temperature", type=float, default=0.0)
    chat.add_argument("--max-tokens", type=int, default=256)
    chat.set_defaults(func=_cmd_chat)
    tune_p = sub.add_parser(
        "tune-kernels", help="time every kernel candidate on this GPU and cache the picks"
    )
    add_engine_args(tune_p)
    tune_p.add_argument(
        "--use-cache", action="store_true", help="print cached choices instead of re-measuring"
    )
    tune_p.set_defaults(func=_cmd_tune_kernels)
    for role in ("prefill", "decode"):
        worker = sub.add_parser(role, help=f"run a {role} worker (gRPC)")
        _add_worker_args(worker, role)
        worker.set_defaults(func=_cmd_worker)

    from router.cli import add_router_args

    router = sub.add_parser("router", help="run the OpenAI-compatible router (HTTP)")
    add_router_args(router)
    router.set_defaults(func=_cmd_router)

    up = sub.add_parser("up", help="start router + prefill + decode workers on this machine")
    up.add_argument(
        "--model",
        default="smollm2-135m",
        help="the workers' --model: a folder, Hugging Face Hub id (owner/name) or alias",
    )
    up.add_argument("--host", default="127.0.0.1", help="router listen address")
    up.add_argument("--port", type=int, default=8000, help="router port")
    up.add_argument("--prefill", type=int, default=1, help="number of prefill workers")
    up.add_argument("--decode", type=int, default=1, help="number of decode workers")
    up.add_argument("--device", default="cpu", help="device of every worker")
    up.add_argument(
        "--prefill-device",
        default=None,
        help="prefill workers' devices instead of --device, comma-separated, worker i "
        "taking entry i modulo their number (e.g. cuda:0)",
    )
    up.add_argument(
        "--decode-device",
        default=None,
        help="decode workers' devices instead of --device (e.g. cuda:1,cuda:2)",
    )
    up.add_argument(
        "--prefill-tp",
        type=int,
        default=1,
        help="tensor-parallel size of every prefill worker (--tensor-parallel-size): a "
        "worker on cuda:K uses GPUs K..K+N-1, which no other worker may use; on CPU its "
        "ranks share the CPU",
    )
    up.add_argument(
        "--decode-tp",
        type=int,
        default=1,
        help="tensor-parallel size of every decode worker, as --prefill-tp (e.g. "
        "--prefill-tp 2 --decode-tp 2 --prefill-device cuda:0 --decode-device cuda:2)",
    )
    up.add_argument(
        "--decode-engine-process",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="decode workers run their engine in a process of their own, or not (the "
        "decode worker's --engine-process / --no-engine-process; default: its own default)",
    )
    up.add_argument(
        "--reasoning-parser",
        default=None,
        help="the router's --reasoning-parser (reasoning models' <think> output as "
        "reasoning_content)",
    )
    up.add_argument(
        "--tool-call-parser",
        default=None,
        help="the router's --tool-call-parser (hermes, llama3_json): tool calls in chat "
        "output returned as tool_calls",
    )
    up.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help="the router's --enable-auto-tool-choice: tool_choice 'auto' allowed (needs "
        "--tool-call-parser)",
    )
    up.add_argument(
        "--api-server-count",
        type=int,
        default=1,
        metavar="N",
        help="the router's --api-server-count: HTTP server processes sharing its port (one "
        "streams about 16k tokens/s)",
    )
    up.add_argument(
        "--restart",
        default="on-failure",
        help="what happens when a worker dies, as compose's restart policy: on-failure "
        "(default) starts it again on its address after a backoff (1 s doubling to 30 s) "
        "unless it exited with code 0 (stopped on purpose); always also then; never stops "
        "everything. The router dying always stops everything",
    )
    up.add_argument(
        "--max-restarts",
        type=int,
        default=3,
        help="stop everything when a restarted worker exits before it is ready this many "
        "times in a row (default 3)",
    )
    up.add_argument(
        "worker_args",
        nargs=argparse.REMAINDER,
        help="after --: extra flags for every worker (e.g. -- --max-num-seqs 8)",
    )
    up.set_defaults(func=_cmd_up)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if getattr(args, "worker_args", None) and args.worker_args[0] == "--":
        args.worker_args = args.worker_args[1:]
    try:
        return args.func(args)
    except ValueError as e:
        print(f"pdserve: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
