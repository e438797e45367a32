"""Phi-3 / Phi-4 (Phi3ForCausalLM): the Llama decoder, its checkpoints storing q/k/v and
gate/up already fused (qkv_proj, gate_up_proj), which the loader splits by shard like
separate tensors. Its long-context `longrope` scaling and Phi-4-mini's partial rotary
are refused by the RoPE tables (rope.py)."""

from __future__ import annotations

from services.models.llama import LlamaForCausalLM


class Phi3ForCausalLM(LlamaForCausalLM):
    pass
