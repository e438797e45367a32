"""Llama-family decoder (Llama 2/3, SmolLM, Mistral-style GQA), also the base of Qwen3.

q/k/v and gate/up projections are fused into one matmul each; the loader splits the
checkpoint's separate tensors into the fused ones (see `packed_modules`)."""

from __future__ import annotations

import torch
from torch import nn

from services.kernels import AttentionMetadata, KernelBackend
from services.models.layers import (
    ColumnParallelLinear,
    Linear,
    ParallelLMHead,
    QKVParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from services.models.rope import cos_sin_cache, rope_parameters
from services.models.sliding_window import layer_sliding_windows
from services.models.tensor_parallel import TPGroup

__all__ = ["Attention", "DecoderLayer", "Linear", "LlamaForCausalLM", "MLP", "RMSNorm"]


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, ops: KernelBackend):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps
        self.ops = ops

    def forward(self, x, residual=None):
        if residual is None:
            return self.ops.rms_norm(x, self.weight, self.eps)
        return self.ops.fused_add_rms_norm(x, residual, self.weight, self.eps)

    def into(self, linear: nn.Module, x, residual, gated: bool = False):
        """(linear(normed), normed, x + residual) for normed, x + residual = self(x,
        residual): the norm and the first linear that reads it, which the backend may
        fold into one kernel. linear: a layer ops.linear computes (no all-reduce);
        gated: a gate_up layer, its output through silu_and_mul."""
        return self.ops.add_rms_norm_linear(x, residual, self.weight, self.eps, linear, gated)


class Attention(nn.Module):
    """Self-attention over the paged KV cache. The runner points k_cache / v_cache at
    this layer's slice of the shared cache after allocating it. Under tensor
    parallelism a rank computes its query heads over the KV heads it holds
    (num_heads / num_kv_heads are this rank's)."""

    def __init__(
        self,
        config,
        ops: KernelBackend,
        qk_norm: bool,
        tp: TPGroup,
        biases: tuple[bool, bool],
        sliding_window: int | None = None,
    ):
        super().__init__()
        self.ops = ops
        total_heads = config.num_attention_heads
        total_kv = getattr(config, "num_key_value_heads", None) or total_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // total_heads
        qkv_bias, o_bias = biases
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size, self.head_dim, total_heads, total_kv, qkv_bias, ops, tp
        )
        self.num_heads = total_heads // tp.size
        self.num_kv_heads = len(self.qkv_proj.kv_heads)  # this rank's
        self.total_kv_heads = total_kv
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim**-0.5
        self.o_proj = RowParallelLinear(
            total_heads * self.head_dim, config.hidden_size, o_bias, ops, tp
        )
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, ops) if qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, ops) if qk_norm else None
        # this layer's window (sliding_window.py): keys q - window < k <= q; None: full
        self.sliding_window = sliding_window
        self.k_cache = torch.empty(0)
        self.v_cache = torch.empty(0)
        # FP8 KV cache scales (stored = value / scale): the checkpoint's k_scale /
        # v_scale, set by the loader; the runner makes them 1.0 where absent, or None
        # when the cache holds the model's dtype
        self.k_scale: float | None = None
        self.v_scale: float | None = None

    def forward(self, positions, hidden, cos_sin, meta: AttentionMetadata):
        return self.attend(positions, self.qkv_proj(hidden), cos_sin, meta)

    def attend(self, positions, qkv, cos_sin, meta: AttentionMetadata):
        """The layer from its qkv projection's output on."""
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        qk_norm = None
        if self.q_norm is not None:
            qk_norm = (self.q_norm.weight, self.k_norm.weight, self.q_norm.eps)
        kc, vc, ks, vs = self.k_cache, self.v_cache, self.k_scale, self.v_scale
        # norm (Qwen3), RoPE and the KV write, then attention: fewer kernels where the
        # backend fuses them
        out = self.ops.attention_with_prologue(
            positions, q, k, v, cos_sin, kc, vc, meta, self.scale, ks, vs, qk_norm,
            self.sliding_window,
        )  # fmt: skip
        return self.o_proj(out.reshape(-1, self.q_size))


