"""The `aiter` kernel backend: AMD AITER's Triton kernels where they fit, pdserve's own
kernels (the `triton` backend) for the rest.

On ROCm the kernels come from a plain `import aiter`; on NVIDIA (and on a CPU under
TRITON_INTERPRET=1, for tests) `aiter.ops.triton.*` is loaded through the shims in
aiter_shims.py. Pinned to the amd-aiter version those shims were checked with
(aiter_shims.AITER_CHECKED_VERSION); any other version warns at construction.

Mapped ops (each checked against the torch reference in tests/kernels):
- paged_attention -> aiter.ops.triton.unified_attention (vLLM's unified Triton
  attention): q [T, Hq, D], caches [num_blocks, block_size, Hk, D] addressed through
  all four strides, so the engine's strided per-layer views of the block-major cache
  work without copies; cu_seqlens_q / seq_lens / block_tables as in AttentionMetadata.
  It needs block_size >= 16 and a power of two (a decode tile is one cache block and
  tl.dot needs 16), q and out with unit stride on the head dim, and head_dim >= 16;
  other shapes fall back to the triton kernel.
- fused_add_rms_norm -> rmsnorm2d_fwd_with_add; rms_norm -> rmsnorm's forward (2-D
  rows; strided [T, H, D] q/k views are made contiguous first).
- rotary_embedding -> rope_cached_thd_positions_2c_fwd (neox, cos/sin read straight
  from the two halves of cos_sin_cache); power-of-two head_dim only, else fallback.
- fused_moe -> moe_op_silu_fused.fused_moe_silu + moe_op.fused_moe (aiter_moe.py),
  with pdserve's routing and alignment.
- linear of an FP8 layer -> gemm_a8w8_blockscale (block weights) or gemm_a8w8 (channel
  / tensor weights, per-token activation scales), activations quantized by pdserve's
  Triton quantizer; tuning tables borrowed from PDSERVE_AITER_ARCH like every AITER GEMM.
- silu_and_mul, store_kv_cache: AITER has no plain Triton equivalent (only fused quant
  / MLA variants): the triton backend's kernels.
- An FP8 KV cache: paged attention runs the triton backend's kernel (unified_attention
  reads FP8 only with its scales as device tensors, not wired up yet); logged once and
  counted in `fallbacks`.
"""

from __future__ import annotations

import collections
import logging

import torch

from services.kernels import aiter_shims
from services.kernels.fp8 import fp8_format_of
from services.kernels.interface import (
    AttentionMetadata,
    add_rms_norm_linear_unfused,
    attention_with_prologue_unfused,
    kv_cache_is_fp8,
    linear_silu_and_mul_unfused,
    rope_and_store_kv_unfused,
)

log = logging.getLogger(__name__)


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


