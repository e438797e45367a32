"""Qwen2 / Qwen2.5 dense (and the models distilled onto them): the Llama decoder with a
bias on the q, k and v projections and none on o (transformers' Qwen2Attention)."""

from __future__ import annotations

from services.models.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    def attention_biases(self, config) -> tuple[bool, bool]:
        # Qwen2's config has no bias key (always on); Qwen2-MoE's names it qkv_bias
        return bool(getattr(config, "qkv_bias", True)), False
