"""The `tuned` kernel backend: each call goes to the candidate backend the tuner chose
for that operation and shape class (shape_classes.py names them, tuner.py measures
them). Dispatch is a dict lookup on host-side sizes, so it costs nothing inside
captured CUDA graphs (the choice is baked in at capture). `build_tuned_backend` makes
one from the cached (or, on a first start, freshly measured) choices and overrides."""

from __future__ import annotations

import logging

import torch

from services.kernels.fp8 import fp8_format_of
from services.kernels.interface import (
    AttentionMetadata,
    add_rms_norm_linear_unfused,
    attention_with_prologue_unfused,
    linear_silu_and_mul_unfused,
    rope_and_store_kv_unfused,
)
from services.kernels.shape_classes import (
    KernelShapes,
    all_keys,
    attention_class,
    graph_blocker,
    mixed_graph_blocker,
    parse_choices,
    token_class,
)
from services.kernels.tuner import default_candidates, load_candidates, tune

log = logging.getLogger(__name__)

_MEMO_TOKENS = 256  # token counts whose dispatch is remembered (decode-sized steps)


class TunedBackend:
    name = "tuned"

    def __init__(
        self,
        backends: dict[str, object],
        choices: dict[str, str],
        shapes: KernelShapes | None = None,
        configs: dict[str, dict] | None = None,
    ):
        missing = all_keys(shapes) - set(choices)
        if missing:
            raise ValueError(f"no kernel chosen for {sorted(missing)}")
        unknown = {name for name in choices.values() if name not in backends}
        if unknown:
            raise ValueError(f"chosen kernel backends not loaded: {sorted(unknown)}")
        self.choices = dict(choices)
        self._fp8 = any(key.startswith("fp8_linear.") for key in choices)
        self._pick = {key: backends[name] for key, name in choices.items()}
        self._memo: dict[tuple[str, int], object] = {}  # (op, token count) -> backend
        # (op, token count) -> (backend, launch settings or None), for linears
        self._linear_memo: dict[tuple[str, int], tuple[object, dict | None]] = {}
        # launch settings the tuner picked with a choice ("op.class" -> config)
        self.configs = {k: dict(v) for k, v in (configs or {}).items() if k in choices}

    def mixed_graph_blocker(self, token_counts) -> str | None:
        """Why mixed steps of these token counts cannot run as CUDA graphs here."""
        return mixed_graph_blocker(self.choices, token_counts)

    def graph_blocker(self, token_counts) -> str | None:
        """Why decode steps of these token counts cannot run as CUDA graphs here."""
        return graph_blocker(self.choices, token_counts)

    def _by_tokens(self, op: str, num_tokens: int):
        # every op of every layer asks: one dict lookup once a token count was seen
        backend = self._memo.get((op, num_tokens))
        if backend is None:
            backend = self._pick[f"{op}.{token_class(num_tokens)}"]
            if num_tokens <= _MEMO_TOKENS:
                self._memo[op, num_tokens] = backend
        return backend

    def _linear_pick(self, x, layer) -> tuple[object, dict | None]:
        """The backend chosen for this linear at x's token count, and the launch
        settings tuned with it (None: its defaults)."""
        # FP8 weights have their own op: their candidates and winners differ
        op = "fp8_linear" if fp8_format_of(layer) is not None else "linear"
        if op == "fp8_linear" and not self._fp8:
            raise ValueError(
                "an FP8 linear layer reached a tuned backend built for unquantized weights "
                "(KernelShapes.weight_quant is empty)"
            )
        n = x.shape[0]
        picked = self._linear_memo.get((op, n))
        if picked is None:
            key = f"{op}.{token_class(n)}"
            picked = self._pick[key], self.configs.get(key)
            if n <= _MEMO_TOKENS:
                self._linear_memo[op, n] = picked
        return picked

    def linear(self, x, layer):
        backend, config = self._linear_pick(x, layer)
        if config is None:
            return backend.linear(x, layer)
        return backend.linear(x, layer, config=config)

    def add_rms_norm_linear(self, x, residual, norm_weight, eps, layer, gated=False):
        backend, config = self._linear_pick(x, layer)
        n = x.shape[0]
        if backend is not self._by_tokens("fused_add_rms_norm", n):
            # each op on its own winner
            return add_rms_norm_linear_unfused(self, x, residual, norm_weight, eps, layer, gated)
        # one backend won the norm and the linear: its fold, with the SiLU too where it
        # won that as well
        in_fold = gated and backend is self._by_tokens("silu_and_mul", n)
        args = (x, residual, norm_weight, eps, layer, in_fold)
        out, normed, residual = (
            backend.add_rms_norm_linear(*args)
            if config is None
            else backend.add_rms_norm_linear(*args, config=config)
        )
        return (self.silu_and_mul(out) if gated and not in_fold else out), normed, residual

    def linear_silu_and_mul(self, x, layer):
        backend, config = self._linear_pick(x, layer)
        if backend is not self._by_tokens("silu_and_mul", x.shape[0]):
            return linear_silu_and_mul_unfused(self, x, layer)  # each op on its own winner
        if config is None:
            return backend.linear_silu_and_mul(x, layer)
        return backend.linear_silu_and_mul(x, layer, config=config)

    def rms_norm(self, x, weight, eps):
        return self._by_tokens("rms_norm", x.shape[0]).rms_norm(x, weight, eps)

    def fused_add_rms_norm(self, x, residual, weight, eps):
        backend = self._by_tokens("fused_add_rms_norm", x.shape[0])
        return backend.fused_add_rms_norm(x, residual, weight, eps)

    def rotary_embedding(self, positions, q, k, cos_sin_cache):
        backend = self._by_tokens("rotary_embedding", q.shape[0])
        return backend.rotary_embedding(positions, q, k, cos_sin_cache)

    def silu_and_mul(self, x):
        return self._by_tokens("silu_and_mul", x.shape[0]).silu_and_mul(x)

    def store_kv_cache(self, k, v, k_cache, v_cache, slot_mapping, k_scale=None, v_scale=None):
        backend = self._by_tokens("store_kv_cache", k.shape[0])
        backend.store_kv_cache(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)

    def rope_and_store_kv(
        self, positions, q, k, v, cos_sin_cache, k_cache, v_cache, slot_mapping,
        k_scale=None, v_scale=None, qk_norm=None,
    ):  # fmt: skip
        args = (positions, q, k, v, cos_sin_cache, k_cache, v_cache, slot_mapping, k_scale,
                v_scale, qk_norm)  # fmt: skip
        winner = self._one_winner(self._prologue_winners(q.shape[0], qk_norm))
        if winner is not None:  # one backend won every op here: its own (fused) version
            return winner.rope_and_store_kv(*args)
        return rope_and_store_kv_unfused(self, *args)  # each op on its own winner

    def attention_with_prologue(
        self, positions, q, k, v, cos_sin_cache, k_cache, v_cache, metadata: AttentionMetadata,
        scale, k_scale=None, v_scale=None, qk_norm=None, sliding_window=None,
    ):  # fmt: skip
        args = (positions, q, k, v, cos_sin_cache, k_cache, v_cache, metadata, scale, k_scale,
                v_scale, qk_norm, sliding_window)  # fmt: skip
        attention = self._pick[f"paged_attention.{attention_class(metadata)}"]
        winner = self._one_winner(self._prologue_winners(q.shape[0], qk_norm) + [attention])
        if winner is not None:  # one backend won the prologue's ops and the attention
            return winner.attention_with_prologue(*args)
        return attention_with_prologue_unfused(self, *args)

    def _prologue_winners(self, n_tokens: int, qk_norm) -> list:
        ops = ("rotary_embedding", "store_kv_cache") + (("rms_norm",) if qk_norm else ())
        return [self._by_tokens(op, n_tokens) for op in ops]

    @staticmethod
    def _one_winner(backends: list):
        return backends[0] if all(b is backends[0] for b in backends) else None

    def fused_moe(self, x, router_logits, w13, w2, top_k, renormalize, fp8=None):
        # built from a MoE model's shapes, the backend has a choice for every class
        key = f"fused_moe.{token_class(x.shape[0])}"
        backend, config = self._pick[key], self.configs.get(key)
        kwargs = {} if fp8 is None else {"fp8": fp8}
        if config is not None:
            kwargs["config"] = config
        return backend.fused_moe(x, router_logits, w13, w2, top_k, renormalize, **kwargs)

    def prepare_attention(self, metadata: AttentionMetadata) -> None:
        self._pick[f"paged_attention.{attention_class(metadata)}"].prepare_attention(metadata)

    def paged_attention(
        self, q, k_cache, v_cache, metadata: AttentionMetadata, scale, k_scale=None, v_scale=None,
        sliding_window=None,
    ):  # fmt: skip
        backend = self._pick[f"paged_attention.{attention_class(metadata)}"]
        return backend.paged_attention(
            q, k_cache, v_cache, metadata, scale, k_scale, v_scale, sliding_window
        )


def build_tuned_backend(shapes: KernelShapes, device, choices=None, **tune_kwargs):
    """A TunedBackend for these shapes on this device; `choices` override the tuner's.
    When the overrides cover every op and class nothing is measured."""
    overrides = parse_choices(choices, graphs=torch.device(device).type == "cuda")
    configs: dict[str, dict] = {}
    if set(overrides) >= all_keys(shapes):
        picked = overrides
        backends = load_candidates(tuple(set(picked.values())))
    else:
        backends = load_candidates(default_candidates(device))
        result = tune(shapes, device, candidates=backends, **tune_kwargs)
        log.info(
            "kernel choices (%s%s):\n%s",
            result.device_name,
            ", cached" if result.from_cache else "",
            result.table(),
        )
        picked = {**result.choices, **overrides}
        # a tuned config belongs to the candidate it was measured with
        configs = {k: c for k, c in result.configs.items() if picked[k] == result.choices[k]}
    missing = {name for name in picked.values() if name not in backends}
    if missing:
        raise ValueError(f"kernel candidates {sorted(missing)} are not available here")
    return TunedBackend(backends, picked, shapes, configs)
