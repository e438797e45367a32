"""KV handoff between two GPUs through Mooncake (nvlink_intra): a prefill engine on
cuda:0 computes a prompt, its blocks are written into a decode engine's reserved
blocks on cuda:1 (--decode-device; on a one-GPU machine cuda:0, a second process on
the same GPU), and the bytes are checked. Reports effective transfer bandwidth and
time-to-first-token disaggregated (prefill + transfer) vs colocated (prefill alone).
--kv-cache-dtype fp8_e4m3 moves an FP8 cache (half the bytes).

    MC_INTRANODE_NVLINK=1 python benchmarks/kv_handoff_bench.py \\
        --config benchmarks/configs/llama3-8b.json --prompt-len 2048 [--kv-cache-dtype fp8_e4m3]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import multiprocessing as mp
import os
import shutil
import tempfile
import time
from pathlib import Path

import torch

from kvtransfer import KVAgentInfo, create_connector
from services.common.kv import memory_location, register_kv_cache
from services.engine import EngineConfig, LLMEngine, SamplingParams


def connector_for(
    kv: torch.Tensor, spec, protocol: str, max_region_mb: int = 64, direct_writes=None
):
    conn = create_connector(
        "mooncake",
        hostname="127.0.0.1",
        protocol=protocol,
        memory_location=memory_location(kv),
        max_region_bytes=max_region_mb << 20,
        direct_writes=direct_writes,
    )
    register_kv_cache(conn, kv, spec)
    return conn


def block_digest(kv: torch.Tensor, block_id: int) -> str:
    return hashlib.sha256(kv[block_id].view(torch.uint8).cpu().numpy().tobytes()).hexdigest()


def decode_side(conn, shape, dtype, spec, protocol, device) -> None:
    torch.cuda.set_device(device)
    kv = torch.zeros(shape, dtype=dtype, device=device)
    connector = connector_for(kv, spec, protocol)
    conn.send(connector.agent_info().to_dict())
    while (block_ids := conn.recv()) is not None:
        torch.cuda.synchronize(device)
        conn.send([block_digest(kv, b) for b in block_ids])
    connector.close()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="benchmarks/configs/llama3-8b.json")
    ap.add_argument("--prompt-len", type=int, default=2048)
    ap.add_argument("--protocol", default="nvlink_intra")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--max-region-mb", type=int, default=64)
    ap.add_argument(
        "--write-mode",
        choices=("default", "direct", "thread"),
        default="default",
        help="direct: engine calls from the caller's thread; thread: from the peer's "
        "writer thread; default: the connector's choice (direct for nvlink_intra)",
    )
    ap.add_argument("--kv-cache-dtype", choices=("auto", "fp8_e4m3"), default="auto")
    ap.add_argument(
        "--decode-device",
        default=None,
        help="the decode side's GPU (default cuda:1, or cuda:0 on a one-GPU machine)",
    )
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args()
    decode_device = args.decode_device or ("cuda:1" if torch.cuda.device_count() > 1 else "cuda:0")
    if args.protocol == "nvlink_intra":
        os.environ.setdefault("MC_INTRANODE_NVLINK", "1")

    d = Path(tempfile.mkdtemp(prefix="pdserve-dummy-"))
    shutil.copy(args.config, d / "config.json")
    # The decode side is only its KV memory (same block-major layout) on cuda:1.
    prefill = LLMEngine(
        EngineConfig(
            model=str(d),
            role="prefill",
            device="cuda:0",
            load_format="dummy",
            dtype="bfloat16",
            kv_cache_dtype=args.kv_cache_dtype,
            num_kv_blocks=2048,
            max_num_batched_tokens=max(8192, args.prompt_len),
            enforce_eager=True,
        )
    )
    spec = prefill.runner.kv_spec
    kv = prefill.runner.kv_cache
    # The decode side runs in its own process (nvlink_intra maps the peer's memory
    # through CUDA IPC, which cannot open memory of the same process).
    ctx = mp.get_context("spawn")
    parent_end, child_end = ctx.Pipe()
    child = ctx.Process(
        target=decode_side,
        args=(child_end, tuple(kv.shape), kv.dtype, spec, args.protocol, decode_device),
    )
    child.start()
    peer = KVAgentInfo.from_dict(parent_end.recv())
    direct_writes = {"default": None, "direct": True, "thread": False}[args.write_mode]
    p_conn = connector_for(kv, spec, args.protocol, args.max_region_mb, direct_writes)
    p_conn.add_peer(peer)
    vocab = prefill.hf_config.vocab_size
    params = SamplingParams(temperature=0, max_tokens=2)
    n_blocks = -(-args.prompt_len // spec.block_size)
    layouts = {
        # a fresh or tidy decode pool hands out runs of consecutive blocks
        "contiguous": list(range(100, 100 + n_blocks)),
        # worst case: every block isolated, nothing to coalesce
        "scattered": list(range(2047, 2047 - 2 * n_blocks, -2)),
    }
    rows = []
    for r in range(args.repeats + 1):
        layout_name = "scattered" if r == args.repeats else "contiguous"
        dst_ids = layouts[layout_name]
        prompt = torch.randint(
            10, vocab - 10, (args.prompt_len,), generator=torch.Generator().manual_seed(r)
        ).tolist()
        rid = f"r{r}"
        torch.cuda.synchronize(0)
        t0 = time.perf_counter()
        prefill.add_request(rid, prompt, params)
        while not prefill.step():
            pass
        torch.cuda.synchronize(0)
        t1 = time.perf_counter()
        src = prefill.get_sequence(rid).block_table
        stats = p_conn.write_blocks(peer, src, dst_ids, 30.0)
        t2 = time.perf_counter()
        parent_end.send(dst_ids)
        ok = parent_end.recv() == [block_digest(kv, b) for b in src]
        prefill.release(rid)
        if r == 0:
            continue  # warm-up: first contact with the peer, kernel compilation
        rows.append(
            {
                "layout": layout_name,
                "prefill_ms": (t1 - t0) * 1e3,
                "transfer_ms": (t2 - t1) * 1e3,
                "bytes": stats.bytes,
                "regions": stats.num_regions,
                "GBps": stats.bytes / (t2 - t1) / 1e9,
                "checksum_ok": ok,
                "ttft_ratio": (t2 - t0) / (t1 - t0),
            }
        )
        print(json.dumps(rows[-1]), flush=True)
    best = min((x for x in rows if x["layout"] == "contiguous"), key=lambda x: x["transfer_ms"])
    print(
        f"{args.kv_cache_dtype} KV, cuda:0 -> {decode_device}: "
        f"KV of a {args.prompt_len}-token request: {best['bytes'] / 1e6:.0f} MB in "
        f"{best['regions']} regions, {best['transfer_ms']:.2f} ms = {best['GBps']:.0f} GB/s; "
        f"TTFT disaggregated / colocated = {best['ttft_ratio']:.3f}",
        flush=True,
    )
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(rows, indent=2))
    parent_end.send(None)
    child.join(30)
    p_conn.close()


if __name__ == "__main__":
    main()
