"""Reference kernels in plain torch: correct on CPU and CUDA, the yardstick for the
faster backends."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from services.kernels.fp8 import fp8_format_of, fp8_linear_reference, fused_moe_fp8_reference
from services.kernels.interface import (
    AttentionMetadata,
    add_rms_norm_linear_unfused,
    attention_with_prologue_unfused,
    kv_cache_is_fp8,
    linear_silu_and_mul_unfused,
    rope_and_store_kv_unfused,
)


class TorchBackend:
    name = "torch"

    def linear(self, x, layer):
        if fp8_format_of(layer) is not None:
            # the reference: weights dequantized, activations quantized as the FP8
            # kernels do, fp32 matmul (a full fp32 weight per call: correct, not fast)
            return fp8_linear_reference(x, layer)
        return F.linear(x, layer.weight, layer.bias)

    def rms_norm(self, x, weight, eps):
        if x.dtype == weight.dtype == torch.float32:
            # one call into aten, which runs the same ops below in the same order (bit
            # for bit the same result); 6 Python-level ops fewer, x 2 per layer
            return F.rms_norm(x, weight.shape, weight, eps)
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        return weight * xf.to(dtype)

    def fused_add_rms_norm(self, x, residual, weight, eps):
        residual = x + residual
        return self.rms_norm(residual, weight, eps), residual

    def add_rms_norm_linear(self, x, residual, norm_weight, eps, layer, gated=False):
        return add_rms_norm_linear_unfused(self, x, residual, norm_weight, eps, layer, gated)

    def linear_silu_and_mul(self, x, layer):
        return linear_silu_and_mul_unfused(self, x, layer)

    def rotary_embedding(self, positions, q, k, cos_sin_cache):
        cos_sin = cos_sin_cache.index_select(0, positions).unsqueeze(1)  # [T, 1, D]
        half = cos_sin.shape[-1] // 2
        cos, sin = cos_sin[..., :half], cos_sin[..., half:]
        qk = _side_by_side(q, k)
        if qk is None:
            return _rotate(q, cos, sin), _rotate(k, cos, sin)
        # one decode row: q and k are neighbours in the fused qkv row, rotated as one
        # [1, Hq + Hk, D] tensor whose head slices are contiguous again
        out = _rotate(qk, cos, sin)
        return out[:, : q.shape[1]], out[:, q.shape[1] :]

    def silu_and_mul(self, x):
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up

    def fused_moe(self, x, router_logits, w13, w2, top_k, renormalize, fp8=None):
        # The reference: one expert at a time over the tokens routed to it, in the order
        # transformers' Qwen3-MoE / Mixtral blocks sum them (host syncs: eager only).
        weights, ids = select_experts(router_logits, top_k, renormalize)
        weights = weights.to(x.dtype)
        if fp8 is not None:
            return fused_moe_fp8_reference(x, weights, ids, w13, w2, fp8, self.silu_and_mul)
        out = torch.zeros_like(x)
        for e in ids.unique().tolist():
            token, slot = torch.where(ids == e)
            h = self.silu_and_mul(F.linear(x[token], w13[e]))
            out.index_add_(0, token, F.linear(h, w2[e]) * weights[token, slot, None])
        return out

    def store_kv_cache(self, k, v, k_cache, v_cache, slot_mapping, k_scale=None, v_scale=None):
        fp8 = kv_cache_is_fp8(k_cache, k_scale, v_scale)
        block_size = k_cache.shape[1]
        blocks = slot_mapping // block_size
        offsets = slot_mapping % block_size
        k_cache.index_put_(
            (blocks, offsets), quantize_kv(k, k_cache.dtype, k_scale if fp8 else None)
        )
        v_cache.index_put_(
            (blocks, offsets), quantize_kv(v, v_cache.dtype, v_scale if fp8 else None)
        )

    def rope_and_store_kv(
        self, positions, q, k, v, cos_sin_cache, k_cache, v_cache, slot_mapping,
        k_scale=None, v_scale=None, qk_norm=None,
    ):  # fmt: skip
        return rope_and_store_kv_unfused(
            self, positions, q, k, v, cos_sin_cache, k_cache, v_cache, slot_mapping,
            k_scale, v_scale, qk_norm,
        )  # fmt: skip

    def attention_with_prologue(self, *args, **kwargs):
        return attention_with_prologue_unfused(self, *args, **kwargs)

    def prepare_attention(self, metadata: AttentionMetadata) -> None:
        # Pad the ragged batch to [num_seqs, max_len]: the gather indices and the mask
        # are the same for every layer, so build them once per step.
        device = metadata.seq_lens.device
        bs = metadata.block_size
        cu = metadata.cu_seqlens_q.to(torch.int64)
        query_lens = cu[1:] - cu[:-1]
        max_q, max_k = metadata.max_query_len, metadata.max_seq_len

        # whole blocks, gathered with index_select: indexing the strided per-layer cache
        # view with (block, offset) pairs made torch copy the whole view first (3.4 ms
        # against 9 us per layer and step for SmolLM2 on a CPU)
        num_blocks = -(-max_k // bs)
        blocks = metadata.block_tables[:, :num_blocks].reshape(-1).to(torch.int64)

        q_pos = torch.arange(max_q, device=device)
        q_valid = q_pos.unsqueeze(0) < query_lens.unsqueeze(1)  # [B, max_q]
        q_rows = (cu[:-1].unsqueeze(1) + q_pos.unsqueeze(0))[q_valid]
        lens = metadata.seq_lens_cpu
        mask = None
        # decode rows that all see their whole padded context need no mask, and SDPA
        # without one is the cheaper call (once per layer); otherwise build it
        if not (max_q == 1 and lens is not None and min(lens) == max_k):
            mask = _attention_mask(metadata, q_valid)
        metadata.backend_data["torch"] = (blocks, max_k, q_valid, q_rows, mask)

    def paged_attention(
        self, q, k_cache, v_cache, metadata: AttentionMetadata, scale, k_scale=None, v_scale=None,
        sliding_window=None,
    ):  # fmt: skip
        fp8 = kv_cache_is_fp8(k_cache, k_scale, v_scale)
        if "torch" not in metadata.backend_data:
            self.prepare_attention(metadata)
        blocks, max_k, q_valid, q_rows, mask = metadata.backend_data["torch"]
        num_seqs = q_valid.shape[0]
        if sliding_window is not None and max_k > sliding_window:
            # the window binds in this step (decode rows too, which may have no causal
            # mask): layers may differ, so one mask per window, built once per step
            masks = metadata.backend_data.setdefault("torch_windows", {})
            if sliding_window not in masks:
                masks[sliding_window] = _attention_mask(metadata, q_valid, sliding_window)
            mask = masks[sliding_window]

        def gather(cache):  # -> [B, Hk, max_k, D]
            rows = cache.index_select(0, blocks)  # [B * blocks, block_size, Hk, D]
            rows = rows.view(num_seqs, -1, cache.shape[2], cache.shape[3])
            if rows.shape[1] != max_k:
                rows = rows[:, :max_k]
            return rows.transpose(1, 2)

        keys, values = gather(k_cache), gather(v_cache)
        if fp8:  # computed in q's dtype
            keys = dequantize_kv(keys, k_scale, q.dtype)
            values = dequantize_kv(values, v_scale, q.dtype)
        max_q = q_valid.shape[1]
        if max_q == 1:  # decode-only step: one query row per sequence, no padding
            query = q.unsqueeze(2)  # [B, Hq, 1, D]
        else:
            padded_q = q.new_zeros(num_seqs, max_q, q.shape[1], q.shape[2])
            padded_q[q_valid] = q[q_rows]
            query = padded_q.transpose(1, 2)
        if query.dtype != keys.dtype:
            query = query.to(keys.dtype)
        groups = q.shape[1] // keys.shape[1]
        if groups > 1 and query.device.type == "cpu" and query.element_size() == 2:
            out = _grouped_query_attention(query, keys, values, mask, scale, groups)
        else:
            out = F.scaled_dot_product_attention(
                query,
                keys,
                values,
                attn_mask=mask,
                scale=scale,
                enable_gqa=groups > 1,
            )  # [B, Hq, max_q, D]
        out = out.squeeze(2) if max_q == 1 else out.transpose(1, 2)[q_valid]
        return out if out.dtype == q.dtype else out.to(q.dtype)


def _attention_mask(metadata: AttentionMetadata, q_valid, sliding_window=None) -> torch.Tensor:
    """[B, 1, max_q, max_k] bool: which padded key each padded query row sees."""
    device = metadata.seq_lens.device
    cu = metadata.cu_seqlens_q.to(torch.int64)
    seq_lens = metadata.seq_lens.to(torch.int64)
    q_pos = torch.arange(q_valid.shape[1], device=device)
    kv_pos = torch.arange(metadata.max_seq_len, device=device).view(1, 1, -1)
    # Query i of a sequence sits at absolute position seq_len - query_len + i.
    q_abs = (seq_lens - (cu[1:] - cu[:-1])).unsqueeze(1) + q_pos.unsqueeze(0)  # [B, max_q]
    mask = kv_pos <= q_abs.unsqueeze(-1)  # [B, max_q, max_k]
    mask &= kv_pos < seq_lens.view(-1, 1, 1)
    if sliding_window is not None:  # transformers' sliding_window_overlay
        mask &= kv_pos > (q_abs - sliding_window).unsqueeze(-1)
    mask[:, :, 0] |= ~q_valid  # padded query rows attend somewhere: no NaN
    return mask.unsqueeze(1)


def _grouped_query_attention(query, keys, values, mask, scale, groups: int) -> torch.Tensor:
    """SDPA for GQA with each KV head's query heads folded into its query rows:
    [B, Hk * G, Q, D] -> [B, Hk, G * Q, D] (head h reads KV head h // G, as enable_gqa
    does). Why: on a CPU, 16-bit SDPA with enable_gqa took 2-6.6x longer than this on
    decode rows and 1.3x on prefill chunks (SmolLM2's 9 / 3 heads; docs/performance.md);
    fp32 gained nothing, so it keeps enable_gqa."""
    b, hq, q_len, d = query.shape
    folded = query.reshape(b, hq // groups, groups * q_len, d)
    if mask is not None and q_len > 1:  # decode rows' [B, 1, 1, K] mask broadcasts as is
        mask = mask.repeat(1, 1, groups, 1)  # row g * Q + t is query t's
    out = F.scaled_dot_product_attention(folded, keys, values, attn_mask=mask, scale=scale)
    return out.view(b, hq, q_len, d)


def quantize_kv(x: torch.Tensor, cache_dtype: torch.dtype, scale: float | None) -> torch.Tensor:
    """x as a cache of cache_dtype stores it: for FP8, x / scale in fp32, saturated to the
    format's range (a plain cast would turn anything beyond +-448, or +-240 for fnuz,
    into NaN), rounded to nearest even by the cast."""
    if not (cache_dtype.itemsize == 1 and cache_dtype.is_floating_point):
        return x if x.dtype == cache_dtype else x.to(cache_dtype)
    top = torch.finfo(cache_dtype).max
    x = x.float()
    if scale is not None:
        x = x / scale
    return x.clamp(-top, top).to(cache_dtype)


def dequantize_kv(x: torch.Tensor, scale: float | None, dtype: torch.dtype) -> torch.Tensor:
    """FP8 cache values -> dtype: stored * scale, in fp32 first."""
    x = x.float()
    if scale is not None:
        x = x * scale
    return x.to(dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    dtype = x.dtype
    x1, x2 = x.float().chunk(2, dim=-1)
    out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return out if dtype == torch.float32 else out.to(dtype)


def _side_by_side(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor | None:
    """q [1, Hq, D] and k [1, Hk, D] as one [1, Hq + Hk, D] view when k's heads follow
    q's in memory (one row of the fused qkv projection), else None."""
    if q.shape[0] != 1 or k.shape[0] != 1 or q.dtype != k.dtype or q.device != k.device:
        return None
    heads, dim = q.shape[1], q.shape[2]
    if q.stride()[1:] != (dim, 1) or k.stride()[1:] != (dim, 1):
        return None
    if k.data_ptr() != q.data_ptr() + heads * dim * q.element_size():
        return None
    # adjacent is not enough: two allocations can sit back to back (CUDA's caching
    # allocator does that to q_norm's and k_norm's outputs), and a view over q's storage
    # may not reach into another storage
    if q.untyped_storage().data_ptr() != k.untyped_storage().data_ptr():
        return None
    return q.as_strided((1, heads + k.shape[1], dim), (dim * (heads + k.shape[1]), dim, 1))


def select_experts(
    router_logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """MoE routing, as transformers' Qwen3-MoE and Mixtral do it: softmax in fp32, the
    top_k experts, renormalized to sum to 1 when asked. Returns (weights fp32 [T, k],
    expert ids int64 [T, k])."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids
