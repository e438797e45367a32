"""Time every kernel backend (torch, triton, aiter where it loads) on each KernelBackend
operation at Llama-3-8B shapes and print a markdown table.

    python benchmarks/kernels_bench.py                     # all ops, bf16, on CUDA
    python benchmarks/kernels_bench.py --ops paged_attention --dtype float16
    python benchmarks/kernels_bench.py --smoke             # tiny shapes; CPU: interpreter

Times are medians from triton.testing.do_bench (L2 flushed between runs) or CUDA
events when triton is missing. paged_attention is timed after prepare_attention (the
engine runs that once per step for all layers). Each backend's output is also checked
against the torch backend (relative Frobenius error, `err` column).

linear / fp8_linear: Llama-3-8B's gate_up and down projections with bf16 weights, and
with FP8 weights (block 128 x 128 and per-channel scales, activations quantized per
token at every call, included in the time): the FP8 rate beside the bf16 one. The
torch backend's FP8 row is the dequantizing reference (correct, not fast)."""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass

# scaled_mm (torch._scaled_mm, cuBLASLt FP8) runs the fp8_linear rows only
BACKENDS = ("torch", "triton", "aiter", "scaled_mm")
OPS = (
    "linear",
    "fp8_linear",
    "rms_norm",
    "fused_add_rms_norm",
    "rotary_embedding",
    "silu_and_mul",
    "store_kv_cache",
    "paged_attention",
    "fused_moe",
)

# Llama-3-8B: hidden 4096, 32 query heads, 8 KV heads, head_dim 128, MLP 14336.
HIDDEN, HQ, HK, HEAD_DIM, INTER = 4096, 32, 8, 128, 14336
# fused_moe at Qwen3-30B-A3B's experts: 128 experts, top-8, hidden 2048, expert MLP 768.
MOE_EXPERTS, MOE_TOP_K, MOE_HIDDEN, MOE_INTER = 128, 8, 2048, 768


@dataclass
class Case:
    op: str
    label: str
    make: object  # () -> (callable(backend) -> output, bytes_or_None, flops_or_None)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--ops", nargs="+", choices=OPS, default=list(OPS), help="operations to time")
    p.add_argument(
        "--backends", nargs="+", choices=BACKENDS, default=list(BACKENDS), help="candidates"
    )
    p.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16")
    p.add_argument("--device", default="cuda", help="cuda (default) or cpu (only with --smoke)")
    p.add_argument("--block-size", type=int, default=16, help="KV cache block size")
    p.add_argument("--rep-ms", type=float, default=100.0, help="do_bench repetition budget (ms)")
    p.add_argument(
        "--smoke", action="store_true", help="tiny shapes, one run each (checks the script)"
    )
    p.add_argument(
        "--cuda-graph",
        action="store_true",
        help="time CUDA-graph replays (kernel time without Python launch overhead, as the\n"
        "engine's captured decode steps will see it); ops that cannot be captured say so",
    )
    p.add_argument(
        "--sweep",
        action="store_true",
        help="instead of the table: sweep the triton paged-attention launch configs\n"
        "(TILE_N, num_warps, num_stages, splits) per attention shape, best first",
    )
    return p.parse_args(argv)


