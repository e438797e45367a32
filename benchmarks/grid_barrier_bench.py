"""What a kernel boundary costs at batch-1 decode, against a grid-wide barrier inside one
persistent launch. GPU only (a spinning barrier cannot run in the interpreter).

The chain is a MoE block's dense analog at Qwen3-30B-A3B's sizes, one row: o_proj
(2048 x 4096), the experts' gate/up with SiLU (8 x 1536 rows -> 6144 outputs, over
2048) and down (2048 x 6144), distinct weights per layer so nothing stays in the L2.
The same GEMV code runs in three modes, CUDA graphs and PDL on:

  sep    three launches a layer (one phase each)
  fused  one launch a layer, the phases separated by a grid barrier
  repo   pdserve's gemv / gemv_silu_and_mul (what the engine launches today)

sep - fused is what whole kernels gone would save, per boundary.

    PYTHONPATH=$PWD python benchmarks/grid_barrier_bench.py [--layers 24] [--occupancy 1 2]
"""

from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl

from services.kernels.timing import time_graph_us
from services.kernels.triton._launch import num_sms, pdl_sync, use_pdl

O_N, O_K = tl.constexpr(2048), tl.constexpr(4096)
GU_N, GU_K = tl.constexpr(6144), tl.constexpr(2048)  # outputs; 2 * GU_N weight rows
D_N, D_K = tl.constexpr(2048), tl.constexpr(6144)


