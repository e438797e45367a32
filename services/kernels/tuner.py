"""Pick the fastest kernel per operation and shape class on the running device.

AITER's idea, which ATOM relies on: no backend wins everything (cuBLAS beats Triton
GEMMs on the H200, FlashAttention beats Triton on dense prefill, Triton beats torch on
paged decode), so each operation is timed with every candidate that loads here, at the
model's own shapes, and the fastest correct one is kept. Choices are cached per GPU
model, shapes, dtype and library versions (a JSON file under the pdserve cache dir), so
only the first start on a machine pays for the measurement (~50 s on an H200, mostly
Triton compiling every candidate); `pdserve tune-kernels` re-measures offline and
prints the table. The ops, shape classes and candidates per class are in
shape_classes.py; the tuned backend (tuned_backend.py) calls `tune` when it is built,
and nothing here imports it. Decode classes are timed as CUDA-graph replays.

A candidate is discarded if it fails to run or its output strays from the torch
reference (computed in fp32) by more than the dtype's relative-error bound."""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import statistics
import time
import zlib
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from importlib import metadata
from pathlib import Path

import torch

from services.kernels.cache_dir import kernel_tuning_dir
from services.kernels.cpu_backend import CpuSlabBackend
from services.kernels.interface import FP8_KV_DTYPE, AttentionMetadata
from services.kernels.sdpa_backend import SdpaBackend
from services.kernels.shape_classes import (
    DECODE_CLASSES,
    GRAPH_CLASSES,
    OP_CLASSES,
    TUNED_CONFIG_CANDIDATES,
    KernelShapes,
    all_keys,
    candidates_for,
    ops_for,
)
from services.kernels.torch_backend import TorchBackend

log = logging.getLogger(__name__)

TUNER_VERSION = 6  # 6: fused_moe launch configs, aiter MoE; 5: fused_moe; 4: decode1 class
# Relative Frobenius error allowed against the fp32 torch reference.
REL_TOL = {torch.float32: 1e-3, torch.float16: 1e-2, torch.bfloat16: 3e-2}


@dataclass(frozen=True)
class TuningSizes:
    """Token counts and contexts of the representative inputs per class."""

    decode_tokens: tuple[int, ...] = (1, 4, 24, 128)  # one per decode class
    prefill_tokens: int = 2048
    decode_ctx: int = 1024
    prefill_seqs: int = 4
    prefill_len: int = 512
    mixed_chunk: int = 512

    def __post_init__(self):
        if len(self.decode_tokens) != len(DECODE_CLASSES):
            raise ValueError(
                f"decode_tokens needs one token count per decode class {list(DECODE_CLASSES)}"
            )

    @classmethod
    def cpu(cls) -> TuningSizes:
        """A CPU measures with real weights in seconds, not at GPU batch sizes: the
        decode classes keep their token counts, prefill and contexts are shorter."""
        return cls((1, 4, 24, 128), 256, 256, 2, 128, 128)

    @classmethod
    def tiny(cls) -> TuningSizes:
        """For CPU tests (Triton's interpreter is slow)."""
        return cls((1, 2, 3, 5), 40, 40, 2, 20, 20)

    def tokens(self, cls: str) -> int:
        if cls in DECODE_CLASSES:
            return self.decode_tokens[list(DECODE_CLASSES).index(cls)]
        return self.prefill_tokens