class AiterBackend:
    name = "aiter"

    def __init__(self, fallback=None, use_triton_gemm: bool = False):
        aiter_shims.check_version()
        # linear through AITER's Triton GEMM (gemm_a16w16) instead of cuBLAS: off by
        # default (3-8x slower on the H200); the kernel tuner measures it as a candidate.
        self._gemm = aiter_shims.load_triton_op("gemm_a16w16") if use_triton_gemm else None
        self.native = aiter_shims.is_rocm()
        self._attn = aiter_shims.load_triton_op("unified_attention")
        self._norm = aiter_shims.load_triton_op("rmsnorm")
        self._rope = aiter_shims.load_triton_op("rope")
        if fallback is None:
            from services.kernels.triton_backend import TritonBackend

            fallback = TritonBackend()
        self.fallback = fallback
        # calls sent to the fallback for a reason worth seeing (reason -> calls traced;
        # a captured CUDA graph counts once, at capture)
        self.fallbacks: collections.Counter[str] = collections.Counter()
        self._moe = None  # AITER's fused-MoE GEMMs, loaded on a MoE model's first call
        self._fp8 = None  # AITER's FP8 GEMMs, loaded on an FP8 model's first call
        self._fp8_fallback_logged = False

    def linear(self, x, layer):
        if fp8_format_of(layer) is not None:
            return self._fp8_linear(x, layer)
        if self._gemm is None or x.dtype not in (torch.float16, torch.bfloat16):
            return self.fallback.linear(x, layer)
        x2 = x.reshape(-1, x.shape[-1])
        if x2.stride(-1) != 1:
            x2 = x2.contiguous()
        y = self._gemm.gemm_a16w16(x2, layer.weight, layer.bias, dtype=x.dtype)
        return y.view(*x.shape[:-1], y.shape[-1])

    def _fp8_linear(self, x, layer):
        from services.kernels.triton.fp8_gemm import quantize_activation  # lazy, as above

        if self._fp8 is None:  # on an FP8 model's first call
            self._fp8 = (
                aiter_shims.load_triton_op("gemm_a8w8_blockscale"),
                aiter_shims.load_triton_op("gemm_a8w8"),
            )
        blockscale, a8w8 = self._fp8
        fmt, weight = layer.fp8_format, layer.weight
        n, k = weight.shape
        x2 = x.reshape(-1, k)
        m = x2.shape[0]
        xq, xs = quantize_activation(x2, fmt.act_group(k), weight.dtype)  # fnuz on MI300
        if fmt.granularity == "block":
            # the kernel derives the scale blocks from the scale shapes (the next power of
            # two of K / scale columns), which gives block_k only for power-of-two blocks
            # and K >= block_k: anything else runs pdserve's Triton FP8 GEMM (logged once)
            pow2 = not (fmt.block_k & (fmt.block_k - 1) or fmt.block_n & (fmt.block_n - 1))
            if not pow2 or k < fmt.block_k:
                if not self._fp8_fallback_logged:
                    log.warning(
                        "aiter backend: FP8 %dx%d blocks with K=%d do not fit AITER's "
                        "block-scale GEMM: the %s backend's FP8 GEMM runs them",
                        fmt.block_n,
                        fmt.block_k,
                        k,
                        self.fallback.name,
                    )
                    self._fp8_fallback_logged = True
                return self.fallback.linear(x, layer)
            # a copy: the wrapper edits the config dict it is given, and _get_config
            # returns its cached one
            config = dict(blockscale._get_config(m, n, k))
            out = blockscale.gemm_a8w8_blockscale(
                xq, weight, xs, layer.weight_scale, dtype=x.dtype, config=config
            )
            if layer.bias is not None:
                out = out + layer.bias
        else:
            row = layer.__dict__.get("_aiter_row_scale")
            if row is None:  # [1, N] fp32, built once per layer
                row = layer.weight_scale.float().reshape(-1).expand(n).reshape(1, n).contiguous()
                layer.__dict__["_aiter_row_scale"] = row
            out = a8w8.gemm_a8w8(xq, weight, xs, row, layer.bias, dtype=x.dtype)
        return out.view(*x.shape[:-1], n)

    # ---- norms -------------------------------------------------------------------
    def rms_norm(self, x, weight, eps):
        if x.dtype != weight.dtype:
            return self.fallback.rms_norm(x, weight, eps)
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if x2.stride(-1) != 1:
            x2 = x2.contiguous()
        y, _ = self._norm._rmsnorm_forward(x2, weight, float(eps))
        return y.view(shape)

    def fused_add_rms_norm(self, x, residual, weight, eps):
        if not (x.dtype == residual.dtype == weight.dtype) or x.shape != residual.shape:
            return self.fallback.fused_add_rms_norm(x, residual, weight, eps)
        shape = x.shape
        # the kernel walks residual rows with x's row stride: both dense
        x2 = x.reshape(-1, shape[-1]).contiguous()
        r2 = residual.reshape(-1, shape[-1]).contiguous()
        out = torch.empty_like(x2)
        res_out = torch.empty_like(x2)
        rsigma = torch.empty(x2.shape[0], dtype=torch.float32, device=x.device)
        self._norm._rmsnorm_forward_with_add(out, x2, r2, res_out, weight, rsigma, float(eps))
        return out.view(shape), res_out.view(shape)

    # ---- rope --------------------------------------------------------------------
    def add_rms_norm_linear(self, x, residual, norm_weight, eps, layer, gated=False):
        return add_rms_norm_linear_unfused(self, x, residual, norm_weight, eps, layer, gated)

    def linear_silu_and_mul(self, x, layer):
        return linear_silu_and_mul_unfused(self, x, layer)

    def rotary_embedding(self, positions, q, k, cos_sin_cache):
        head_dim = q.shape[-1]
        ok = (
            _pow2(head_dim)
            and head_dim >= 16
            and q.stride(-1) == 1
            and k.stride(-1) == 1
            and q.shape[1] % k.shape[1] == 0
        )
        if not ok:
            return self.fallback.rotary_embedding(positions, q, k, cos_sin_cache)
        half = head_dim // 2
        cos = cos_sin_cache[:, :half]
        sin = cos_sin_cache[:, half:]
        return self._rope.rope_cached_thd_positions_2c_fwd(
            q,
            k,
            cos,
            sin,
            positions,
            self._rope.RotateStyle.NEOX,
            True,  # reuse_freqs_front_part: cos/sin hold D/2 columns
            False,  # nope_first
        )

    # ---- ops AITER lacks ---------------------------------------------------------
    def silu_and_mul(self, x):
        return self.fallback.silu_and_mul(x)

    def store_kv_cache(self, k, v, k_cache, v_cache, slot_mapping, k_scale=None, v_scale=None):
        self.fallback.store_kv_cache(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)

    def rope_and_store_kv(
        self, positions, q, k, v, cos_sin_cache, k_cache, v_cache, slot_mapping,
        k_scale=None, v_scale=None, qk_norm=None,
    ):  # fmt: skip
        # AITER's norm and RoPE, the fallback's KV write: not fused
        return rope_and_store_kv_unfused(
            self, positions, q, k, v, cos_sin_cache, k_cache, v_cache, slot_mapping,
            k_scale, v_scale, qk_norm,
        )  # fmt: skip

    def attention_with_prologue(self, *args, **kwargs):
        return attention_with_prologue_unfused(self, *args, **kwargs)

    def fused_moe(self, x, router_logits, w13, w2, top_k, renormalize, config=None, fp8=None):
        if fp8 is not None:  # FP8 experts: pdserve's FP8 fused MoE, at its default tiles
            if not self.fallbacks["fused_moe.fp8"]:
                log.warning(
                    "aiter backend: FP8 experts run the %s backend's fused MoE (aiter's "
                    "FP8 MoE kernels are not wired in)",
                    self.fallback.name,
                )
            self.fallbacks["fused_moe.fp8"] += 1
            return self.fallback.fused_moe(x, router_logits, w13, w2, top_k, renormalize, fp8=fp8)
        if x.dtype == torch.float32 and x.is_cuda:
            # aiter's MoE dots take no input precision: on a GPU fp32 would run as tf32
            if not self.fallbacks["fused_moe.fp32"]:
                log.warning(
                    "aiter backend: fp32 fused MoE runs the %s backend's kernel (aiter's "
                    "would compute in tf32)",
                    self.fallback.name,
                )
            self.fallbacks["fused_moe.fp32"] += 1
            return self.fallback.fused_moe(x, router_logits, w13, w2, top_k, renormalize, config)
        if self._moe is None:
            from services.kernels.aiter_moe import AiterFusedMoE  # lazy: MoE models only

            self._moe = AiterFusedMoE()
        return self._moe(x, router_logits, w13, w2, top_k, renormalize, config)

    # ---- attention ---------------------------------------------------------------
    def prepare_attention(self, metadata: AttentionMetadata) -> None:
        def i32(t):
            return (
                t
                if t.dtype == torch.int32 and t.is_contiguous()
                else t.to(torch.int32).contiguous()
            )

        metadata.backend_data["aiter"] = (
            i32(metadata.block_tables),
            i32(metadata.seq_lens),
            i32(metadata.cu_seqlens_q),
        )

    def supports_attention(self, q, k_cache) -> bool:
        return self.attention_fallback_reason(q, k_cache) is None

    def attention_fallback_reason(self, q, k_cache) -> str | None:
        """Why aiter's unified attention cannot take this call (None: it can)."""
        block_size, head_dim = k_cache.shape[1], k_cache.shape[3]
        if not _pow2(block_size) or block_size < 16:
            return "block_size"  # its tiles walk whole power-of-two blocks
        if not _pow2(head_dim) or head_dim < 16:
            return "head_dim"  # its segment-reduce kernel fails to compile otherwise
        if q.stride(-1) != 1 or q.dtype != k_cache.dtype:
            return "layout"
        if q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
            return "dtype"
        if q.dtype == torch.float32 and q.is_cuda:
            return "fp32"  # its dots take no input precision: tf32 on a GPU
        return None

    def paged_attention(
        self, q, k_cache, v_cache, metadata: AttentionMetadata, scale, k_scale=None, v_scale=None,
        sliding_window=None,
    ):  # fmt: skip
        if kv_cache_is_fp8(k_cache, k_scale, v_scale):
            if not self.fallbacks["paged_attention.fp8_kv"]:
                log.warning(
                    "aiter backend: FP8 KV cache: paged attention runs the %s backend's kernel",
                    self.fallback.name,
                )
            self.fallbacks["paged_attention.fp8_kv"] += 1
            return self.fallback.paged_attention(
                q, k_cache, v_cache, metadata, scale, k_scale, v_scale, sliding_window
            )
        reason = self.attention_fallback_reason(q, k_cache)
        if reason is not None:
            key = f"paged_attention.{reason}"
            if not self.fallbacks[key]:
                log.warning(
                    "aiter backend: paged attention runs the %s backend's kernel (%s: "
                    "block size %d, head_dim %d, %s)",
                    self.fallback.name,
                    reason,
                    k_cache.shape[1],
                    k_cache.shape[3],
                    q.dtype,
                )
            self.fallbacks[key] += 1
            return self.fallback.paged_attention(
                q, k_cache, v_cache, metadata, scale, sliding_window=sliding_window
            )
        if "aiter" not in metadata.backend_data:
            self.prepare_attention(metadata)
        block_tables, seq_lens, cu_seqlens_q = metadata.backend_data["aiter"]
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        self._attn.unified_attention(
            q,
            k_cache,
            v_cache,
            out,
            cu_seqlens_q,
            metadata.max_query_len,
            seq_lens,
            metadata.max_seq_len,
            float(scale),
            True,  # causal
            # keys q - window < k <= q: AITER's kernel sees q - k < 1 + window_size[0]
            (-1, -1) if sliding_window is None else (sliding_window - 1, 0),
            block_tables,
            0.0,  # softcap
            None,
            None,
            None,
        )
        return out
