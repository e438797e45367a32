"""Prefill attention through torch's fused attention: FlashAttention's varlen kernel
(`torch.nn.attention.varlen.varlen_attn`) on CUDA, `scaled_dot_product_attention` per
sequence elsewhere. A candidate the kernel tuner measures for prefill and mixed
batches; the other ops are the torch backend's.

The paged cache is gathered into dense [total_keys, Hk, D] keys and values once per
layer (an index built once per step). That gather is cheap next to prefill's compute,
and it lets the dense kernels handle cached prefixes: queries sit at the end of each
sequence's keys (bottom-right causal alignment, as FlashAttention does for q < k).

Needs the host copies of the lengths (AttentionMetadata.cu_seqlens_q_cpu /
seq_lens_cpu), so it only runs eager steps, never inside a captured CUDA graph.
An FP8 cache is dequantized (stored * k_scale / v_scale, in q's dtype) by that gather."""

from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F

from services.kernels.interface import AttentionMetadata, kv_cache_is_fp8
from services.kernels.torch_backend import TorchBackend, dequantize_kv


def _varlen_attn():
    """torch's varlen FlashAttention entry point and the keywords this torch takes."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None, frozenset()
    return varlen_attn, frozenset(inspect.signature(varlen_attn).parameters)


class SdpaBackend(TorchBackend):
    name = "sdpa"

    def __init__(self):
        self._varlen, self._varlen_params = _varlen_attn()

    def uses_varlen(self, q: torch.Tensor) -> bool:
        return (
            self._varlen is not None
            and q.is_cuda
            and q.dtype in (torch.float16, torch.bfloat16)
            and "scale" in self._varlen_params
            and ("window_size" in self._varlen_params or "is_causal" in self._varlen_params)
        )

    def prepare_attention(self, metadata: AttentionMetadata) -> None:
        if metadata.cu_seqlens_q_cpu is None or metadata.seq_lens_cpu is None:
            raise ValueError(
                "sdpa attention needs host sequence lengths (eager steps only, not a "
                "captured CUDA graph)"
            )
        device = metadata.seq_lens.device
        seq_lens = metadata.seq_lens_cpu
        cu_k = [0]
        for n in seq_lens:
            cu_k.append(cu_k[-1] + n)
        cu_k_t = torch.tensor(cu_k, dtype=torch.int32, device=device)
        lens_t = torch.tensor(seq_lens, dtype=torch.int64, device=device)
        seq_ids = torch.repeat_interleave(
            torch.arange(len(seq_lens), device=device), lens_t, output_size=cu_k[-1]
        )
        pos = torch.arange(cu_k[-1], device=device) - cu_k_t.to(torch.int64)[seq_ids]
        bs = metadata.block_size
        blocks = metadata.block_tables.to(torch.int64)[seq_ids, pos // bs]
        metadata.backend_data["sdpa"] = (blocks, pos % bs, cu_k_t, cu_k)

    def paged_attention(
        self, q, k_cache, v_cache, metadata: AttentionMetadata, scale, k_scale=None, v_scale=None,
        sliding_window=None,
    ):  # fmt: skip
        fp8 = kv_cache_is_fp8(k_cache, k_scale, v_scale)
        if "sdpa" not in metadata.backend_data:
            self.prepare_attention(metadata)
        blocks, offsets, cu_k_t, cu_k = metadata.backend_data["sdpa"]
        k = k_cache[blocks, offsets]  # [total_keys, Hk, D]
        v = v_cache[blocks, offsets]
        if fp8:
            k, v = dequantize_kv(k, k_scale, q.dtype), dequantize_kv(v, v_scale, q.dtype)
        # a window needs varlen's window_size (an older torch takes only is_causal)
        if self.uses_varlen(q) and (sliding_window is None or "window_size" in self._varlen_params):
            return self._flash_varlen(q, k, v, metadata, cu_k_t, scale, sliding_window)
        return self._per_sequence(q, k, v, metadata.cu_seqlens_q_cpu, cu_k, scale, sliding_window)

    def _flash_varlen(self, q, k, v, metadata, cu_k_t, scale, sliding_window=None):
        kwargs = {"scale": scale}
        if "window_size" in self._varlen_params:
            # causal, bottom-right aligned; FlashAttention's left width counts the keys
            # before the query's own: window - 1
            left = -1 if sliding_window is None else sliding_window - 1
            kwargs["window_size"] = (left, 0)
        else:
            kwargs["is_causal"] = True
        if q.shape[1] != k.shape[1]:
            if "enable_gqa" in self._varlen_params:
                kwargs["enable_gqa"] = True
            else:
                group = q.shape[1] // k.shape[1]
                k = k.repeat_interleave(group, dim=1)
                v = v.repeat_interleave(group, dim=1)
        cu_q = metadata.cu_seqlens_q
        if cu_q.dtype != torch.int32:
            cu_q = cu_q.to(torch.int32)
        return self._varlen(
            q,
            k,
            v,
            cu_q,
            cu_k_t,
            metadata.max_query_len,
            metadata.max_seq_len,
            **kwargs,
        )

    @staticmethod
    def _per_sequence(q, k, v, cu_q, cu_k, scale, sliding_window=None):
        out = torch.empty_like(q)
        gqa = q.shape[1] != k.shape[1]
        for i in range(len(cu_k) - 1):
            qs, qe, ks, ke = cu_q[i], cu_q[i + 1], cu_k[i], cu_k[i + 1]
            lq, lk = qe - qs, ke - ks
            if lq == 0:
                continue
            # query j sits at key position lk - lq + j: bottom-right causal mask
            k_pos = torch.arange(lk, device=q.device).unsqueeze(0)
            q_pos = torch.arange(lq, device=q.device).unsqueeze(1) + (lk - lq)
            mask = k_pos <= q_pos
            if sliding_window is not None:
                mask &= k_pos > q_pos - sliding_window
            o = F.scaled_dot_product_attention(
                q[qs:qe].transpose(0, 1),
                k[ks:ke].transpose(0, 1),
                v[ks:ke].transpose(0, 1),
                attn_mask=mask,
                scale=scale,
                enable_gqa=gqa,
            )
            out[qs:qe] = o.transpose(0, 1)
        return out