@dataclass
class TuningResult:
    choices: dict[str, str]  # "op.class" -> candidate
    times_us: dict[str, dict[str, float]]  # "op.class" -> candidate -> microseconds
    rejected: dict[str, dict[str, str]] = field(default_factory=dict)  # why not
    # "op.class" -> launch settings of the choice, for TUNED_CONFIG_CANDIDATES
    configs: dict[str, dict] = field(default_factory=dict)
    device_name: str = ""
    measured_at: str = ""
    from_cache: bool = False

    def table(self) -> str:
        """Markdown: one row per op and class, every candidate's time, the choice."""
        names = sorted({c for t in self.times_us.values() for c in t} | _rejected_names(self))
        lines = [
            "| op | class | " + " | ".join(names) + " | choice | vs torch |",
            "|---|---|" + "---:|" * len(names) + "---|---:|",
        ]
        order = [f"{op}.{c}" for op, cs in OP_CLASSES.items() for c in cs]
        for key in sorted(self.choices, key=lambda k: order.index(k) if k in order else 0):
            op, cls = key.split(".")
            cells = []
            for n in names:
                if n in self.times_us.get(key, {}):
                    t = self.times_us[key][n]
                    cells.append(f"**{t:.1f}**" if n == self.choices[key] else f"{t:.1f}")
                elif n in self.rejected.get(key, {}):
                    cells.append("rejected")
                else:
                    cells.append("-")
            times = self.times_us.get(key, {})
            chosen, ref = times.get(self.choices[key]), times.get("torch")
            speedup = f"{ref / chosen:.1f}x" if chosen and ref else "-"
            choice = self.choices[key]
            if key in self.configs:
                choice += " " + config_label(self.configs[key])
            lines.append(f"| {op} | {cls} | " + " | ".join(cells) + f" | {choice} | {speedup} |")
        return "\n".join(lines)


def config_label(cfg: dict) -> str:
    """Launch settings in a table cell: M x N x K tiles, group, warps, stages (GEMV
    path: N x K blocks, warps)."""
    if cfg.get("kernel") == "gemv":
        return f"gemv {cfg['BLOCK_N']}x{cfg['BLOCK_K']} w{cfg['num_warps']}"
    return (
        f"{cfg['BLOCK_M']}x{cfg['BLOCK_N']}x{cfg['BLOCK_K']} "
        f"g{cfg['GROUP_M']} w{cfg['num_warps']} s{cfg['num_stages']}"
    )


def _rejected_names(result: TuningResult) -> set[str]:
    return {c for r in result.rejected.values() for c in r}


# ---- candidates -----------------------------------------------------------------------
GPU_CANDIDATES = ("torch", "triton", "aiter", "sdpa", "scaled_mm")
# Triton's kernels run on a CPU only under its interpreter (tests), where time means
# nothing: a CPU measures its own candidates, which differ in linear only (SDPA's
# attention lost to the reference at every class on the 2-core EPYC, and measuring
# attention there took seconds of start-up), so a first start measures ~100 ms.
CPU_CANDIDATES = ("torch", "cpu_slab")


def default_candidates(device: torch.device | str) -> tuple[str, ...]:
    return GPU_CANDIDATES if torch.device(device).type == "cuda" else CPU_CANDIDATES


def load_candidates(names=GPU_CANDIDATES) -> dict[str, object]:
    """Every candidate backend that constructs here (others are skipped, logged)."""
    out: dict[str, object] = {}
    for name in names:
        try:
            if name == "torch":
                out[name] = TorchBackend()
            elif name == "sdpa":
                out[name] = SdpaBackend()
            elif name == "cpu_slab":
                out[name] = CpuSlabBackend()
            elif name == "scaled_mm":
                # lazy: an FP8-only candidate that refuses to build off NVIDIA sm_89+
                from services.kernels.scaled_mm_backend import ScaledMMBackend

                out[name] = ScaledMMBackend()
            elif name == "triton":
                # lazy: triton is an optional, heavy import (absent on CPU-only installs)
                from services.kernels.triton_backend import TritonBackend

                out[name] = TritonBackend()
            elif name == "aiter":
                # lazy: aiter (or its shims over triton) is optional and heavy
                from services.kernels.aiter_backend import AiterBackend

                out[name] = AiterBackend(use_triton_gemm=True)
            else:
                raise ValueError(f"unknown kernel candidate {name!r}")
        except Exception as exc:  # missing package, ROCm-only import, ...
            log.info("kernel candidate %s unavailable: %s", name, exc)
    return out


# ---- measurement ----------------------------------------------------------------------
def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    # the choice depends on the CPU model and how many threads share the work
    return f"cpu {cpu_model()} {torch.get_num_threads()} threads"


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine() or "unknown"


