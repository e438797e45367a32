"""The `triton` kernel backend: pdserve's own Triton kernels behind the KernelBackend
interface, with the torch backend's exact signatures and semantics (new output
tensors, inputs untouched, caches written in place).

Runs wherever Triton does: CUDA and ROCm GPUs, or a CPU under TRITON_INTERPRET=1
(set before triton is imported; slow, for tests)."""

from __future__ import annotations

import os

import torch

from services.kernels import triton as tk
from services.kernels.fp8 import fp8_format_of
from services.kernels.interface import (
    AttentionMetadata,
    attention_with_prologue_unfused,
    mixes_decode_rows,
    rope_and_store_kv_unfused,
)
from services.kernels.triton import fp8_gemv, gated_gemv, norm_fold, norm_quant
from services.kernels.triton._launch import env_switch
from services.kernels.triton.attention_prologue import AttentionPrologue, prologue_fits
from services.kernels.triton.gemv import GEMV_DTYPES, GEMV_MAX_ROWS, launch_config

# "0" keeps each layer's RMSNorm a kernel of its own (an A/B switch for benchmarks);
# "1" folds it into the next one-row GEMV where that pays (norm_fold.py)
NORM_FOLD_ENV = "PDSERVE_TRITON_NORM_FOLD"
# "1" (the default) applies a dense MLP's silu_and_mul in its decode gate_up GEMV
# (gated_gemv.py; an H100 measured it faster); "0" keeps it a kernel of its own
GATED_GEMV_ENV = "PDSERVE_TRITON_GATED_GEMV"
# "1" (the default; an H100 measured it faster at batch 1, 8 and 64) does a decode
# batch's RoPE + KV write inside its attention launch (attention_prologue.py); "0" in a
# kernel of its own
ATTN_PROLOGUE_ENV = "PDSERVE_TRITON_ATTN_PROLOGUE"
# "1" has a norm not folded into the FP8 GEMV after it quantize the row for it
# (norm_quant.py: the GEMV's programs then skip that work); "gated" only before a gated
# gate_up; "0" leaves the quantization to every GEMV program. Unset: the mode the kernel
# tuner picked for this GPU (a tuned config's "prequant", tuner_prequant.py), else "0"
# (an H100 ran Llama-3-8B FP8 1% slower with "1"; the H200's FP8 loop is near its issue
# limit, where fewer instructions may pay)
FP8_PREQUANT_ENV = "PDSERVE_TRITON_FP8_PREQUANT"
FP8_PREQUANT_MODES = ("0", "1", "gated")


def _gemv_takes(x, weight) -> bool:
    """Whether the bf16 / fp16 / fp32 GEMV (gemv.py) takes x's rows with this weight."""
    return x.dtype == weight.dtype and x.dtype in GEMV_DTYPES and weight.is_contiguous()


def _qk_norm_fuses(q, qk_norm) -> bool:
    """Whether a fused prologue may apply this q/k norm: it rounds to q's dtype."""
    return qk_norm is None or qk_norm[0].dtype == qk_norm[1].dtype == q.dtype


def _one_norm_row(x, residual, norm_weight) -> bool:
    """Whether add_rms_norm_linear's inputs are one row that a one-launch norm path takes:
    x and residual of one shape, all three of one dtype."""
    k = x.shape[-1]
    return (
        x.numel() == k
        and residual.shape == x.shape
        and (x.dtype == residual.dtype == norm_weight.dtype)
    )


def _shaped_as(x, out, normed, residual):
    """A one-row path's (out, normed, residual) in x's leading shape."""
    return out.view(*x.shape[:-1], out.shape[-1]), normed.view(x.shape), residual.view(x.shape)


def _row_settings(config):
    # config: {"row_stages": S[, "row_fold": [block_k, k_fold, warps[, block_n]]][,
    # "prequant": mode]}, the GEMV's K-loop depth and tile the tuner measured fastest
    # here (the defaults where absent or None)
    if config is None:
        return None, None
    fold = config.get("row_fold")
    return config.get("row_stages"), None if fold is None else tuple(map(int, fold))


