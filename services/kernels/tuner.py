"""Pick the fastest kernel per operation and shape class on the running device.

AITER's idea, which ATOM relies on: no backend wins everything (cuBLAS beats Triton
GEMMs on the H200, FlashAttention beats Triton on dense prefill, Triton beats torch on
paged decode), so each operation is timed with every candidate that loads here, at the
model's own shapes, and the fastest correct one is kept. Choices are cached per GPU
model, shapes, dtype and library versions (a JSON file under the pdserve cache dir), so
only the first start on a machine pays for the measurement (~50 s on an H200, mostly
Triton compiling every candidate);
`pdserve tune-kernels` re-measures offline and prints the table.

Shape classes: by the step's token count, "decode1", "decode8", "decode64", "decode256"
(decode-sized batches up to that many tokens, which run as CUDA-graph replays; the gap between
candidates changes with batch size, e.g. AITER's paged attention is within 5% of ours
at 2 sequences and 40% slower at 128)
and "prefill" (larger, eager). Attention splits decode batches the same way (one query
per sequence) and otherwise into "prefill" (every sequence has several queries) and
"mixed". Decode classes are timed as graph replays, and only candidates that are safe
to capture with padded rows are considered for them.

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
from pathlib import Path

import torch

log = logging.getLogger(__name__)

TUNER_VERSION = 4  # 4: decode1 class; own triton's GEMV joins linear.decode1 / decode8
# Decode classes by token count (the largest captured decode batch is 256).
# One sequence is its own class: the latency case, where a GEMV beats cuBLAS most.
DECODE_CLASSES = {"decode1": 1, "decode8": 8, "decode64": 64, "decode256": 256}
_TOKEN_CLASSES = (*DECODE_CLASSES, "prefill")

OP_CLASSES: dict[str, tuple[str, ...]] = {
    "linear": _TOKEN_CLASSES,
    "rms_norm": _TOKEN_CLASSES,
    "fused_add_rms_norm": _TOKEN_CLASSES,
    "rotary_embedding": _TOKEN_CLASSES,
    "silu_and_mul": _TOKEN_CLASSES,
    "store_kv_cache": _TOKEN_CLASSES,
    "paged_attention": (*DECODE_CLASSES, "prefill", "mixed"),
}
CANDIDATES: dict[str, tuple[str, ...]] = {
    # own triton has a GEMV only (see ONLY_FOR); aiter's is gemm_a16w16
    "linear": ("torch", "triton", "aiter"),
    "paged_attention": ("torch", "triton", "aiter", "sdpa"),
    # AITER has no plain SiLU-and-mul or KV write: its backend runs pdserve's triton ones
    "silu_and_mul": ("torch", "triton"),
    "store_kv_cache": ("torch", "triton"),
}
DEFAULT_CANDIDATES = ("torch", "triton", "aiter")
# Candidates that are timed only for some classes of an op: own triton's linear runs
# its GEMV up to 8 rows and cuBLAS above, where it would only time torch again.
ONLY_FOR: dict[str, dict[str, tuple[str, ...]]] = {"linear": {"triton": ("decode1", "decode8")}}
# Captured decode graphs pad the batch with rows whose slot is -1: the torch reference
# would write those into the last cache slot, and sdpa needs host lengths.
NOT_GRAPH_SAFE = {"store_kv_cache": {"torch"}, "paged_attention": {"torch", "sdpa"}}
GRAPH_CLASSES = tuple(DECODE_CLASSES)
# Relative Frobenius error allowed against the fp32 torch reference.
REL_TOL = {torch.float32: 1e-3, torch.float16: 1e-2, torch.bfloat16: 3e-2}


def candidates_for(op: str, cls: str) -> tuple[str, ...]:
    names = CANDIDATES.get(op, DEFAULT_CANDIDATES)
    only = ONLY_FOR.get(op, {})
    names = tuple(n for n in names if cls in only.get(n, (cls,)))
    if cls in GRAPH_CLASSES:
        names = tuple(n for n in names if n not in NOT_GRAPH_SAFE.get(op, ()))
    return names


def token_class(num_tokens: int) -> str:
    for name, limit in DECODE_CLASSES.items():
        if num_tokens <= limit:
            return name
    return "prefill"


def attention_class(metadata) -> str:
    if metadata.max_query_len == 1:
        # beyond 256 sequences (never captured) the largest decode class still fits
        return token_class(min(metadata.block_tables.shape[0], 256))
    cu = metadata.cu_seqlens_q_cpu
    if cu is not None and all(b - a > 1 for a, b in zip(cu, cu[1:])):
        return "prefill"
    return "mixed"


@dataclass(frozen=True)
class KernelShapes:
    """What the kernels see of a model: enough to build representative inputs."""

    hidden_size: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    block_size: int
    dtype: str  # "bfloat16", "float16", "float32"
    rms_norm_eps: float = 1e-5

    def __post_init__(self):
        for name in ("hidden_size", "num_q_heads", "num_kv_heads", "head_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive")
        if self.intermediate_size < 1 or self.block_size < 1:
            raise ValueError("intermediate_size and block_size must be positive")
        if self.num_q_heads % self.num_kv_heads:
            raise ValueError("num_q_heads must be a multiple of num_kv_heads")
        if self.dtype not in ("bfloat16", "float16", "float32"):
            raise ValueError(f"unsupported dtype {self.dtype!r}")

    @classmethod
    def from_hf_config(cls, hf_config, block_size: int, dtype: str) -> KernelShapes:
        heads = hf_config.num_attention_heads
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
        return cls(
            hidden_size=hf_config.hidden_size,
            num_q_heads=heads,
            num_kv_heads=getattr(hf_config, "num_key_value_heads", None) or heads,
            head_dim=head_dim,
            intermediate_size=hf_config.intermediate_size,
            block_size=block_size,
            dtype=dtype,
            rms_norm_eps=float(getattr(hf_config, "rms_norm_eps", 1e-5)),
        )

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    def linear_shapes(self) -> list[tuple[int, int]]:
        """(in, out) of the fused projections one decoder layer runs."""
        q, kv = self.num_q_heads * self.head_dim, self.num_kv_heads * self.head_dim
        h, i = self.hidden_size, self.intermediate_size
        return [(h, q + 2 * kv), (q, h), (h, 2 * i), (i, h)]


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
            lines.append(
                f"| {op} | {cls} | " + " | ".join(cells) + f" | {self.choices[key]} | {speedup} |"
            )
        return "\n".join(lines)


def _rejected_names(result: TuningResult) -> set[str]:
    return {c for r in result.rejected.values() for c in r}


# ---- overrides ----------------------------------------------------------------------
def parse_choices(spec: str | dict | None) -> dict[str, str]:
    """ "op[.class]=candidate,..." (or a dict of the same) -> {"op.class": candidate}.
    An op without a class applies to all its classes."""
    if not spec:
        return {}
    items = spec.items() if isinstance(spec, dict) else _split_pairs(spec)
    out: dict[str, str] = {}
    for key, name in items:
        op, _, cls = key.partition(".")
        if op not in OP_CLASSES:
            raise ValueError(
                f"unknown kernel op {op!r} in kernel choices; known: {sorted(OP_CLASSES)}"
            )
        classes = (cls,) if cls else OP_CLASSES[op]
        for c in classes:
            if c not in OP_CLASSES[op]:
                raise ValueError(f"{op} has classes {OP_CLASSES[op]}, not {c!r}")
            if name not in candidates_for(op, c):
                raise ValueError(
                    f"{name!r} is not a candidate for {op}.{c}; choose from {candidates_for(op, c)}"
                )
            out[f"{op}.{c}"] = name
    return out


def _split_pairs(spec: str):
    for part in spec.split(","):
        part = part.strip()
        if not part:
            continue
        key, eq, name = part.partition("=")
        if not eq or not key.strip() or not name.strip():
            raise ValueError(f"kernel choice {part!r} is not of the form op[.class]=candidate")
        yield key.strip(), name.strip()


# ---- candidates -----------------------------------------------------------------------
def load_candidates(names=("torch", "triton", "aiter", "sdpa")) -> dict[str, object]:
    """Every candidate backend that constructs here (others are skipped, logged)."""
    from services.kernels import get_backend

    out: dict[str, object] = {}
    for name in names:
        try:
            if name == "sdpa":
                from services.kernels.sdpa_backend import SdpaBackend

                out[name] = SdpaBackend()
            elif name == "aiter":
                from services.kernels.aiter_backend import AiterBackend

                out[name] = AiterBackend(use_triton_gemm=True)
            else:
                out[name] = get_backend(name)
        except Exception as exc:  # missing package, ROCm-only import, ...
            log.info("kernel candidate %s unavailable: %s", name, exc)
    return out


# ---- measurement ----------------------------------------------------------------------
def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return "cpu"


def _versions() -> dict[str, str]:
    from importlib import metadata

    out = {"torch": torch.__version__, "tuner": str(TUNER_VERSION)}
    for dist in ("triton", "amd-aiter"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            pass
    return out


def _cache_key(shapes: KernelShapes, sizes: TuningSizes, device_name: str, names) -> str:
    return json.dumps(
        {
            "device": device_name,
            "shapes": asdict(shapes),
            "sizes": asdict(sizes),
            "versions": _versions(),
            "candidates": sorted(names),
            "interpreted": os.environ.get("TRITON_INTERPRET") == "1",
        },
        sort_keys=True,
    )


def cache_file(device_name: str, cache_dir: Path | None = None) -> Path:
    """<dir>/<gpu model>.json; dir: PDSERVE_KERNEL_TUNING_DIR, else PDSERVE_CACHE_DIR's
    kernel_tuning/ (a container whose model cache is read-only points it elsewhere)."""
    from services.models.default_model import cache_root

    if cache_dir is None:
        env = os.environ.get("PDSERVE_KERNEL_TUNING_DIR")
        cache_dir = Path(env) if env else cache_root() / "kernel_tuning"
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
) -> TuningResult:
    """The fastest correct candidate per op and class: from the cache when this exact
    device/shape/version combination was measured before, else measured (and saved)."""
    device = torch.device(device)
    sizes = sizes or TuningSizes()
    candidates = candidates if candidates is not None else load_candidates()
    name = _device_name(device)
    key = _cache_key(shapes, sizes, name, candidates)
    path = cache_file(name, cache_dir)
    if not retune:
        cached = _read_cache(path).get(key)
        if cached is not None and set(cached["choices"]) == _all_keys():
            return TuningResult(**cached, from_cache=True)
    with _on_device(device):
        result = _measure(shapes, sizes, device, candidates)
    result.device_name = name
    result.measured_at = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    _write_cache(path, key, result)
    return result


def _all_keys() -> set[str]:
    return {f"{op}.{c}" for op, classes in OP_CLASSES.items() for c in classes}


def _measure(shapes, sizes, device, candidates) -> TuningResult:
    result = TuningResult(choices={}, times_us={})
    tol = REL_TOL[shapes.torch_dtype]
    reference = candidates.get("torch") or load_candidates(("torch",))["torch"]
    for op, classes in OP_CLASSES.items():
        for cls in classes:
            key = f"{op}.{cls}"
            graph = device.type == "cuda" and cls in GRAPH_CLASSES
            ref_out = _run_case(op, cls, shapes, sizes, device, torch.float32, reference)[1]
            times, rejected = {}, {}
            for cand in candidates_for(op, cls):
                backend = candidates.get(cand)
                if backend is None:
                    continue
                try:
                    call, out = _run_case(
                        op, cls, shapes, sizes, device, shapes.torch_dtype, backend
                    )
                    err = _rel_err(out, ref_out)
                    if not err <= tol:
                        rejected[cand] = f"relative error {err:.3g} > {tol:g}"
                        continue
                    times[cand] = _time_graph_us(call) if graph else _time_us(call, device)
                except Exception as exc:  # a kernel that cannot run these shapes here
                    rejected[cand] = f"{type(exc).__name__}: {exc}"[:200]
            result.times_us[key] = times
            if rejected:
                result.rejected[key] = rejected
            if times:
                result.choices[key] = min(times, key=times.get)
            else:  # nothing measurable here: the reference, or triton where it cannot run
                names = candidates_for(op, cls)
                result.choices[key] = "torch" if "torch" in names else "triton"
            log.info("kernel tuner %s: %s %s", key, result.choices[key], times)
    return result


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
        try:
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
def _run_case(op, cls, shapes: KernelShapes, sizes: TuningSizes, device, dtype, backend):
    """Build the op's inputs (same seed for every candidate and dtype), run it once;
    returns (a no-argument callable that runs it again, the first output)."""
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
    elif op == "store_kv_cache":
        bs = shapes.block_size
        num_blocks = -(-n // bs) * 2 + 1
        k, v = rand(n, hk, d), rand(n, hk, d)
        cache = torch.zeros(num_blocks, 2, bs, hk, d, device=device, dtype=dtype)
        slots = torch.randperm(num_blocks * bs, generator=gen)[:n].to(device)

        def call():
            backend.store_kv_cache(k, v, cache[:, 0], cache[:, 1], slots)
            return cache
    else:
        q, k_cache, v_cache, meta = _attention_batch(cls, shapes, sizes, device, dtype, gen)
        backend.prepare_attention(meta)
        scale = d**-0.5

        def call():
            return backend.paged_attention(q, k_cache, v_cache, meta, scale)

    out = call()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return call, out


def _attention_batch(cls, shapes, sizes, device, dtype, gen):
    from services.kernels.interface import AttentionMetadata

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
    kv = (torch.randn(num_blocks, 2, 2, bs, hk, d, generator=gen)).to(device=device, dtype=dtype)
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


def tuned_backend(shapes: KernelShapes, device, choices=None, **tune_kwargs):
    """A TunedBackend for these shapes on this device; `choices` override the tuner's.
    When the overrides cover every op and class nothing is measured."""
    from services.kernels.tuned_backend import TunedBackend

    overrides = parse_choices(choices)
    if set(overrides) == _all_keys():
        picked = overrides
        backends = load_candidates(tuple(set(picked.values())))
    else:
        backends = load_candidates()
        result = tune(shapes, device, candidates=backends, **tune_kwargs)
        log.info(
            "kernel choices (%s%s):\n%s",
            result.device_name,
            ", cached" if result.from_cache else "",
            result.table(),
        )
        picked = {**result.choices, **overrides}
    missing = {name for name in picked.values() if name not in backends}
    if missing:
        raise ValueError(f"kernel candidates {sorted(missing)} are not available here")
    return TunedBackend(backends, picked)