def _versions() -> dict[str, str]:
    out = {"torch": torch.__version__, "tuner": str(TUNER_VERSION)}
    for dist in ("triton", "amd-aiter"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            pass
    return out


def _cache_key(
    shapes: KernelShapes, sizes: TuningSizes, device_name: str, names, graphs: bool
) -> str:
    return json.dumps(
        {
            "device": device_name,
            "graphs": graphs,
            "shapes": asdict(shapes),
            "sizes": asdict(sizes),
            "versions": _versions(),
            "candidates": sorted(names),
            "interpreted": os.environ.get("TRITON_INTERPRET") == "1",
        },
        sort_keys=True,
    )


def cache_file(device_name: str, cache_dir: Path | None = None) -> Path:
    """<dir>/<gpu model>.json; dir: cache_dir.kernel_tuning_dir() unless given."""
    if cache_dir is None:
        cache_dir = kernel_tuning_dir()
    slug = "".join(ch if ch.isalnum() else "-" for ch in device_name.lower()).strip("-")
    return cache_dir / f"{slug or 'device'}.json"


def tune(
    shapes: KernelShapes,
    device: torch.device | str,
    *,
    candidates: dict[str, object] | None = None,
    sizes: TuningSizes | None = None,
    cache_dir: Path | None = None,
    retune: bool = False,
    graphs: bool | None = None,
) -> TuningResult:
    """The fastest correct candidate per op and class: from the cache when this exact
    device/shape/version combination was measured before, else measured (and saved).
    Defaults by device: a GPU times its candidates at GPU sizes, decode classes as
    CUDA-graph replays of capture-safe candidates only; a CPU its own candidates at
    TuningSizes.cpu(). graphs=True keeps the capture-safe rule on a CPU (tests)."""
    device = torch.device(device)
    sizes = sizes or (TuningSizes() if device.type == "cuda" else TuningSizes.cpu())
    if candidates is None:
        candidates = load_candidates(default_candidates(device))
    graphs = device.type == "cuda" if graphs is None else graphs
    name = _device_name(device)
    key = _cache_key(shapes, sizes, name, candidates, graphs)
    path = cache_file(name, cache_dir)
    if not retune:
        cached = _read_cache(path).get(key)
        if cached is not None and set(cached["choices"]) == all_keys(shapes):
            return TuningResult(**cached, from_cache=True)
    with _on_device(device):
        result = _measure(shapes, sizes, device, candidates, graphs)
    result.device_name = name
    result.measured_at = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    _write_cache(path, key, result)
    return result


def _measure(shapes, sizes, device, candidates, graphs: bool) -> TuningResult:
    result = TuningResult(choices={}, times_us={})
    tol = REL_TOL[shapes.torch_dtype]
    reference = candidates.get("torch") or load_candidates(("torch",))["torch"]
    for op in ops_for(shapes):
        for cls in OP_CLASSES[op]:
            key = f"{op}.{cls}"
            graph = graphs and device.type == "cuda" and cls in GRAPH_CLASSES
            names = candidates_for(op, cls, graphs)
            if device.type == "cpu" and [n for n in names if n in candidates] == ["torch"]:
                # nothing to compare the reference with (a CPU's elementwise ops)
                result.choices[key], result.times_us[key] = "torch", {}
                continue
            ref_out = _run_case(op, cls, shapes, sizes, device, torch.float32, reference)[1]
            times, rejected, best_config = {}, {}, {}
            for cand in names:
                backend = candidates.get(cand)
                if backend is None:
                    continue
                configs = [None]
                if (op, cand) in TUNED_CONFIG_CANDIDATES:
                    configs = _launch_configs(op, cls, shapes, sizes, device, best_config)
                for cfg in configs:
                    try:
                        call, out = _run_case(
                            op, cls, shapes, sizes, device, shapes.torch_dtype, backend, cfg
                        )
                        err = _rel_err(out, ref_out)
                        if not err <= tol:
                            rejected[cand] = f"relative error {err:.3g} > {tol:g}"
                            continue
                        t = _time_graph_us(call) if graph else _time_us(call, device)
                    except Exception as exc:  # a kernel that cannot run these shapes here
                        rejected[cand] = f"{type(exc).__name__}: {exc}"[:200]
                        continue
                    if t < times.get(cand, float("inf")):
                        times[cand] = t
                        if cfg is not None:
                            best_config[cand] = cfg
                if cand in times:  # a config that failed does not reject one that ran
                    rejected.pop(cand, None)
            result.times_us[key] = times
            if rejected:
                result.rejected[key] = rejected
            if times:
                result.choices[key] = min(times, key=times.get)
                if result.choices[key] in best_config:
                    result.configs[key] = best_config[result.choices[key]]
            else:  # nothing measurable here: the reference, or triton where it cannot run
                result.choices[key] = "torch" if "torch" in names else "triton"
            log.info("kernel tuner %s: %s %s", key, result.choices[key], times)
    return result


def _launch_configs(op, cls, shapes, sizes, device, best_so_far: dict) -> list[dict]:
    """The launch settings timed for a TUNED_CONFIG_CANDIDATES kernel. pdserve's own
    kernel: the neighbourhood of its default (candidate_configs) on a GPU. Other
    kernels of the op (aiter's): the default and the best config found so far, not a
    sweep of their own (each config is a compilation at start). Off a GPU the default
    alone: the CPU runs Triton's interpreter, where timing says nothing about tiles."""
    # lazy: triton is an optional, heavy import
    from services.kernels.triton.moe import candidate_configs, default_config

    args = (
        sizes.tokens(cls),
        shapes.num_experts,
        shapes.hidden_size,
        shapes.moe_intermediate_size,
        shapes.top_k,
        shapes.torch_dtype,
    )
    default = default_config(*args)
    if device.type != "cuda":
        return [default]
    if not best_so_far:
        return candidate_configs(*args)
    best = next(iter(best_so_far.values()))
    if best == default or best.get("kernel") == "gemv":  # the GEMV path is pdserve's own
        return [default]
    return [default, best]


def _rel_err(out, ref) -> float:
    outs = out if isinstance(out, (tuple, list)) else (out,)
    refs = ref if isinstance(ref, (tuple, list)) else (ref,)
    worst = 0.0
    for o, r in zip(outs, refs):
        o, r = o.float().cpu(), r.float().cpu()
        if o.shape != r.shape or not torch.isfinite(o).all():
            return float("inf")
        worst = max(worst, float((o - r).norm() / r.norm().clamp_min(1e-12)))
    return worst


def _time_us(fn: Callable[[], object], device: torch.device) -> float:
    if device.type == "cuda":
        try:  # lazy: triton is optional and heavy (else CUDA events time it, below)
            from triton.testing import do_bench

            return do_bench(fn, warmup=5, rep=20) * 1e3
        except ImportError:
            pass
        fn()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(20):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) * 1e3 / 20
    fn()
    samples = []
    for _ in range(3):
        t = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t)
    return statistics.median(samples) * 1e6