class TritonBackend:
    name = "triton"

    def __init__(
        self,
        attn_num_splits: int | None = None,
        norm_fold: bool | None = None,
        gated_gemv: bool | None = None,
        attn_prologue: bool | None = None,
        fp8_prequant: str | None = None,
    ):
        # None: pick the flash-decoding split count from the batch shape and the GPU.
        self.attn_num_splits = attn_num_splits
        # add_rms_norm_linear folds the norm into a one-row GEMV (None: the environment)
        if norm_fold is None:
            norm_fold = env_switch(NORM_FOLD_ENV, "1", ("0", "1")) == "1"
        self.norm_fold = norm_fold
        # linear_silu_and_mul in the one-row GEMV (None: the environment)
        if gated_gemv is None:
            gated_gemv = env_switch(GATED_GEMV_ENV, "1", ("0", "1")) == "1"
        self.gated_gemv = gated_gemv
        # attention_with_prologue in one launch (None: the environment)
        if attn_prologue is None:
            attn_prologue = env_switch(ATTN_PROLOGUE_ENV, "1", ("0", "1")) == "1"
        self.attn_prologue = attn_prologue
        # add_rms_norm_linear's norm quantizes the row for an FP8 GEMV: "1" before every
        # one, "gated" before a gated gate_up only, "0" never. None: the environment's,
        # and where that is unset too, each call's config (the tuner's pick) or "0"
        if fp8_prequant is None and os.environ.get(FP8_PREQUANT_ENV) is not None:
            fp8_prequant = env_switch(FP8_PREQUANT_ENV, "0", FP8_PREQUANT_MODES)
        if fp8_prequant is not None and fp8_prequant not in FP8_PREQUANT_MODES:
            raise ValueError(f"fp8_prequant={fp8_prequant!r}: expected one of {FP8_PREQUANT_MODES}")
        self.fp8_prequant = fp8_prequant

    def mixed_graph_blocker(self, token_counts) -> str | None:
        return None  # every op reads lengths from device tensors (mixed_graph.py)

    def linear(self, x, layer, config=None):
        row_stages, row_fold = _row_settings(config)
        if fp8_format_of(layer) is not None:  # FP8 weights: our block/channel-scaled GEMM
            return tk.fp8_linear(x, layer, row_stages, row_fold)
        # cuBLAS beats Triton GEMMs on the H200 (docs/performance.md), but its GEMV for a few
        # rows streams the weight well below peak bandwidth: decode-sized batches take
        # our own GEMV, larger ones stay on cuBLAS.
        weight, k = layer.weight, x.shape[-1]
        rows = x.numel() // k if k else 0
        if 0 < rows <= GEMV_MAX_ROWS and _gemv_takes(x, weight):
            out = tk.gemv(
                x.reshape(rows, k), weight, layer.bias, row_stages=row_stages, row_fold=row_fold
            )
            return out.view(*x.shape[:-1], weight.shape[0])
        return torch.nn.functional.linear(x, weight, layer.bias)

    def add_rms_norm_linear(self, x, residual, norm_weight, eps, layer, gated=False, config=None):
        if self.norm_fold:
            in_gemv = gated and self.gated_gemv  # the activation too, in the GEMV
            folded = self._folded(x, residual, norm_weight, eps, layer, in_gemv, config)
            if folded is not None:
                out, normed, residual = folded
                return (self.silu_and_mul(out) if gated and not in_gemv else out), normed, residual
        mode = self._prequant_mode(config)
        if mode == "1" or (mode == "gated" and gated):
            quantized = self._prequantized(x, residual, norm_weight, eps, layer, gated, config)
            if quantized is not None:
                return quantized
        normed, residual = self.fused_add_rms_norm(x, residual, norm_weight, eps)
        if gated:
            return self.linear_silu_and_mul(normed, layer, config), normed, residual
        return self.linear(normed, layer, config), normed, residual

    def _prequant_mode(self, config) -> str:
        """The FP8 prequant mode of a call: the backend's own (an argument or the
        environment) over the tuned config's, "0" where neither says."""
        if self.fp8_prequant is not None:
            return self.fp8_prequant
        mode = "0" if config is None else config.get("prequant", "0")
        if mode not in FP8_PREQUANT_MODES:
            raise ValueError(f"config prequant={mode!r}: expected one of {FP8_PREQUANT_MODES}")
        return mode

    def linear_silu_and_mul(self, x, layer, config=None):
        k = x.shape[-1]
        rows = x.numel() // k if k else 0
        if self.gated_gemv and 0 < rows <= GEMV_MAX_ROWS:  # the activation in the GEMV
            row_stages, row_fold = _row_settings(config)
            x2, weight, fmt = x.reshape(rows, k), layer.weight, fp8_format_of(layer)
            out = None
            if fmt is not None and rows == 1:
                if self._gated_fp8_fits(x2, layer, row_stages, row_fold):
                    out = gated_gemv.fp8_gemv_silu_and_mul(
                        x2, weight, layer.weight_scale, fmt, layer.bias, num_stages=row_stages,
                        fold=row_fold,
                    )  # fmt: skip
            elif fmt is None and _gemv_takes(x2, weight) and weight.shape[0] % 2 == 0:
                out = gated_gemv.gemv_silu_and_mul(
                    x2, weight, layer.bias, row_stages=row_stages, row_fold=row_fold
                )
            if out is not None:
                return out.view(*x.shape[:-1], out.shape[-1])
        return self.silu_and_mul(self.linear(x, layer, config))

    @staticmethod
    def _gated_fp8_fits(row, layer, row_stages, row_fold) -> bool:
        """Whether the FP8 GEMV takes this row and gate_up layer gated."""
        weight, fmt, n = layer.weight, fp8_format_of(layer), layer.weight.shape[0]
        if not fp8_gemv.supports(1, fmt, weight):
            return False
        cfg = fp8_gemv.launch_config(row, n, fmt, None, row_stages, row_fold)
        return fp8_gemv.gated_rows_fit(n, cfg)

    def _folded(self, x, residual, norm_weight, eps, layer, gated, config):
        """The norm folded into the linear's one-row GEMV (bf16 or FP8; gated: with the
        silu_and_mul after it), or None where that GEMV does not take this row or the
        fold would not pay (norm_fold.py): then the norm runs on its own."""
        if not _one_norm_row(x, residual, norm_weight):
            return None
        k = x.shape[-1]
        row_stages, row_fold = _row_settings(config)
        weight, fmt = layer.weight, fp8_format_of(layer)
        row, n = x.reshape(1, k), weight.shape[0]
        args = (row, residual.reshape(1, k), norm_weight, eps, weight)
        if fmt is not None:
            if not fp8_gemv.supports(1, fmt, weight):
                return None
            cfg = fp8_gemv.launch_config(row, n, fmt, None, row_stages, row_fold)
            if gated and not fp8_gemv.gated_rows_fit(n, cfg):
                return None
            if not norm_fold.fold_pays(row, n, cfg.block_n, fp8=True):
                return None
            out, normed, res = fp8_gemv.add_rms_norm_fp8_gemv(
                *args, layer.weight_scale, fmt, layer.bias, config=cfg, gated=gated
            )
        elif _gemv_takes(x, weight):
            if gated and n % 2:
                return None
            cfg = launch_config(row, n, None, row_stages, row_fold)
            if not norm_fold.fold_pays(row, n, cfg.block_n):
                return None
            out, normed, res = norm_fold.add_rms_norm_gemv(
                *args, layer.bias, config=cfg, gated=gated
            )
        else:
            return None
        return _shaped_as(x, out, normed, res)

    def _prequantized(self, x, residual, norm_weight, eps, layer, gated, config):
        """The norm quantizing one row for the FP8 GEMV after it (norm_quant.py; gated
        only with the activation in the GEMV), or None where that GEMV does not take it."""
        fmt, k = fp8_format_of(layer), x.shape[-1]
        if fmt is None or not _one_norm_row(x, residual, norm_weight):
            return None
        row, weight = x.reshape(1, k), layer.weight
        row_stages, row_fold = _row_settings(config)
        if gated:
            if not (self.gated_gemv and self._gated_fp8_fits(row, layer, row_stages, row_fold)):
                return None
        elif not fp8_gemv.supports(1, fmt, weight):
            return None
        out, normed, res = norm_quant.add_rms_norm_quant_fp8_gemv(
            row, residual.reshape(1, k), norm_weight, eps, weight, layer.weight_scale, fmt,
            layer.bias, num_stages=row_stages, fold=row_fold, gated=gated,
        )  # fmt: skip
        return _shaped_as(x, out, normed, res)

    def rms_norm(self, x, weight, eps):
        return tk.rms_norm(x, weight, eps)

    def fused_add_rms_norm(self, x, residual, weight, eps):
        return tk.fused_add_rms_norm(x, residual, weight, eps)

    def rotary_embedding(self, positions, q, k, cos_sin_cache):
        return tk.rotary_embedding(positions, q, k, cos_sin_cache)

    def silu_and_mul(self, x):
        return tk.silu_and_mul(x)

    def fused_moe(self, x, router_logits, w13, w2, top_k, renormalize, config=None, fp8=None):
        # config: launch settings the tuner measured fastest here (default_config's if None)
        return tk.fused_moe(x, router_logits, w13, w2, top_k, renormalize, config=config, fp8=fp8)

    def store_kv_cache(self, k, v, k_cache, v_cache, slot_mapping, k_scale=None, v_scale=None):
        tk.store_kv_cache(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)

    def rope_and_store_kv(
        self, positions, q, k, v, cos_sin_cache, k_cache, v_cache, slot_mapping,
        k_scale=None, v_scale=None, qk_norm=None,
    ):  # fmt: skip
        args = (positions, q, k, v, cos_sin_cache, k_cache, v_cache, slot_mapping, k_scale,
                v_scale, qk_norm)  # fmt: skip
        if not _qk_norm_fuses(q, qk_norm):
            return rope_and_store_kv_unfused(self, *args)
        return tk.rope_and_store_kv(*args)

    def prepare_attention(self, metadata: AttentionMetadata) -> None:
        # The kernel reads the metadata as is; only make sure the index tensors are
        # int32 and contiguous once per step instead of once per layer.
        import torch

        def i32(t):
            return (
                t
                if t.dtype == torch.int32 and t.is_contiguous()
                else t.to(torch.int32).contiguous()
            )

        metadata.backend_data["triton"] = (
            i32(metadata.block_tables),
            i32(metadata.seq_lens),
            i32(metadata.cu_seqlens_q),
            mixes_decode_rows(metadata),  # a walk over the host lengths: once per step
        )

    def attention_with_prologue(
        self, positions, q, k, v, cos_sin_cache, k_cache, v_cache, metadata: AttentionMetadata,
        scale, k_scale=None, v_scale=None, qk_norm=None, sliding_window=None,
    ):  # fmt: skip
        fits = self.attn_prologue and prologue_fits(q.shape[-1], metadata.max_query_len)
        if not (fits and _qk_norm_fuses(q, qk_norm)):
            return attention_with_prologue_unfused(
                self, positions, q, k, v, cos_sin_cache, k_cache, v_cache, metadata, scale,
                k_scale, v_scale, qk_norm, sliding_window,
            )  # fmt: skip
        prologue = AttentionPrologue(positions, k, v, cos_sin_cache, metadata.slot_mapping, qk_norm)
        return self._attention(
            q, k_cache, v_cache, metadata, scale, k_scale, v_scale, sliding_window, prologue
        )

    def paged_attention(
        self, q, k_cache, v_cache, metadata: AttentionMetadata, scale, k_scale=None, v_scale=None,
        sliding_window=None,
    ):  # fmt: skip
        return self._attention(
            q, k_cache, v_cache, metadata, scale, k_scale, v_scale, sliding_window
        )

    def _attention(
        self, q, k_cache, v_cache, metadata, scale, k_scale, v_scale, sliding_window,
        prologue=None,
    ):  # fmt: skip
        if "triton" not in metadata.backend_data:
            self.prepare_attention(metadata)
        block_tables, seq_lens, cu_seqlens_q, split_rows = metadata.backend_data["triton"]
        return tk.paged_attention(
            q,
            k_cache,
            v_cache,
            block_tables,
            seq_lens,
            cu_seqlens_q,
            metadata.max_query_len,
            metadata.max_seq_len,
            scale,
            num_splits=self.attn_num_splits,
            k_scale=k_scale,
            v_scale=v_scale,
            split_decode_rows=split_rows,
            sliding_window=sliding_window,
            prologue=prologue,
        )
