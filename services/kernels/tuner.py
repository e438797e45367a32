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
import ctypes
import fcntl
import functools
import json
import logging
import os
import time
from dataclasses import asdict, dataclass, field
from importlib import metadata
from pathlib import Path

import torch

from services.kernels.cache_dir import kernel_tuning_dir
from services.kernels.candidates import default_candidates, load_candidates
from services.kernels.cpu_info import cpu_flags_digest, cpu_model
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
from services.kernels.timing import cpu_runoff, time_graph_us, time_us
from services.kernels.tuner_cases import rel_err, run_case
from services.kernels.tuner_prequant import tune_prequant
from services.kernels.weight_copies import keep_one_weight_copy

log = logging.getLogger(__name__)

TUNER_VERSION = 15  # 15: one CPU weight copy; 14: FP8 prequant per GPU; 13: a 16-row FP8 one-row tile; 12: one-row GEMVs' folded wide tiles; 11: one-row GEMVs' and MoE GEMVs' K-loop depth; 10: CPU runoffs; 9: prepacked oneDNN linear on CPU; 8: cuBLASLt block FP8 (scaled_mm), FP8 experts; 7: capture-safe picks for mixed-step graphs; 6: fused_moe launch configs, aiter MoE; 5: fused_moe; 4: decode1 class
# Relative Frobenius error allowed against the fp32 torch reference.
REL_TOL = {torch.float32: 1e-3, torch.float16: 1e-2, torch.bfloat16: 3e-2}
# A CPU candidate whose first timed call takes this many times the best so far is
# clocked at that call (it cannot win; its further samples only slow the start-up).
CPU_GIVE_UP = 3.0


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
    # "op.class" -> the two candidates a CPU runoff timed again (their times_us are the
    # runoff's)
    runoffs: dict[str, list[str]] = field(default_factory=dict)
    # "op.class" -> the faster candidate it had before keep_one_weight_copy (weight_copies.py)
    one_copy: dict[str, str] = field(default_factory=dict)
    # fp8_linear.decode1's prequant modes timed (tuner_prequant.py): mode -> microseconds
    prequant_us: dict[str, float] = field(default_factory=dict)
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
            if key in self.runoffs:
                choice += " (runoff)"
            if key in self.one_copy:
                choice += f" (one weight copy: not {self.one_copy[key]})"
            lines.append(f"| {op} | {cls} | " + " | ".join(cells) + f" | {choice} | {speedup} |")
        return "\n".join(lines)


def config_label(cfg: dict) -> str:
    """Launch settings in a table cell: M x N x K tiles, group, warps, stages (GEMV
    path: N x K blocks, warps)."""
    if cfg.get("kernel") == "gemv":
        stages = "".join(
            f" {tag}{cfg[k]}"
            for k, tag in (("num_stages", "s"), ("down_num_stages", "ds"))
            if k in cfg
        )
        return f"gemv {cfg['BLOCK_N']}x{cfg['BLOCK_K']} w{cfg['num_warps']}{stages}"
    if "row_stages" in cfg or "prequant" in cfg:  # a one-row GEMV's (linear, fp8_linear)
        fold = cfg.get("row_fold")
        tile = "" if fold is None else f" k{fold[0]}f{fold[1]}w{fold[2]}"
        tile += f" n{fold[3]}" if fold is not None and len(fold) == 4 else ""
        prequant = f" pq{cfg['prequant']}" if "prequant" in cfg else ""
        return f"gemv s{cfg.get('row_stages', 1)}{tile}{prequant}"
    return (
        f"{cfg['BLOCK_M']}x{cfg['BLOCK_N']}x{cfg['BLOCK_K']} "
        f"g{cfg['GROUP_M']} w{cfg['num_warps']} s{cfg['num_stages']}"
    )


def _rejected_names(result: TuningResult) -> set[str]:
    return {c for r in result.rejected.values() for c in r}


# ---- measurement ----------------------------------------------------------------------
def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    # the choice depends on the CPU model and how many threads share the work
    return f"cpu {cpu_model()} {torch.get_num_threads()} threads"


