"""pdserve's own Triton kernels (NVIDIA and AMD): paged attention over mixed decode /
chunked-prefill batches, KV-cache write, (fused residual-add +) RMSNorm, neox RoPE,
SiLU-and-mul, the attention prologue in one launch (q/k norm, RoPE, KV write), a GEMV
for decode-sized linears (<= 8 rows; larger GEMMs stay on cuBLAS) and a GEMM for FP8
linears (block-wise or per-channel scales). Each takes
strides, so strided views (fused qkv slices, the per-layer views of the block-major KV
cache) need no copies.

Set TRITON_INTERPRET=1 before importing triton to run them on a CPU (slow; tests)."""

from services.kernels.triton.activation import silu_and_mul
from services.kernels.triton.attention import attention_config, paged_attention
from services.kernels.triton.cache import store_kv_cache
from services.kernels.triton.fp8_gemm import fp8_linear
from services.kernels.triton.gemv import gemv
from services.kernels.triton.moe import fused_moe
from services.kernels.triton.norm import fused_add_rms_norm, rms_norm
from services.kernels.triton.rope import rotary_embedding
from services.kernels.triton.rope_cache import rope_and_store_kv

__all__ = [
    "attention_config",
    "fused_add_rms_norm",
    "fp8_linear",
    "fused_moe",
    "gemv",
    "paged_attention",
    "rms_norm",
    "rope_and_store_kv",
    "rotary_embedding",
    "silu_and_mul",
    "store_kv_cache",
]