@triton.jit
def _phase(x_ptr, w_ptr, y_ptr, pid, nprog, N: tl.constexpr, K: tl.constexpr,
           GATED: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
           STAGES: tl.constexpr):  # fmt: skip
    """y = w @ x (GATED: silu(w[:N] @ x) * (w[N:] @ x)), row blocks strided over the
    grid. x is read past the L1 (.cg): another SM wrote it in this launch."""
    for blk in range(pid, N // BLOCK_N, nprog):
        rows = (blk * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
        acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        acc_up = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        for k0 in tl.range(0, K, BLOCK_K, num_stages=STAGES):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(x_ptr + offs_k, cache_modifier=".cg").to(tl.float32)
            w = tl.load(w_ptr + rows[:, None] * K + offs_k[None, :])
            acc += w.to(tl.float32) * x[None, :]
            if GATED:
                wu = tl.load(w_ptr + (rows[:, None] + N) * K + offs_k[None, :])
                acc_up += wu.to(tl.float32) * x[None, :]
        y = tl.sum(acc, axis=1)
        if GATED:
            y = y / (1.0 + tl.exp(-y)) * tl.sum(acc_up, axis=1)
        tl.store(y_ptr + rows, y.to(y_ptr.dtype.element_ty))


@triton.jit
def _grid_barrier(count_ptr, gen_ptr, nprog):
    """Sense-reversing barrier: the last program to arrive resets the count and bumps
    the generation the others spin on. Needs every program resident at once."""
    tl.debug_barrier()  # this program's stores are issued before it arrives
    gen = tl.atomic_add(gen_ptr, 0, sem="acquire", scope="gpu")
    if tl.atomic_add(count_ptr, 1, sem="acq_rel", scope="gpu") == nprog - 1:
        tl.atomic_xchg(count_ptr, 0, sem="relaxed", scope="gpu")
        tl.atomic_add(gen_ptr, 1, sem="release", scope="gpu")
    else:
        cur = tl.atomic_add(gen_ptr, 0, sem="acquire", scope="gpu")
        while cur == gen:
            cur = tl.atomic_add(gen_ptr, 0, sem="acquire", scope="gpu")
    tl.debug_barrier()


@triton.jit
def _block_kernel(x_ptr, wo_ptr, h_ptr, wgu_ptr, act_ptr, wd_ptr, out_ptr, sync_ptr,
                  FIRST: tl.constexpr, LAST: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr, STAGES: tl.constexpr, USE_PDL: tl.constexpr):  # fmt: skip
    pdl_sync(USE_PDL)
    pid, nprog = tl.program_id(0), tl.num_programs(0)
    if FIRST <= 0 and LAST >= 0:
        _phase(x_ptr, wo_ptr, h_ptr, pid, nprog, O_N, O_K, False, BLOCK_N, BLOCK_K, STAGES)
    if FIRST <= 0 and LAST >= 1:
        _grid_barrier(sync_ptr, sync_ptr + 1, nprog)
    if FIRST <= 1 and LAST >= 1:
        _phase(h_ptr, wgu_ptr, act_ptr, pid, nprog, GU_N, GU_K, True, BLOCK_N, BLOCK_K, STAGES)
    if FIRST <= 1 and LAST >= 2:
        _grid_barrier(sync_ptr, sync_ptr + 1, nprog)
    if FIRST <= 2 and LAST >= 2:
        _phase(act_ptr, wd_ptr, out_ptr, pid, nprog, D_N, D_K, False, BLOCK_N, BLOCK_K, STAGES)


def _resident_per_sm(x, h, act, out, sync, weights, kw) -> int:
    """How many programs of the fused kernel one SM holds at once (registers and shared
    memory): a grid barrier with more programs than fit would never return."""
    wo, wgu, wd = weights
    compiled = _block_kernel.warmup(
        x, wo, h, wgu, act, wd, out, sync, FIRST=0, LAST=2, grid=(1,), **kw
    )
    compiled._init_handles()  # loads the binary: its register count
    warps = kw["num_warps"]
    regs_per_warp = -(-compiled.n_regs * 32 // 256) * 256  # allocated in 256s
    props = torch.cuda.get_device_properties(0)
    by_regs = props.regs_per_multiprocessor // (regs_per_warp * warps)
    smem = compiled.metadata.shared
    by_smem = props.shared_memory_per_multiprocessor // smem if smem else by_regs
    by_threads = props.max_threads_per_multi_processor // (32 * warps)
    return min(by_regs, by_smem, by_threads)


def _layers(n, dev):
    def w(r, c):
        return torch.randn(r, c, device=dev, dtype=torch.bfloat16) * 0.02

    return [(w(O_N, O_K), w(2 * GU_N, GU_K), w(D_N, D_K)) for _ in range(n)]


def _time(fn) -> float:
    """Microseconds per CUDA-graph replay of fn (the whole chain)."""
    return time_graph_us(fn, calls=1, replays=20)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--occupancy", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--tiles", nargs="+", default=["16,256,8,1", "16,512,8,1", "8,256,4,2"],
                    help="BLOCK_N,BLOCK_K,num_warps,stages")  # fmt: skip
    args = ap.parse_args()
    dev = torch.device("cuda")
    print(torch.cuda.get_device_name(), "SMs", num_sms(0), flush=True)
    layers = _layers(args.layers, dev)
    nbytes = sum(t.numel() * 2 for lw in layers for t in lw) / args.layers
    x = torch.randn(1, O_K, device=dev, dtype=torch.bfloat16)
    h = torch.empty(O_N, device=dev, dtype=torch.bfloat16)
    act = torch.empty(GU_N, device=dev, dtype=torch.bfloat16)
    outs = [torch.empty(D_N, device=dev, dtype=torch.bfloat16) for _ in layers]
    sync = torch.zeros(2, device=dev, dtype=torch.int32)
    pdl = use_pdl(x)

    def report(label, us):
        per = us / args.layers
        print(f"{label:<28} {per:7.2f} us/layer  {nbytes / per / 1e6:5.2f} TB/s", flush=True)

    # reference: the three products in torch, to check every mode's last output
    ref_h = (layers[-1][0].float() @ x[0].float()).bfloat16()
    gu = layers[-1][1].float() @ ref_h.float()
    ref_act = (torch.nn.functional.silu(gu[:GU_N]) * gu[GU_N:]).bfloat16()
    ref = (layers[-1][2].float() @ ref_act.float()).bfloat16()

    def check(label):
        err = (outs[-1].float() - ref.float()).abs().max().item()
        scale = ref.float().abs().max().item()
        if not err <= 0.02 * scale + 1e-3:
            raise SystemExit(f"{label}: max error {err} against {scale}")

    from services.kernels.triton.gated_gemv import gemv_silu_and_mul
    from services.kernels.triton.gemv import gemv

    def repo():
        for wo, wgu, wd in layers:
            y = gemv(gemv_silu_and_mul(gemv(x, wo), wgu), wd)
        outs[-1].copy_(y[0])

    us = _time(repo)
    check("repo")
    report("repo gemv (3 launches)", us)
    for tile in args.tiles:
        bn, bk, warps, stages = map(int, tile.split(","))
        for occ in args.occupancy:
            grid = (num_sms(0) * occ,)
            kw = dict(BLOCK_N=bn, BLOCK_K=bk, STAGES=stages, USE_PDL=pdl, num_warps=warps,
                      launch_pdl=pdl)  # fmt: skip

            if occ > _resident_per_sm(x, h, act, outs[0], sync, layers[0], kw):
                print(f"tile {tile} x{occ}: not all programs fit at once; skipped", flush=True)
                continue

            def launches(phases, grid=grid, kw=kw):
                for (wo, wgu, wd), out in zip(layers, outs):
                    for first, last in phases:
                        _block_kernel[grid](
                            x, wo, h, wgu, act, wd, out, sync, FIRST=first, LAST=last, **kw
                        )

            for label, phases in (("sep", [(0, 0), (1, 1), (2, 2)]), ("fused", [(0, 2)])):
                outs[-1].zero_()
                us = _time(lambda phases=phases: launches(phases))
                check(label)
                report(f"{label} {tile} x{occ}", us)


if __name__ == "__main__":
    main()
