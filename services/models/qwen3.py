"""Qwen3 dense: the Llama decoder plus per-head RMSNorm on q and k before RoPE."""

from __future__ import annotations

from services.models.llama import LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    qk_norm = True
