"""AITER's Triton fused-MoE GEMMs (vLLM's kernels as AMD ships them) behind
KernelBackend.fused_moe, loaded through the shims (aiter_shims.py) off ROCm:
- `moe_op_silu_fused.fused_moe_silu`: each (token, expert) pair's x row times its
  expert's w13 [E, 2I, H], silu(gate) * up in the epilogue -> [M, I] (gate rows
  first, as pdserve stores w13);
- `moe_op.fused_moe`: those rows times w2 [E, H, I], scaled by the routing weight
  -> [T, top_k, H], summed over top_k here.

Routing and alignment are pdserve's (triton/moe_align.py), not AITER's
`moe_align_block_size_triton`: that one declares the pair count a constexpr, so
Triton compiles it anew for every batch size (a stall per new prompt length, and one
per captured decode size at start). Ours has no host synchronisation either, so
decode steps can be captured. Launch settings use pdserve's config vocabulary
(triton/moe_config.py CONFIG_KEYS), translated to aiter's names; default_config's without one."""

from __future__ import annotations

import torch

from services.kernels import aiter_shims

_AITER_NAMES = {"BLOCK_M": "BLOCK_SIZE_M", "BLOCK_N": "BLOCK_SIZE_N", "BLOCK_K": "BLOCK_SIZE_K"}
_AITER_NAMES["GROUP_M"] = "GROUP_SIZE_M"


def aiter_config(config: dict) -> dict:
    """pdserve's launch settings under aiter's key names."""
    return {_AITER_NAMES.get(k, k): v for k, v in config.items()}


class AiterFusedMoE:
    def __init__(self):
        self._gated = aiter_shims.load_triton_op("moe_op_silu_fused")
        self._gemm = aiter_shims.load_triton_op("moe_op")
        import triton.language as tl  # lazy: only where aiter's kernels load

        self._compute_type = {
            torch.bfloat16: tl.bfloat16,
            torch.float16: tl.float16,
            torch.float32: tl.float32,
        }

    def __call__(self, x, router_logits, w13, w2, top_k, renormalize, config=None):
        # lazy: routing, alignment and the default tiles are pdserve's own kernel's
        from services.kernels.triton.moe import _check
        from services.kernels.triton.moe_align import route_and_align
        from services.kernels.triton.moe_config import _check_config, default_config

        _check(x, router_logits, w13, w2, top_k)
        t, h = x.shape
        e, two_i, _ = w13.shape
        inter = two_i // 2
        if t == 0 or h == 0 or inter == 0:
            return torch.zeros_like(x)
        cfg = _check_config(dict(config or default_config(t, e, h, inter, top_k, x.dtype)))
        if cfg.get("kernel") == "gemv":
            raise ValueError("aiter's fused MoE takes tile configs, not pdserve's GEMV path")
        weights, ids, sorted_ids, tile_expert, num_tiles = route_and_align(
            router_logits, top_k, renormalize, cfg["BLOCK_M"], x.dtype
        )
        num_padded = num_tiles * cfg["BLOCK_M"]  # aiter counts rows, not tiles
        m = t * top_k
        weights, ids = weights.view(t, top_k), ids.view(t, top_k)  # aiter's shapes
        launch = aiter_config(cfg)
        compute_type = self._compute_type[x.dtype]
        # the kernels walk x, the weights' K dim and the outputs with unit inner stride
        x = x if x.stride(-1) == 1 else x.contiguous()
        # the gated kernel's C is [M, I] (it takes strides 0 and 1), the plain one's
        # [T, top_k, H] (strides 1 and 2)
        act = torch.empty(m, inter, dtype=x.dtype, device=x.device)
        common = dict(use_fp8_w8a8=False, use_int8_w8a16=False, use_int4_w4a16=False)
        self._gated.fused_moe_silu(
            x, w13, act, None, None, None, weights, ids, sorted_ids, tile_expert,
            num_padded, False, top_k, compute_type, config=dict(launch), **common,
        )  # fmt: skip
        out = torch.empty(t, top_k, h, dtype=x.dtype, device=x.device)
        self._gemm.fused_moe(
            act, w2, out, None, None, None, weights, ids, sorted_ids,
            tile_expert, num_padded, True, 1, compute_type, config=dict(launch), **common,
        )  # fmt: skip
        return out[:, 0] if top_k == 1 else out.sum(dim=1)
