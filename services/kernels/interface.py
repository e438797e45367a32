"""The operations a model needs from a kernel backend, and the batch metadata
attention reads. Backends implement every method with these exact semantics; the
torch backend is the reference the others are tested against."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from services.kernels.fp8 import Fp8Experts

# FP8 KV cache (`kv_cache_dtype` fp8_e4m3 / fp8): e4m3 bytes, each layer's K and V with
# one scale of its own (vLLM's k_scale / v_scale). Stored = clamp(x / scale, +-max)
# rounded to nearest even; read = stored * scale. A scale of None means 1.0. The e4m3
# type is OCP float8_e4m3fn (max 448), or float8_e4m3fnuz (max 240) where the platform
# computes in it (MI300: fp8.platform_fp8_dtype); the kernels take either.
FP8_KV_DTYPE = torch.float8_e4m3fn
FP8_KV_DTYPES = (torch.float8_e4m3fn, torch.float8_e4m3fnuz)
FP8_E4M3_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max: larger values saturate


def kv_cache_is_fp8(cache: torch.Tensor, k_scale=None, v_scale=None) -> bool:
    """Whether a cache holds FP8 KV. Raises ValueError for scales given with a cache in a
    wider dtype (they would be ignored) and for 8-bit float formats we do not write."""
    if cache.dtype in FP8_KV_DTYPES:
        return True
    if cache.dtype.itemsize == 1 and cache.dtype.is_floating_point:
        raise ValueError(f"KV cache dtype {cache.dtype} is not supported (only {FP8_KV_DTYPES})")
    if k_scale is not None or v_scale is not None:
        raise ValueError(f"k_scale / v_scale apply to an FP8 KV cache only, not {cache.dtype}")
    return False


@dataclass
class AttentionMetadata:
    """Describes one flattened batch of scheduled tokens (prefill chunks and decodes
    mixed). Sequence i owns query rows cu_seqlens_q[i]:cu_seqlens_q[i+1]; its KV
    context after this step is seq_lens[i] tokens, addressed through block_tables[i]."""

    slot_mapping: torch.Tensor  # [num_tokens] int64: cache slot each new token's KV goes to
    cu_seqlens_q: torch.Tensor  # [num_seqs + 1] int32
    seq_lens: torch.Tensor  # [num_seqs] int32, context length including this step's tokens
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32, padded with 0
    max_query_len: int
    max_seq_len: int
    block_size: int
    # Host copies of cu_seqlens_q / seq_lens, when the caller has them (eager steps).
    # Kernels that split work per sequence read them without a device sync; captured
    # CUDA-graph steps leave them None (their lengths change between replays).
    cu_seqlens_q_cpu: list[int] | None = None
    seq_lens_cpu: list[int] | None = None
    # filled once per step by KernelBackend.prepare_attention, read by every layer
    backend_data: dict = field(default_factory=dict)


class KernelBackend(Protocol):
    name: str

    def linear(self, x: torch.Tensor, layer: torch.nn.Linear) -> torch.Tensor:
        """x @ layer.weight.T + layer.bias; the backend may keep its own weight layout
        on the layer (weights do not change after loading). An FP8 layer
        (fp8.fp8_format_of(layer) is not None: float8_e4m3fn weight, fp32 weight_scale,
        bias in x's dtype) computes fp8.fp8_linear_reference's math: activations
        quantized dynamically as its format says, output in x's dtype."""
        ...

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor: ...

    def fused_add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (rms_norm(x + residual), x + residual)."""
        ...

    def add_rms_norm_linear(
        self,
        x: torch.Tensor,
        residual: torch.Tensor,
        norm_weight: torch.Tensor,
        eps: float,
        layer: torch.nn.Module,
        gated: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(linear(normed, layer), normed, x + residual) for normed =
        fused_add_rms_norm(x, residual, norm_weight, eps)[0]: a layer's norm and the
        first linear that reads it; gated: linear_silu_and_mul(normed, layer) in place of
        the linear. A backend may fold the norm into the linear's kernel (triton: one
        decode row); add_rms_norm_linear_unfused is the definition."""
        ...

    def linear_silu_and_mul(self, x: torch.Tensor, layer: torch.nn.Module) -> torch.Tensor:
        """silu_and_mul(linear(x, layer)) for a gate_up layer (the gate's rows, then the
        up's). A backend may apply the activation in the linear's kernel (triton: one
        decode row); linear_silu_and_mul_unfused is the definition."""
        ...

    def rotary_embedding(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Neox-style (rotate-half) RoPE. q: [T, Hq, D], k: [T, Hk, D];
        cos_sin_cache: [max_pos, D] holding cos in the first D/2 columns, sin in the rest."""
        ...

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, 2I] -> silu(x[:, :I]) * x[:, I:]."""
        ...

    def store_kv_cache(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        k_scale: float | None = None,
        v_scale: float | None = None,
    ) -> None:
        """Write k, v [T, Hk, D] into caches [num_blocks, block_size, Hk, D] (strided
        views are allowed) at the given flat slots (block_id * block_size + offset).
        An FP8 cache (FP8_KV_DTYPES) stores k / k_scale and v / v_scale, clamped to
        its type's max (448, 240 for fnuz) and rounded to nearest even (None: scale
        1.0); scales with any
        other cache dtype are a ValueError (kv_cache_is_fp8)."""
        ...

    def rope_and_store_kv(
        self,
        positions: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cos_sin_cache: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        k_scale: float | None = None,
        v_scale: float | None = None,
        qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None = None,
    ) -> torch.Tensor:
        """The attention layer's prologue, what `rope_and_store_kv_unfused` does with
        the ops one by one: with qk_norm = (q weight, k weight, eps), rms_norm over each
        head of q and of k first; then rotary_embedding of both, and store_kv_cache of
        the rotated k and of v. Returns the rotated q. A backend may do it in fewer
        kernels (one, in the triton backend)."""
        ...

    def attention_with_prologue(
        self,
        positions: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cos_sin_cache: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
        k_scale: float | None = None,
        v_scale: float | None = None,
        qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None = None,
        sliding_window: int | None = None,
    ) -> torch.Tensor:
        """The attention layer from its q, k, v on: rope_and_store_kv at
        metadata.slot_mapping, then paged_attention of the rotated q, as
        `attention_with_prologue_unfused` does. A backend may do the prologue inside
        the attention launch (triton: batches of decode rows)."""
        ...

    def prepare_attention(self, metadata: AttentionMetadata) -> None:
        """Precompute per-step index tensors shared by all layers (optional)."""
        ...

    def paged_attention(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
        k_scale: float | None = None,
        v_scale: float | None = None,
        sliding_window: int | None = None,
    ) -> torch.Tensor:
        """Causal attention of q [T, Hq, D] over each sequence's cached context
        (which already holds this step's keys). Returns [T, Hq, D] in q's dtype.
        sliding_window (a layer's, fixed after loading): the query at absolute position
        p sees only keys p - sliding_window < k <= p (transformers'
        sliding_window_overlay); None: every key up to p.
        An FP8 cache is read as stored * k_scale / v_scale (None: 1.0) and computed in
        q's dtype; no host synchronisation (the scales are host floats, baked into a
        captured CUDA graph, which is right: they never change after loading)."""
        ...

    def fused_moe(
        self,
        x: torch.Tensor,
        router_logits: torch.Tensor,
        w13: torch.Tensor,
        w2: torch.Tensor,
        top_k: int,
        renormalize: bool,
        fp8: Fp8Experts | None = None,
    ) -> torch.Tensor:
        """A mixture-of-experts MLP. x: [T, H]; router_logits: [T, E] (any float dtype);
        w13: [E, 2I, H], each expert's gate rows then up rows; w2: [E, H, I].
        Routing: softmax over the experts in fp32, the top_k largest, divided by their
        sum when renormalize, cast to x's dtype. Returns [T, H]:
        sum over the chosen experts e of weight_e * (silu(x W_gate_e^T) * (x W_up_e^T)) W2_e^T.
        fp8: w13 and w2 are FP8 with these block scales (fp8.Fp8Experts), each expert
        GEMM W8A8 like a block FP8 linear. No host synchronisation on CUDA (decode
        steps are captured in CUDA graphs)."""
        ...


def rope_and_store_kv_unfused(
    ops: KernelBackend,
    positions,
    q,
    k,
    v,
    cos_sin_cache,
    k_cache,
    v_cache,
    slot_mapping,
    k_scale=None,
    v_scale=None,
    qk_norm=None,
) -> torch.Tensor:
    """KernelBackend.rope_and_store_kv through `ops`' separate ops (its definition)."""
    if qk_norm is not None:
        q_weight, k_weight, eps = qk_norm
        q, k = ops.rms_norm(q, q_weight, eps), ops.rms_norm(k, k_weight, eps)
    q, k = ops.rotary_embedding(positions, q, k, cos_sin_cache)
    ops.store_kv_cache(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    return q


def attention_with_prologue_unfused(
    ops: KernelBackend, positions, q, k, v, cos_sin_cache, k_cache, v_cache, metadata,
    scale, k_scale=None, v_scale=None, qk_norm=None, sliding_window=None,
) -> torch.Tensor:  # fmt: skip
    """KernelBackend.attention_with_prologue through `ops`' two ops (its definition)."""
    q = ops.rope_and_store_kv(
        positions, q, k, v, cos_sin_cache, k_cache, v_cache, metadata.slot_mapping,
        k_scale, v_scale, qk_norm,
    )  # fmt: skip
    return ops.paged_attention(
        q, k_cache, v_cache, metadata, scale, k_scale, v_scale, sliding_window=sliding_window
    )


def add_rms_norm_linear_unfused(
    ops: KernelBackend, x, residual, norm_weight, eps, layer, gated: bool = False
):
    """KernelBackend.add_rms_norm_linear through `ops`' separate ops (its definition)."""
    normed, residual = ops.fused_add_rms_norm(x, residual, norm_weight, eps)
    out = ops.linear_silu_and_mul(normed, layer) if gated else ops.linear(normed, layer)
    return out, normed, residual


def linear_silu_and_mul_unfused(ops: KernelBackend, x, layer):
    """KernelBackend.linear_silu_and_mul through `ops`' separate ops (its definition)."""
    return ops.silu_and_mul(ops.linear(x, layer))


def mixes_decode_rows(metadata: AttentionMetadata) -> bool:
    """Whether a batch may hold one-query (decode) rows beside longer ones: known from
    the host lengths, and assumed where they are absent (a captured mixed step)."""
    if metadata.max_query_len <= 1:
        return False
    cu = metadata.cu_seqlens_q_cpu
    if cu is None:
        return True
    lens = [b - a for a, b in zip(cu, cu[1:])]
    return 1 in lens and max(lens) > 1
