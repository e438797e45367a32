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
- silu_and_mul, store_kv_cache: AITER has no plain Triton equivalent (only fused quant
  / MLA variants): the triton backend's kernels.
"""

from __future__ import annotations

import torch

from services.kernels import aiter_shims
from services.kernels.interface import AttentionMetadata


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

    def linear(self, x, layer):
        if self._gemm is None or x.dtype not in (torch.float16, torch.bfloat16):
            return self.fallback.linear(x, layer)
        x2 = x.reshape(-1, x.shape[-1])
        if x2.stride(-1) != 1:
            x2 = x2.contiguous()
        y = self._gemm.gemm_a16w16(x2, layer.weight, layer.bias, dtype=x.dtype)
        return y.view(*x.shape[:-1], y.shape[-1])

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

    def store_kv_cache(self, k, v, k_cache, v_cache, slot_mapping):
        self.fallback.store_kv_cache(k, v, k_cache, v_cache, slot_mapping)

    def fused_moe(self, x, router_logits, w13, w2, top_k, renormalize):
        # AITER's Triton MoE kernels are not wired through the shims yet
        return self.fallback.fused_moe(x, router_logits, w13, w2, top_k, renormalize)

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
        block_size, head_dim = k_cache.shape[1], k_cache.shape[3]
        return (
            _pow2(block_size)
            and block_size >= 16
            and head_dim >= 16
            and q.stride(-1) == 1
            and q.dtype == k_cache.dtype
            and q.dtype in (torch.float16, torch.bfloat16, torch.float32)
        )

    def paged_attention(self, q, k_cache, v_cache, metadata: AttentionMetadata, scale):
        if not self.supports_attention(q, k_cache):
            return self.fallback.paged_attention(q, k_cache, v_cache, metadata, scale)
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
            (-1, -1),  # no sliding window
            block_tables,
            0.0,  # softcap
            None,
            None,
            None,
        )
        return out