class MLP(nn.Module):
    """SiLU-gated MLP. intermediate_size: its width when not the config's (a shared
    expert's); reduce_results=False: each rank's partial output, summed by the caller."""

    def __init__(
        self,
        config,
        ops: KernelBackend,
        tp: TPGroup,
        intermediate_size: int | None = None,
        reduce_results: bool = True,
    ):
        super().__init__()
        self.ops = ops
        bias = getattr(config, "mlp_bias", False)
        inter = intermediate_size or config.intermediate_size
        self.gate_up_proj = ColumnParallelLinear(
            config.hidden_size, 2 * inter, bias, ops, tp, shards={0: inter, 1: inter}
        )
        self.down_proj = RowParallelLinear(
            inter, config.hidden_size, bias, ops, tp, reduce_results=reduce_results
        )

    # the entry linear's output goes through silu_and_mul (ops.linear_silu_and_mul)
    entry_gated = True

    @property
    def entry_linear(self) -> nn.Module:
        """The linear that reads the layer's input first (DecoderLayer folds the norm
        before it into it)."""
        return self.gate_up_proj

    def forward(self, x):
        return self.forward_from_entry(self.ops.linear_silu_and_mul(x, self.gate_up_proj), x)

    def forward_from_entry(self, act, x):
        """The layer from its gated entry, silu(gate) * up, on (x: the layer's input)."""
        return self.down_proj(act)


class DecoderLayer(nn.Module):
    def __init__(self, config, ops: KernelBackend, attn: Attention, mlp: nn.Module):
        super().__init__()
        self.self_attn = attn
        self.mlp = mlp  # dense MLP, or a mixture of experts (moe.py)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops)

    def forward(self, positions, hidden, residual, cos_sin, meta):
        # each norm goes in with the linear after it: the backend may fold them together
        if residual is None:
            residual = hidden
            hidden = self.self_attn(positions, self.input_layernorm(hidden), cos_sin, meta)
        else:
            qkv, _, residual = self.input_layernorm.into(self.self_attn.qkv_proj, hidden, residual)
            hidden = self.self_attn.attend(positions, qkv, cos_sin, meta)
        entry, hidden, residual = self.post_attention_layernorm.into(
            self.mlp.entry_linear, hidden, residual, self.mlp.entry_gated
        )
        return self.mlp.forward_from_entry(entry, hidden), residual


class LlamaModel(nn.Module):
    def __init__(self, config, ops: KernelBackend, make_attention, make_mlp, tp: TPGroup):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp)
        self.layers = nn.ModuleList(
            DecoderLayer(config, ops, make_attention(config, ops, i), make_mlp(config, ops, i))
            for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops)

    def forward(self, input_ids, positions, cos_sin, meta):
        hidden, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual, cos_sin, meta)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class LlamaForCausalLM(nn.Module):
    qk_norm = False
    # checkpoint name -> (fused parameter name, shard id)
    packed_modules = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    # checkpoint name fragment -> ours, applied before everything else (MoE families
    # name their expert block differently)
    checkpoint_renames: dict[str, str] = {}
    # MoE families: a per-expert checkpoint tensor name -> (stacked parameter, shard)
    expert_modules: dict[str, tuple[str, int | None]] = {}

    def __init__(self, config, ops: KernelBackend, tp: TPGroup | None = None):
        super().__init__()
        act = getattr(config, "hidden_act", "silu")
        if act != "silu":  # every family here has a SiLU-gated MLP (silu_and_mul)
            raise ValueError(f"hidden_act {act!r} (config.json) is not supported: silu only")
        self.config = config
        self.tp = tp or TPGroup()
        self.model = LlamaModel(config, ops, self.make_attention, self.make_mlp, self.tp)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, ops, self.tp)
        self.tie_weights()
        self.cos_sin_cache = torch.empty(0)

    def attention_biases(self, config) -> tuple[bool, bool]:
        """(q/k/v bias, o bias): Llama's `attention_bias` covers all four."""
        bias = bool(getattr(config, "attention_bias", False))
        return bias, bias

    def make_attention(self, config, ops: KernelBackend, layer_idx: int) -> Attention:
        return Attention(
            config,
            ops,
            self.qk_norm,
            self.tp,
            self.attention_biases(config),
            layer_sliding_windows(config)[layer_idx],
        )

    def make_mlp(self, config, ops: KernelBackend, layer_idx: int) -> nn.Module:
        """The MLP of decoder layer layer_idx (MoE families override this)."""
        return MLP(config, ops, self.tp)

    def tie_weights(self) -> None:
        # Module._apply (to_empty, .to) may replace parameters one module at a time,
        # which silently unties them: call again after moving the model.
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def init_rope_cache(self, max_position: int, device) -> None:
        head_dim = self.model.layers[0].self_attn.head_dim
        table = cos_sin_cache(head_dim, max_position, rope_parameters(self.config))
        self.cos_sin_cache = table.to(device)

    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn for layer in self.model.layers]

    def forward(self, input_ids, positions, meta: AttentionMetadata):
        return self.model(input_ids, positions, self.cos_sin_cache, meta)

    def compute_logits(self, hidden):
        return self.lm_head(hidden)
