"""The tuned backend's vocabulary: the operations, their shape classes, the candidate
backends each may run on, what a model's kernels look like (KernelShapes) and the
"op[.class]=candidate" override syntax. The engine and the tuned backend read this;
the measuring lives in tuner.py.

Shape classes: by the step's token count, "decode1", "decode8", "decode64", "decode256"
(decode-sized batches up to that many tokens, which run as CUDA-graph replays; the gap
between candidates changes with batch size, e.g. AITER's paged attention is within 5%
of ours at 2 sequences and 40% slower at 128) and "prefill" (larger, eager). Attention
splits decode batches the same way (one query per sequence) and otherwise into
"prefill" (every sequence has several queries) and "mixed". Only candidates that are
safe to capture with padded rows are allowed for the decode classes."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from services.kernels.fp8 import Fp8Format, experts_fit_fp8
from services.kernels.interface import AttentionMetadata

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
    "fused_moe": _TOKEN_CLASSES,
    # linear on FP8 weights (services/kernels/fp8.py); unquantized layers stay `linear`
    "fp8_linear": _TOKEN_CLASSES,
}
# ops only some models run: a dense model needs no choice for them
MOE_OPS = ("fused_moe",)
FP8_OPS = ("fp8_linear",)
CANDIDATES: dict[str, tuple[str, ...]] = {
    # own triton has a GEMV only (see ONLY_FOR); aiter's is gemm_a16w16; cpu_slab and
    # cpu_onednn: the CPU's per-thread weight slabs and prepacked oneDNN weights
    # (cpu_backend.py)
    "linear": ("torch", "triton", "aiter", "cpu_slab", "cpu_onednn"),
    # cpu_native: the CPU's small ops in C (cpu_native/kernels.c)
    "paged_attention": ("torch", "triton", "aiter", "sdpa", "cpu_native"),
    "rms_norm": ("torch", "triton", "aiter", "cpu_native"),
    "fused_add_rms_norm": ("torch", "triton", "aiter", "cpu_native"),
    "rotary_embedding": ("torch", "triton", "aiter", "cpu_native"),
    # AITER has no plain SiLU-and-mul or KV write: its backend runs pdserve's triton ones
    "silu_and_mul": ("torch", "triton", "cpu_native"),
    "store_kv_cache": ("torch", "triton", "cpu_native"),
    # triton and aiter: each timed at a few launch configs (TUNED_CONFIG_CANDIDATES)
    "fused_moe": ("torch", "triton", "aiter"),
    # scaled_mm: cuBLASLt through torch._scaled_mm (channel / tensor scales, sm_89+)
    "fp8_linear": ("torch", "triton", "aiter", "scaled_mm"),
}
DEFAULT_CANDIDATES = ("torch", "triton", "aiter")
# (op, candidate) pairs whose launch settings (tiles, warps, stages) the tuner also
# picks per class and GPU; the tuned backend passes the pick as `config=`.
TUNED_CONFIG_CANDIDATES = {
    ("fused_moe", "triton"),
    ("fused_moe", "aiter"),
    ("linear", "triton"),  # one row: the GEMV's K-loop depth (row_stages)
    ("fp8_linear", "triton"),
}
# Candidates that are timed only for some classes of an op: own triton's linear runs
# its GEMV up to 8 rows and cuBLAS above, where it would only time torch again.
ONLY_FOR: dict[str, dict[str, tuple[str, ...]]] = {"linear": {"triton": ("decode1", "decode8")}}
# Captured decode graphs pad the batch with rows whose slot is -1: the torch reference
# would write those into the last cache slot, and sdpa needs host lengths. The torch
# fused_moe reference loops over the experts it finds on the host.
NOT_GRAPH_SAFE = {
    "store_kv_cache": {"torch"},
    "paged_attention": {"torch", "sdpa", "cpu_native"},
    "fused_moe": {"torch"},
}
GRAPH_CLASSES = tuple(DECODE_CLASSES)
# Mixed steps (prefill chunks + decode rows) captured as graphs run attention at an
# upper-bound query length; pdserve's kernel is written for that (its grid depends on
# shapes only), other attention kernels are not known to be.
MIXED_GRAPH_ATTENTION = ("triton",)


def mixed_graph_blocker(choices: dict[str, str], token_counts) -> str | None:
    """Why mixed steps of these token counts cannot be captured with these picks
    ({"op.class": candidate}), or None when they can."""
    attention = choices.get("paged_attention.mixed")
    if attention not in MIXED_GRAPH_ATTENTION:
        return f"paged_attention.mixed runs on {attention!r}, not {MIXED_GRAPH_ATTENTION}"
    return graph_blocker(choices, token_counts)


def graph_blocker(choices: dict[str, str], token_counts) -> str | None:
    """Why a captured step of these token counts would run a pick that cannot be
    captured (decode batches past the largest decode class take the prefill class's
    picks, which an explicit override may have set to one), or None."""
    classes = {token_class(n) for n in token_counts}
    for key, name in sorted(choices.items()):
        op, _, cls = key.partition(".")
        if cls in classes and name in NOT_GRAPH_SAFE.get(op, ()):
            return f"{key} runs on {name!r}, which cannot be captured"
    return None


def ops_for(shapes: KernelShapes | None = None) -> list[str]:
    """The ops a model with these shapes runs (None: a dense model)."""
    moe = shapes is not None and shapes.num_experts > 0
    fp8 = shapes is not None and bool(shapes.weight_quant)
    return [op for op in OP_CLASSES if (moe or op not in MOE_OPS) and (fp8 or op not in FP8_OPS)]


def all_keys(shapes: KernelShapes | None = None) -> set[str]:
    """Every "op.class" a tuned backend for these shapes needs a choice for."""
    return {f"{op}.{c}" for op in ops_for(shapes) for c in OP_CLASSES[op]}


def candidates_for(
    op: str, cls: str, graphs: bool = True, mixed_graphs: bool = False
) -> tuple[str, ...]:
    """The candidates for one op and class; graphs: decode classes run as CUDA-graph
    replays (a GPU), so only capture-safe candidates (a CPU has no graphs).
    mixed_graphs: mixed steps run as graphs too, so the prefill token class (and the
    mixed attention class: MIXED_GRAPH_ATTENTION) keep only what they can capture. The
    tuner picks that way on a GPU; an explicit override may still choose otherwise,
    and mixed steps then run eagerly (mixed_graph_blocker says why)."""
    names = CANDIDATES.get(op, DEFAULT_CANDIDATES)
    only = ONLY_FOR.get(op, {})
    names = tuple(n for n in names if cls in only.get(n, (cls,)))
    captured = cls in GRAPH_CLASSES or (
        mixed_graphs and cls == "prefill" and op != "paged_attention"
    )
    if graphs and captured:
        names = tuple(n for n in names if n not in NOT_GRAPH_SAFE.get(op, ()))
    if graphs and mixed_graphs and (op, cls) == ("paged_attention", "mixed"):
        names = tuple(n for n in names if n in MIXED_GRAPH_ATTENTION)
    return names


def token_class(num_tokens: int) -> str:
    for name, limit in DECODE_CLASSES.items():
        if num_tokens <= limit:
            return name
    return "prefill"


def attention_class(metadata: AttentionMetadata) -> str:
    if metadata.max_query_len == 1:
        # beyond 256 sequences the largest decode class still fits (its picks are
        # capture-safe, as graphs of up to --max-cudagraph-capture-size need)
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
    # mixtures of experts (0: dense): experts, experts per token, an expert's MLP width
    num_experts: int = 0
    top_k: int = 0
    moe_intermediate_size: int = 0
    # "auto" (the KV cache in `dtype`) or "fp8_e4m3": the KV write and attention are
    # measured on a scaled float8_e4m3fn cache, so no candidate that misreads it is kept
    kv_cache_dtype: str = "auto"
    # FP8 linear weights: "" (none), "fp8_channel", "fp8_tensor" or "fp8_block_<n>x<k>"
    # (weight_quant_tag); fp8_linear is then measured on weights of that format
    weight_quant: str = ""
    # MoE experts kept in FP8 (block checkpoints whose blocks tile the expert sizes,
    # fp8.experts_fit_fp8): fused_moe is then measured on FP8 experts of that format
    fp8_experts: bool = False
    # decoder layers: a CPU times decode-sized linears over this many layers' weights,
    # the working set a decode step streams (tuner_cases.py)
    num_layers: int = 1

    def __post_init__(self):
        for name in ("hidden_size", "num_q_heads", "num_kv_heads", "head_dim", "num_layers"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive")
        if self.intermediate_size < 1 or self.block_size < 1:
            raise ValueError("intermediate_size and block_size must be positive")
        if self.num_q_heads % self.num_kv_heads:
            raise ValueError("num_q_heads must be a multiple of num_kv_heads")
        if self.dtype not in ("bfloat16", "float16", "float32"):
            raise ValueError(f"unsupported dtype {self.dtype!r}")
        if self.kv_cache_dtype not in ("auto", "fp8_e4m3"):
            raise ValueError(
                f"kv_cache_dtype must be 'auto' or 'fp8_e4m3', got {self.kv_cache_dtype!r}"
            )
        if self.weight_quant:
            self.fp8_format()  # raises ValueError for an unknown tag
        if self.num_experts and not (
            0 < self.top_k <= self.num_experts and self.moe_intermediate_size > 0
        ):
            raise ValueError(
                "a MoE needs 0 < top_k <= num_experts and a positive moe_intermediate_size"
            )
        if self.fp8_experts and not (
            self.num_experts
            and experts_fit_fp8(
                self.expert_fp8_format(), self.hidden_size, self.moe_intermediate_size
            )
        ):
            raise ValueError(
                "fp8_experts needs a MoE and a block weight_quant whose blocks tile its sizes"
            )

    @classmethod
    def from_hf_config(
        cls,
        hf_config,
        block_size: int,
        dtype: str,
        kv_cache_dtype: str = "auto",
        weight_quant: str = "",
        tp_size: int = 1,
        fp8_experts: bool = False,
    ) -> KernelShapes:
        """One tensor-parallel rank's shapes: its query and KV heads (one KV head when
        there are more ranks than KV heads) and its share of the MLP widths."""
        heads = hf_config.num_attention_heads
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
        # Qwen3-MoE: num_experts / moe_intermediate_size; Mixtral: num_local_experts and
        # its experts are intermediate_size wide
        experts = getattr(hf_config, "num_experts", None) or getattr(
            hf_config, "num_local_experts", 0
        )
        moe = dict(
            num_experts=experts or 0,
            top_k=getattr(hf_config, "num_experts_per_tok", 0) if experts else 0,
            moe_intermediate_size=(
                getattr(hf_config, "moe_intermediate_size", None) or hf_config.intermediate_size
            )
            // tp_size
            if experts
            else 0,
        )
        kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
        return cls(
            hidden_size=hf_config.hidden_size,
            num_q_heads=heads // tp_size,
            num_kv_heads=max(1, kv_heads // tp_size),
            head_dim=head_dim,
            intermediate_size=hf_config.intermediate_size // tp_size,
            block_size=block_size,
            dtype=dtype,
            rms_norm_eps=float(getattr(hf_config, "rms_norm_eps", 1e-5)),
            **moe,
            kv_cache_dtype=kv_cache_dtype,
            weight_quant=weight_quant,
            fp8_experts=fp8_experts,
            num_layers=hf_config.num_hidden_layers,
        )

    def fp8_format(self) -> Fp8Format | None:
        """The FP8 weight format weight_quant names (None when unquantized)."""
        if not self.weight_quant:
            return None
        tag = self.weight_quant
        if tag in ("fp8_channel", "fp8_tensor"):
            return Fp8Format(tag.removeprefix("fp8_"))
        n, sep, k = tag.removeprefix("fp8_block_").partition("x")
        if tag.startswith("fp8_block_") and sep and n.isdigit() and k.isdigit():
            return Fp8Format("block", int(n), int(k))
        raise ValueError(
            f"weight_quant {tag!r}: expected '', 'fp8_channel', 'fp8_tensor' or 'fp8_block_<n>x<k>'"
        )

    def expert_fp8_format(self) -> Fp8Format | None:
        """The format FP8 experts take: block as the weights, else channel (a per-tensor
        checkpoint's experts keep a scale per row, as its fused layers do)."""
        fmt = self.fp8_format()
        if fmt is None or fmt.granularity == "block":
            return fmt
        return Fp8Format("channel")

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    def linear_shapes(self) -> list[tuple[int, int]]:
        """(in, out) of the fused projections one decoder layer runs."""
        q, kv = self.num_q_heads * self.head_dim, self.num_kv_heads * self.head_dim
        h, i = self.hidden_size, self.intermediate_size
        return [(h, q + 2 * kv), (q, h), (h, 2 * i), (i, h)]


# ---- overrides ----------------------------------------------------------------------
def parse_choices(spec: str | dict | None, graphs: bool = True) -> dict[str, str]:
    """ "op[.class]=candidate,..." (or a dict of the same) -> {"op.class": candidate}.
    An op without a class applies to all its classes. graphs: decode classes take only
    capture-safe candidates (a GPU); a CPU runs no graphs and may pick any."""
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
            allowed = candidates_for(op, c, graphs)
            if name not in allowed:
                raise ValueError(f"{name!r} is not a candidate for {op}.{c}; choose from {allowed}")
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


def weight_quant_tag(fmt: Fp8Format | None) -> str:
    """KernelShapes.weight_quant for layers of this FP8 format ("" for None)."""
    if fmt is None:
        return ""
    if fmt.granularity == "block":
        return f"fp8_block_{fmt.block_n}x{fmt.block_k}"
    return f"fp8_{fmt.granularity}"