def _timer(device: str, rep_ms: float, smoke: bool):
    import time

    import torch

    if smoke or device == "cpu":

        def once(fn):
            fn()
            t = time.perf_counter()
            fn()
            return (time.perf_counter() - t) * 1e3

        return once
    try:
        from triton.testing import do_bench

        return lambda fn: do_bench(fn, warmup=25, rep=rep_ms, return_mode="median")
    except ImportError:

        def events(fn):
            for _ in range(5):
                fn()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            times = []
            for _ in range(20):
                start.record()
                fn()
                end.record()
                torch.cuda.synchronize()
                times.append(start.elapsed_time(end))
            return sorted(times)[len(times) // 2]

        return events


def _graphed(fn, torch):
    """Capture fn() in a CUDA graph; returns the replay callable."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def sweep_attention(args, torch, dtype, dev, bench) -> None:
    import itertools

    from services.kernels import triton as tk

    cases = [c for c in build_cases(args, torch, dtype, dev) if c.op == "paged_attention"]
    print(f"## triton paged_attention config sweep, {args.dtype}, block_size {args.block_size}")
    print("| shape | TILE_N | warps | stages | splits | BLOCK_M | time (us) | vs default |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for case in cases:
        run, _, _ = case.make()
        ops = _Capture()
        run(ops)  # records the call's arguments
        q, kc, vc, meta, scale = ops.args
        decode = meta.max_query_len == 1
        bt, sl, cu = (
            t.to(torch.int32) for t in (meta.block_tables, meta.seq_lens, meta.cu_seqlens_q)
        )

        def call(cfg, q=q, kc=kc, vc=vc, bt=bt, sl=sl, cu=cu, meta=meta, scale=scale):
            return lambda: tk.paged_attention(
                q, kc, vc, bt, sl, cu, meta.max_query_len, meta.max_seq_len, scale, config=cfg
            )

        def timed(cfg):
            fn = call(cfg)
            fn()
            return bench(_graphed(fn, torch) if args.cuda_graph else fn)

        base = timed(None)
        results = []
        grid = itertools.product((32, 64, 128), (4, 8), (1, 2, 3))
        for tile_n, warps, stages in grid:
            cfg = dict(TILE_N=tile_n, num_warps=warps, num_stages=stages)
            try:
                results.append((timed(cfg), cfg))
            except Exception as exc:  # out of shared memory etc.
                print(f"| {case.label} | {cfg} failed: {exc!s:.60} |||||||")
        results.sort(key=lambda r: r[0])
        best = dict(results[0][1])
        extra = [dict(best, NUM_SPLITS=n) for n in (1, 2, 4, 8, 16, 32, 64)] if decode else []
        extra += [dict(best, BLOCK_M=m) for m in (16, 32, 64, 128)] if not decode else []
        for cfg in extra:
            try:
                results.append((timed(cfg), cfg))
            except Exception as exc:
                print(f"| {case.label} | {cfg} failed: {exc!s:.60} |||||||")
        results.sort(key=lambda r: r[0])
        default = tk.attention_config(
            q.shape[0], sl.shape[0], q.shape[1], kc.shape[2], meta.max_query_len,
            meta.max_seq_len, torch.cuda.get_device_properties(dev).multi_processor_count,
            False,
        )  # fmt: skip
        print(
            f"| {case.label} | {default['TILE_N']} | {default['num_warps']} | "
            f"{default['num_stages']} | {default['NUM_SPLITS']} | {default['BLOCK_M']} | "
            f"{base * 1e3:.1f} | default |"
        )
        for ms, cfg in results[:4]:
            print(
                f"| {case.label} | {cfg['TILE_N']} | {cfg['num_warps']} | {cfg['num_stages']} | "
                f"{cfg.get('NUM_SPLITS', 'auto')} | {cfg.get('BLOCK_M', 'auto')} | "
                f"{ms * 1e3:.1f} | {base / ms:.2f}x |"
            )


class _Capture:
    """A stand-in backend that records paged_attention's arguments."""

    name = "capture"

    def prepare_attention(self, meta):
        pass

    def paged_attention(self, q, k_cache, v_cache, meta, scale):
        self.args = (q, k_cache, v_cache, meta, scale)


def build_cases(args, torch, dtype, dev) -> list[Case]:
    from services.kernels.interface import AttentionMetadata

    smoke = args.smoke
    hidden, hq, hk, d, inter = (64, 4, 2, 16, 96) if smoke else (HIDDEN, HQ, HK, HEAD_DIM, INTER)
    token_counts = (5,) if smoke else (1, 64, 1024, 8192)
    esize = torch.tensor([], dtype=dtype).element_size()
    cases: list[Case] = []

    def randn(*shape):
        return torch.randn(*shape, device=dev, dtype=torch.float32).to(dtype)

    for t in token_counts:
        x, res, w = randn(t, hidden), randn(t, hidden), randn(hidden)
        cases.append(
            Case("rms_norm", f"T={t} N={hidden}", lambda x=x, w=w: (
                lambda b: b.rms_norm(x, w, 1e-5), 2 * x.numel() * esize, None))
        )  # fmt: skip
        cases.append(
            Case("fused_add_rms_norm", f"T={t} N={hidden}", lambda x=x, r=res, w=w: (
                lambda b: b.fused_add_rms_norm(x, r, w, 1e-5), 4 * x.numel() * esize, None))
        )  # fmt: skip
        qkv = randn(t, (hq + 2 * hk) * d)
        q, k, v = qkv.split([hq * d, hk * d, hk * d], dim=-1)
        q, k, v = q.view(t, hq, d), k.view(t, hk, d), v.view(t, hk, d)
        from services.models.rope import cos_sin_cache

        table = cos_sin_cache(d, 8192, {"rope_type": "default", "rope_theta": 5e5}).to(dev)
        pos = torch.randint(0, 8192, (t,), device=dev)
        cases.append(
            Case("rotary_embedding", f"T={t} {hq}/{hk}x{d}", lambda q=q, k=k, p=pos, c=table: (
                lambda b: b.rotary_embedding(p, q, k, c), 2 * (q.numel() + k.numel()) * esize,
                None))
        )  # fmt: skip
        gu = randn(t, 2 * inter)
        cases.append(
            Case("silu_and_mul", f"T={t} I={inter}", lambda gu=gu: (
                lambda b: b.silu_and_mul(gu), 3 * gu.numel() // 2 * esize, None))
        )  # fmt: skip
        bs = args.block_size
        nblocks = max(64, 2 * t // bs + 1)
        kv = torch.zeros(nblocks, 4, 2, bs, hk, d, dtype=dtype, device=dev)
        slots = torch.randperm(nblocks * bs, device=dev)[:t]
        kk = k.contiguous()
        cases.append(
            Case("store_kv_cache", f"T={t} {hk}x{d} bs={bs}", lambda kk=kk, v=v, kv=kv, s=slots: (
                lambda b: b.store_kv_cache(kk, v, kv[:, 1, 0], kv[:, 1, 1], s),
                4 * kk.numel() * esize, None))
        )  # fmt: skip

    # linears, bf16 and FP8: Llama-3-8B's gate_up and down projections
    from services.kernels.fp8 import Fp8Format
    from services.models.fp8_linear import Fp8Linear

    gen = torch.Generator(dev).manual_seed(0)
    for n, kdim in [(2 * inter, hidden), (hidden, inter)]:
        dense = torch.nn.Linear(kdim, n, bias=False, device=dev, dtype=dtype)
        fp8 = {}
        for fmt in (Fp8Format("block", 128, 128), Fp8Format("channel")):
            layer = Fp8Linear(kdim, n, False, fmt, None).to(dev)
            layer.fill_random(gen, 0.05)
            fp8[fmt.granularity] = layer
        for t in token_counts:
            x = randn(t, kdim)
            flops = 2 * t * n * kdim
            cases.append(
                Case("linear", f"T={t} N={n} K={kdim} bf16", lambda x=x, w=dense, f=flops: (
                    lambda b: b.linear(x, w), w.weight.numel() * esize, f))
            )  # fmt: skip
            for name, layer in fp8.items():
                cases.append(
                    Case("fp8_linear", f"T={t} N={n} K={kdim} {name}", lambda x=x, w=layer,
                         f=flops: (lambda b: b.linear(x, w), w.weight.numel(), f))
                )  # fmt: skip

    # fused MoE: bytes are the weights of the experts hit at most, as decode reads them
    e, k, h, i = (8, 2, 64, 32) if smoke else (MOE_EXPERTS, MOE_TOP_K, MOE_HIDDEN, MOE_INTER)
    w13, w2 = randn(e, 2 * i, h) * h**-0.5, randn(e, h, i) * i**-0.5
    for t in token_counts:
        x, logits = randn(t, h), randn(t, e)
        cases.append(
            Case("fused_moe", f"T={t} E={e} k={k} H={h} I={i}", lambda x=x, lg=logits, t=t: (
                lambda b: b.fused_moe(x, lg, w13, w2, k, True),
                min(e, t * k) * 3 * h * i * esize, 6 * t * k * h * i))
        )  # fmt: skip

    # paged attention: (label, query lens, cached context lens)
    if smoke:
        attn = [("decode b=3", [1, 1, 1], [20, 5, 40]), ("mixed", [9, 1], [16, 30])]
    else:
        attn = [
            ("decode b=1 ctx=1k", [1], [1023]),
            ("decode b=64 ctx=1k", [1] * 64, [1023] * 64),
            ("decode b=256 ctx=1k", [1] * 256, [1023] * 256),
            ("decode b=8 ctx=8k", [1] * 8, [8191] * 8),
            ("prefill 8x2048", [2048] * 8, [0] * 8),
            ("chunk 512 after 1k + 32 decodes", [512] + [1] * 32, [1024] + [1023] * 32),
        ]
    bs = args.block_size
    for label, q_lens, ctx in attn:
        seq_lens = [n + c for n, c in zip(q_lens, ctx)]
        per_seq = [-(-s // bs) for s in seq_lens]
        nblocks = sum(per_seq) + 1
        perm = torch.randperm(nblocks).tolist()
        tables, i = [], 0
        for n in per_seq:
            tables.append(perm[i : i + n])
            i += n
        width = max(per_seq)
        bt = torch.tensor([t_ + [0] * (width - len(t_)) for t_ in tables], dtype=torch.int32)
        kv = randn(nblocks, 2, 2, bs, hk, d)  # block-major, 2 layers: strided views
        cu = [0]
        for n in q_lens:
            cu.append(cu[-1] + n)
        q = randn(cu[-1], hq, d)

        def meta(bt=bt, cu=cu, seq_lens=seq_lens, q_lens=q_lens):
            return AttentionMetadata(
                slot_mapping=torch.zeros(cu[-1], dtype=torch.int64, device=dev),
                cu_seqlens_q=torch.tensor(cu, dtype=torch.int32, device=dev),
                seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
                block_tables=bt.to(dev),
                max_query_len=max(q_lens),
                max_seq_len=max(seq_lens),
                block_size=bs,
            )

        kv_bytes = 2 * sum(seq_lens) * hk * d * esize
        flops = sum(4 * n * (c + (n + 1) / 2) * hq * d for n, c in zip(q_lens, ctx))

        def make(q=q, kv=kv, meta=meta, kv_bytes=kv_bytes, flops=flops):
            per_backend = {}

            def run(ops):
                if ops.name not in per_backend:
                    m = meta()
                    ops.prepare_attention(m)
                    per_backend[ops.name] = m
                return ops.paged_attention(
                    q, kv[:, 1, 0], kv[:, 1, 1], per_backend[ops.name], d**-0.5
                )

            return run, kv_bytes + 2 * q.numel() * esize, flops

        cases.append(Case("paged_attention", label, make))
    return [c for c in cases if c.op in args.ops]


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.device == "cpu":
        if not args.smoke:
            print("--device cpu needs --smoke (the real shapes are for GPUs)", file=sys.stderr)
            return 2
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported
    import torch

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("no CUDA device: run on a GPU, or use --smoke --device cpu", file=sys.stderr)
        return 2
    from services.kernels import get_backend

    dtype = getattr(torch, args.dtype)
    dev = torch.device(args.device)
    backends = {}
    for name in args.backends:
        try:
            if name == "scaled_mm":  # a tuner candidate, not an engine backend
                from services.kernels.scaled_mm_backend import ScaledMMBackend

                backends[name] = ScaledMMBackend(dev if dev.type == "cuda" else None)
            else:
                backends[name] = get_backend(name)
        except ValueError as exc:
            print(f"skipping backend {name}: {exc}", file=sys.stderr)
    if "torch" not in backends:
        backends = {"torch": get_backend("torch"), **backends}
    bench = _timer(args.device, args.rep_ms, args.smoke)
    torch.manual_seed(0)
    if args.sweep:
        if dev.type != "cuda":
            print("--sweep needs a GPU", file=sys.stderr)
            return 2
        with torch.inference_mode():
            sweep_attention(args, torch, dtype, dev, bench)
        return 0
    with torch.inference_mode():
        cases = build_cases(args, torch, dtype, dev)
        gpu = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu (interpreter)"
        mode = ", CUDA-graph replay" if args.cuda_graph else ""
        print(f"## Kernel backends on {gpu}, {args.dtype}, block_size {args.block_size}{mode}\n")
        print("| op | shape | backend | time (us) | vs torch | GB/s | TFLOP/s | err |")
        print("|---|---|---|---:|---:|---:|---:|---:|")
        for case in cases:
            run, nbytes, flops = case.make()
            ref = _first(run(backends["torch"]))
            base = None
            for name, backend in backends.items():
                if name == "scaled_mm" and case.op != "fp8_linear":
                    continue
                try:
                    out = _first(run(backend))
                    err = _rel_err(out, ref) if out is not None else 0.0
                    fn = lambda b=backend, run=run: run(b)  # noqa: E731
                    if args.cuda_graph and dev.type == "cuda":
                        try:
                            fn = _graphed(fn, torch)
                        except Exception as exc:
                            print(f"| {case.op} | {case.label} | {name} | not capturable: "
                                  f"{exc!s:.60} |||||")  # fmt: skip
                            torch.cuda.synchronize()
                            continue
                    ms = bench(fn)
                except Exception as exc:  # report and keep going
                    print(f"| {case.op} | {case.label} | {name} | failed: {exc!s:.80} |||||")
                    continue
                base = ms if name == "torch" else base
                speed = f"{base / ms:.2f}x" if base else "-"
                gbs = f"{nbytes / ms / 1e6:.0f}" if nbytes else ""
                tfs = f"{flops / ms / 1e9:.1f}" if flops else ""
                print(
                    f"| {case.op} | {case.label} | {name} | {ms * 1e3:.1f} | {speed} | {gbs} "
                    f"| {tfs} | {err:.1e} |"
                )
    return 0


def _first(out):
    return out[0] if isinstance(out, tuple) else out


def _rel_err(out, ref) -> float:
    a, b = out.double(), ref.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


if __name__ == "__main__":
    sys.exit(main())