def _time_graph_us(fn: Callable[[], object], calls: int = 10, replays: int = 20) -> float:
    """Kernel time as a captured decode step sees it: no Python launch overhead."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return replay_ms(graph, replays) * 1e3 / calls


def replay_ms(graph: torch.cuda.CUDAGraph, replays: int = 20) -> float:
    """Milliseconds per replay of a captured graph, back to back, after one warm-up."""
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / replays


# ---- representative inputs -------------------------------------------------------------
def _run_case(
    op, cls, shapes: KernelShapes, sizes: TuningSizes, device, dtype, backend, config=None
):
    """Build the op's inputs (same seed for every candidate and dtype), run it once;
    returns (a no-argument callable that runs it again, the first output). config:
    launch settings for a TUNED_CONFIG_CANDIDATES kernel."""
    gen = torch.Generator().manual_seed(zlib.crc32(f"{op}.{cls}".encode()))

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(device=device, dtype=dtype)

    n = sizes.tokens(cls)
    h, eps = shapes.hidden_size, shapes.rms_norm_eps
    hq, hk, d = shapes.num_q_heads, shapes.num_kv_heads, shapes.head_dim
    if op == "linear":
        layers = []
        for fan_in, fan_out in shapes.linear_shapes():
            layer = torch.nn.Linear(fan_in, fan_out, bias=False, device="meta")
            layer.weight = torch.nn.Parameter(rand(fan_out, fan_in, scale=fan_in**-0.5), False)
            layers.append((rand(n, fan_in), layer))

        def call():
            return [backend.linear(x, layer) for x, layer in layers]
    elif op == "fp8_linear":
        fmt = shapes.fp8_format()
        layers = [
            (rand(n, k), _random_fp8_layer(k, out, fmt, gen, device))
            for k, out in shapes.linear_shapes()
        ]

        def call():
            return [backend.linear(x, layer) for x, layer in layers]
    elif op == "rms_norm":
        x, w = rand(n, h), rand(h)

        def call():
            return backend.rms_norm(x, w, eps)
    elif op == "fused_add_rms_norm":
        x, r, w = rand(n, h), rand(n, h), rand(h)

        def call():
            return backend.fused_add_rms_norm(x, r, w, eps)
    elif op == "rotary_embedding":
        q, k = rand(n, hq, d), rand(n, hk, d)
        max_pos = 4 * n
        angles = torch.arange(max_pos).unsqueeze(1) * torch.rand(d // 2, generator=gen)
        cos_sin = torch.cat([angles.cos(), angles.sin()], dim=-1).to(device=device, dtype=dtype)
        positions = torch.randint(0, max_pos, (n,), generator=gen).to(device)

        def call():
            return backend.rotary_embedding(positions, q, k, cos_sin)
    elif op == "silu_and_mul":
        x = rand(n, 2 * shapes.intermediate_size)

        def call():
            return backend.silu_and_mul(x)
    elif op == "fused_moe":
        e, k, inter = shapes.num_experts, shapes.top_k, shapes.moe_intermediate_size
        x = rand(n, h)
        w13, w2 = rand(e, 2 * inter, h, scale=h**-0.5), rand(e, h, inter, scale=inter**-0.5)
        # each row a permutation of distinct logits that every dtype holds exactly: the
        # same experts win in bf16 as in the fp32 reference (no near-ties to flip)
        ranks = torch.argsort(torch.rand(n, e, generator=gen), dim=-1).float()
        logits = (ranks * 0.25).to(device=device, dtype=dtype)

        kwargs = {} if config is None else {"config": config}

        def call():
            return backend.fused_moe(x, logits, w13, w2, k, True, **kwargs)
    elif op == "store_kv_cache":
        bs = shapes.block_size
        num_blocks = -(-n // bs) * 2 + 1
        k, v = rand(n, hk, d), rand(n, hk, d)
        kv_dtype, kv_scales = _kv_cache_case(shapes, dtype)
        if kv_scales:  # FP8: the reference quantizes the very values the candidate sees
            k, v = (t.to(shapes.torch_dtype).to(dtype) for t in (k, v))
        cache = torch.zeros(num_blocks, 2, bs, hk, d, device=device, dtype=kv_dtype)
        slots = torch.randperm(num_blocks * bs, generator=gen)[:n].to(device)

        def call():
            backend.store_kv_cache(k, v, cache[:, 0], cache[:, 1], slots, *kv_scales)
            return cache
    else:
        q, k_cache, v_cache, meta = _attention_batch(cls, shapes, sizes, device, dtype, gen)
        backend.prepare_attention(meta)
        scale = d**-0.5
        kv_scales = _kv_cache_case(shapes, dtype)[1]

        def call():
            return backend.paged_attention(q, k_cache, v_cache, meta, scale, *kv_scales)

    out = call()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return call, out


def _kv_cache_case(shapes: KernelShapes, dtype) -> tuple[torch.dtype, tuple[float, ...]]:
    """The KV cache dtype and (k_scale, v_scale) the KV ops are measured with: an FP8
    cache gets scales other than 1.0 (powers of two: exact in every dtype), so a
    candidate that ignores them strays from the reference and is rejected."""
    if shapes.kv_cache_dtype == "fp8_e4m3":
        return FP8_KV_DTYPE, (0.5, 2.0)
    return dtype, ()


class _Fp8Layer(torch.nn.Module):
    """What FP8 kernels read of a quantized linear (services/models/fp8_linear.py's
    Fp8Linear; the kernels package does not import models): weight, weight_scale,
    bias and the fp8_format attribute."""

    def __init__(self, weight, weight_scale, fmt):
        super().__init__()
        self.weight = torch.nn.Parameter(weight, requires_grad=False)
        self.weight_scale = torch.nn.Parameter(weight_scale, requires_grad=False)
        self.register_parameter("bias", None)
        self.fp8_format = fmt


def _random_fp8_layer(k: int, n: int, fmt, gen, device) -> _Fp8Layer:
    """Weights uniform in +-k**-0.5 once dequantized, as dummy FP8 weights are."""
    from services.kernels.fp8 import FP8_DTYPE, FP8_MAX

    weight = (torch.rand(n, k, generator=gen) * 2 - 1) * FP8_MAX
    scale = torch.full(fmt.scale_shape(n, k), k**-0.5 / FP8_MAX)
    return _Fp8Layer(weight.to(FP8_DTYPE).to(device), scale.to(device), fmt)


def _attention_batch(cls, shapes, sizes, device, dtype, gen):
    if cls in DECODE_CLASSES:
        n = sizes.tokens(cls)
        q_lens, ctx = [1] * n, [sizes.decode_ctx] * n
    elif cls == "prefill":
        q_lens, ctx = [sizes.prefill_len] * sizes.prefill_seqs, [0] * sizes.prefill_seqs
    else:  # one chunk after a cached prefix, riding along with decodes
        decodes = max(1, sizes.tokens("decode64") - 1)
        q_lens = [sizes.mixed_chunk] + [1] * decodes
        ctx = [sizes.mixed_chunk] + [sizes.decode_ctx] * decodes
    bs = shapes.block_size
    seq_lens = [c + q for c, q in zip(ctx, q_lens)]
    per_seq = [-(-s // bs) for s in seq_lens]
    num_blocks = sum(per_seq) + 1
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables, i = [], 0
    for nb in per_seq:
        tables.append(perm[i : i + nb])
        i += nb
    width = max(per_seq)
    hk, d = shapes.num_kv_heads, shapes.head_dim
    # the engine's block-major cache: per-layer K/V are strided views
    kv_dtype = _kv_cache_case(shapes, dtype)[0]  # FP8: the same bytes for every candidate
    kv = (torch.randn(num_blocks, 2, 2, bs, hk, d, generator=gen)).to(device=device, dtype=kv_dtype)
    cu = [0]
    for n in q_lens:
        cu.append(cu[-1] + n)
    slots = [
        t[p // bs] * bs + p % bs for t, c, n in zip(tables, ctx, q_lens) for p in range(c, c + n)
    ]
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        cu_seqlens_q=torch.tensor(cu, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=torch.tensor(
            [t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=device
        ),
        max_query_len=max(q_lens),
        max_seq_len=max(seq_lens),
        block_size=bs,
        cu_seqlens_q_cpu=cu,
        seq_lens_cpu=seq_lens,
    )
    q = torch.randn(cu[-1], shapes.num_q_heads, d, generator=gen).to(device=device, dtype=dtype)
    return q, kv[:, 1, 0], kv[:, 1, 1], meta


# ---- cache file ------------------------------------------------------------------------
def _read_cache(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _write_cache(path: Path, key: str, result: TuningResult) -> None:
    entry = {
        "choices": result.choices,
        "times_us": result.times_us,
        "rejected": result.rejected,
        "configs": result.configs,
        "device_name": result.device_name,
        "measured_at": result.measured_at,
    }
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path.with_suffix(".lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # two workers starting together
            data = _read_cache(path)
            data[key] = entry
            tmp = path.with_suffix(f".tmp{os.getpid()}")
            tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
            tmp.replace(path)
    except OSError as exc:  # a read-only home must not stop the worker
        log.warning("could not save kernel tuning to %s: %s", path, exc)


def _on_device(device: torch.device):
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()