def _versions() -> dict[str, str]:
    out = {"torch": torch.__version__, "tuner": str(TUNER_VERSION)}
    for dist in ("triton", "amd-aiter"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            pass
    return out


def _cache_key(
    shapes: KernelShapes,
    sizes: TuningSizes,
    device: torch.device,
    device_name: str,
    names,
    graphs: bool,
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
            # a VM's CPU name hides what the CPU can do: its flags are part of the key
            "cpu_flags": cpu_flags_digest() if device.type == "cpu" else None,
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
    key = _cache_key(shapes, sizes, device, name, candidates, graphs)
    path = cache_file(name, cache_dir)
    if not retune:
        cached = _read_cache(path).get(key)
        if cached is not None and set(cached["choices"]) == all_keys(shapes):
            return TuningResult(**cached, from_cache=True)
    with _on_device(device):
        result = _measure(shapes, sizes, device, candidates, graphs)
    if device.type == "cpu":
        _trim_heap()
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
            names = candidates_for(op, cls, graphs, mixed_graphs=graphs)
            if device.type == "cpu" and [n for n in names if n in candidates] == ["torch"]:
                # nothing to compare the reference with (a CPU's elementwise ops)
                result.choices[key], result.times_us[key] = "torch", {}
                continue
            ref_out = run_case(op, cls, shapes, sizes, device, torch.float32, reference)[1]
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
                        call, out = run_case(
                            op, cls, shapes, sizes, device, shapes.torch_dtype, backend, cfg
                        )
                        err = rel_err(out, ref_out)
                        if not err <= tol:
                            rejected[cand] = f"relative error {err:.3g} > {tol:g}"
                            continue
                        if graph:
                            t = time_graph_us(call)
                        else:
                            give_up = CPU_GIVE_UP * min(times.values()) if times else None
                            t = time_us(call, device, give_up)
                    except Exception as exc:  # a kernel that cannot run these shapes here
                        rejected[cand] = f"{type(exc).__name__}: {exc}"[:200]
                        continue
                    if t < times.get(cand, float("inf")):
                        times[cand] = t
                        if cfg is not None:
                            best_config[cand] = cfg
                if cand in times:  # a config that failed does not reject one that ran
                    rejected.pop(cand, None)
            if device.type == "cpu" and not graph:
                call = out = None  # the last candidate's case: not kept alive meanwhile
                dtype = shapes.torch_dtype
                case = functools.partial(run_case, op, cls, shapes, sizes, device, dtype)
                finalists = cpu_runoff(times, case, candidates, best_config)
                if finalists:
                    result.runoffs[key] = finalists
            result.times_us[key] = times
            if rejected:
                result.rejected[key] = rejected
            if times:
                result.choices[key] = min(times, key=times.get)
                if result.choices[key] in best_config:
                    result.configs[key] = best_config[result.choices[key]]
            else:  # nothing measurable here: the reference, or triton where it cannot run
                result.choices[key] = "torch" if "torch" in names else "triton"
            runoff = f" (runoff of {result.runoffs[key]})" if key in result.runoffs else ""
            log.info("kernel tuner %s: %s %s%s", key, result.choices[key], times, runoff)
            if key == "fp8_linear.decode1" and graph:  # and the norms' FP8 quantization
                args = (result.choices, result.configs.get(key), shapes, device, tol)
                picked = tune_prequant(*args, candidates.get("triton"))
                if picked is not None:
                    result.configs[key], result.prequant_us = picked
    if device.type == "cpu":
        result.one_copy = keep_one_weight_copy(result.choices, result.times_us)
        for key, was in result.one_copy.items():
            log.info("kernel tuner %s: %s, not %s (one weight copy)", key, result.choices[key], was)
    return result


# One decode row's GEMV (linear, fp8_linear): its K loop plain or pipelined this deep
ROW_STAGES = (1, 3)
# ...and [block_k, k_fold, warps[, block_n]] tiles from H100 sweeps (docs/performance.md)
ROW_FOLDS = {"linear": ([2048, 8, 4],), "fp8_linear": ([1024, 16, 4], [2048, 16, 4, 16])}


def _launch_configs(op, cls, shapes, sizes, device, best_so_far: dict) -> list[dict | None]:
    """The launch settings timed for a TUNED_CONFIG_CANDIDATES kernel. Linears: on a
    GPU at decode1 the one-row GEMV at each of ROW_STAGES and with ROW_FOLDS' tiles;
    elsewhere None (the kernel's own defaults). fused_moe: pdserve's own kernel, the
    neighbourhood of its default (candidate_configs) on a GPU. Other kernels of the
    op (aiter's): the default and the best so far, not a sweep of their own (each
    config is a compilation at start). Off a GPU the default alone: the CPU runs
    Triton's interpreter, where timing says nothing about tiles."""
    if op in ("linear", "fp8_linear"):
        if device.type != "cuda" or cls != "decode1":
            return [None]
        folded = [{"row_stages": 1, "row_fold": tile} for tile in ROW_FOLDS[op]]
        return [{"row_stages": s} for s in ROW_STAGES] + folded
    # lazy: triton is an optional, heavy import
    from services.kernels.triton.moe_config import candidate_configs, default_config

    tile_dtype = torch.float8_e4m3fn if shapes.fp8_experts else shapes.torch_dtype
    args = (sizes.tokens(cls), shapes.num_experts, shapes.hidden_size,
            shapes.moe_intermediate_size, shapes.top_k, tile_dtype)  # fmt: skip
    default = default_config(*args)
    if device.type != "cuda":
        return [default]
    if not best_so_far:
        return candidate_configs(*args)
    best = next(iter(best_so_far.values()))
    if best == default or best.get("kernel") == "gemv":  # the GEMV path is pdserve's own
        return [default]
    return [default, best]


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
        "runoffs": result.runoffs,
        "one_copy": result.one_copy,
        "prequant_us": result.prequant_us,
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


def _trim_heap() -> None:
    """Give the CPU measurement's freed tensors back to the OS: glibc keeps freed blocks
    of up to 32 MB in its heap, which left a SmolLM2 worker 1.6 GB larger after tuning."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


def _on_device(device: torch.device):
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()
