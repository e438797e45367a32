"""The kernel tuner's representative inputs: for one op and shape class, the tensors a
candidate runs on (same seed for every candidate and dtype, so its output can be
compared with the fp32 torch reference), built at the model's own shapes
(KernelShapes) and the class's token counts (tuner.TuningSizes)."""

from __future__ import annotations

import zlib

import torch

from services.kernels.fp8 import Fp8Experts, fp8_max, platform_fp8_dtype
from services.kernels.interface import AttentionMetadata
from services.kernels.shape_classes import DECODE_CLASSES, KernelShapes

# A decode step on a CPU streams every layer's weights once: a few rows times one
# layer's weights, timed alone, run from the cache and ranked the candidates otherwise
# than the engine sees them (SmolLM2 fp32 at 4-24 rows: the plain GEMM first from the
# cache, oneDNN's prepacked weights 15% ahead over all 30 layers). Decode-sized linears
# are timed over the model's layers' worth of weights, up to this many bytes.
_CPU_WORKING_SET_BYTES = 1 << 30


def _cpu_copies(shapes: KernelShapes, num_tokens: int, device, dtype) -> int:
    """How many layers' weights a linear case runs through (1: one layer)."""
    if torch.device(device).type != "cpu" or num_tokens > DECODE_CLASSES["decode64"]:
        return 1  # a GPU's HBM, or compute-bound: where the weights sit hardly matters
    layer_bytes = sum(i * o for i, o in shapes.linear_shapes()) * dtype.itemsize
    return max(1, min(shapes.num_layers, _CPU_WORKING_SET_BYTES // layer_bytes))


def _copy(layer: torch.nn.Linear) -> torch.nn.Linear:
    """Another layer with the same weights in memory of its own."""
    out = torch.nn.Linear(layer.in_features, layer.out_features, bias=False, device="meta")
    out.weight = torch.nn.Parameter(layer.weight.detach().clone(), False)
    return out


def run_case(op, cls, shapes: KernelShapes, sizes, device, dtype, backend, config=None):
    """Build the op's inputs (same seed for every candidate and dtype), run it once;
    returns (a no-argument callable that runs it again, the first output). config:
    launch settings for a TUNED_CONFIG_CANDIDATES kernel."""
    gen = torch.Generator().manual_seed(zlib.crc32(f"{op}.{cls}".encode()))

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(device=device, dtype=dtype)

    n = sizes.tokens(cls)
    linear_kw = {} if config is None else {"config": config}  # linear, fp8_linear
    h, eps = shapes.hidden_size, shapes.rms_norm_eps
    hq, hk, d = shapes.num_q_heads, shapes.num_kv_heads, shapes.head_dim
    if op == "linear":
        layers = []
        for fan_in, fan_out in shapes.linear_shapes():
            layer = torch.nn.Linear(fan_in, fan_out, bias=False, device="meta")
            layer.weight = torch.nn.Parameter(rand(fan_out, fan_in, scale=fan_in**-0.5), False)
            layers.append((rand(n, fan_in), layer))
        compared = len(layers)
        layers += [
            (x, _copy(layer)) for x, layer in layers * (_cpu_copies(shapes, n, device, dtype) - 1)
        ]

        def call():
            return [backend.linear(x, layer, **linear_kw) for x, layer in layers][:compared]
    elif op == "fp8_linear":
        fmt = shapes.fp8_format()
        layers = [
            (rand(n, k), random_fp8_layer(k, out, fmt, gen, device))
            for k, out in shapes.linear_shapes()
        ]

        def call():
            return [backend.linear(x, layer, **linear_kw) for x, layer in layers]
    elif op == "rms_norm":
        x, w = rand(n, h), rand(h)

        def call():
            return backend.rms_norm(x, w, eps)
    elif op == "fused_add_rms_norm":
        x, r, w = rand(n, h), rand(n, h), rand(h)

        def call():
            return backend.fused_add_rms_norm(x, r, w, eps)
    elif op == "rotary_embedding":
        q, k = rand(n, hq, d), rand(n, hk, d)
        max_pos = 4 * n
        angles = torch.arange(max_pos).unsqueeze(1) * torch.rand(d // 2, generator=gen)
        cos_sin = torch.cat([angles.cos(), angles.sin()], dim=-1).to(device=device, dtype=dtype)
        positions = torch.randint(0, max_pos, (n,), generator=gen).to(device)

        def call():
            return backend.rotary_embedding(positions, q, k, cos_sin)
    elif op == "silu_and_mul":
        x = rand(n, 2 * shapes.intermediate_size)

        def call():
            return backend.silu_and_mul(x)
    elif op == "fused_moe":
        e, k, inter = shapes.num_experts, shapes.top_k, shapes.moe_intermediate_size
        x = rand(n, h)
        kwargs = {}
        if shapes.fp8_experts:  # the model keeps its experts in FP8: measure those
            fmt = shapes.expert_fp8_format()
            w13, s13 = random_fp8_experts(e, 2 * inter, h, fmt, gen, device)
            w2, s2 = random_fp8_experts(e, h, inter, fmt, gen, device)
            kwargs["fp8"] = Fp8Experts(s13, s2, fmt)
        else:
            w13, w2 = rand(e, 2 * inter, h, scale=h**-0.5), rand(e, h, inter, scale=inter**-0.5)
        # each row a permutation of distinct logits that every dtype holds exactly: the
        # same experts win in bf16 as in the fp32 reference (no near-ties to flip)
        ranks = torch.argsort(torch.rand(n, e, generator=gen), dim=-1).float()
        logits = (ranks * 0.25).to(device=device, dtype=dtype)

        if config is not None:
            kwargs["config"] = config

        def call():
            return backend.fused_moe(x, logits, w13, w2, k, True, **kwargs)
    elif op == "store_kv_cache":
        bs = shapes.block_size
        num_blocks = -(-n // bs) * 2 + 1
        k, v = rand(n, hk, d), rand(n, hk, d)
        kv_dtype, kv_scales = kv_cache_case(shapes, dtype, device)
        if kv_scales:  # FP8: the reference quantizes the very values the candidate sees
            k, v = (t.to(shapes.torch_dtype).to(dtype) for t in (k, v))
        cache = torch.zeros(num_blocks, 2, bs, hk, d, device=device, dtype=kv_dtype)
        slots = torch.randperm(num_blocks * bs, generator=gen)[:n].to(device)

        def call():
            backend.store_kv_cache(k, v, cache[:, 0], cache[:, 1], slots, *kv_scales)
            return cache
    else:
        q, k_cache, v_cache, meta = attention_batch(cls, shapes, sizes, device, dtype, gen)
        backend.prepare_attention(meta)
        scale = d**-0.5
        kv_scales = kv_cache_case(shapes, dtype, device)[1]

        def call():
            return backend.paged_attention(q, k_cache, v_cache, meta, scale, *kv_scales)

    out = call()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return call, out


def rel_err(out, ref) -> float:
    """The worst relative Frobenius error of out (a tensor or a sequence of them) against ref;
    inf where shapes differ or a value is not finite."""
    outs = out if isinstance(out, (tuple, list)) else (out,)
    refs = ref if isinstance(ref, (tuple, list)) else (ref,)
    worst = 0.0
    for o, r in zip(outs, refs):
        o, r = o.float().cpu(), r.float().cpu()
        if o.shape != r.shape or not torch.isfinite(o).all():
            return float("inf")
        worst = max(worst, float((o - r).norm() / r.norm().clamp_min(1e-12)))
    return worst


def kv_cache_case(shapes: KernelShapes, dtype, device) -> tuple[torch.dtype, tuple[float, ...]]:
    """The KV cache dtype and (k_scale, v_scale) the KV ops are measured with: an FP8
    cache is the FP8 type the engine allocates on this device (fnuz on MI300) and gets
    scales other than 1.0 (powers of two: exact in every dtype), so a candidate that
    ignores them strays from the reference and is rejected."""
    if shapes.kv_cache_dtype == "fp8_e4m3":
        return platform_fp8_dtype(device), (0.5, 2.0)
    return dtype, ()


class _Fp8Layer(torch.nn.Module):
    """What FP8 kernels read of a quantized linear (services/models/fp8_linear.py's
    Fp8Linear; the kernels package does not import models): weight, weight_scale,
    bias and the fp8_format attribute."""

    def __init__(self, weight, weight_scale, fmt):
        super().__init__()
        self.weight = torch.nn.Parameter(weight, requires_grad=False)
        self.weight_scale = torch.nn.Parameter(weight_scale, requires_grad=False)
        self.register_parameter("bias", None)
        self.fp8_format = fmt


def random_fp8_layer(k: int, n: int, fmt, gen, device) -> _Fp8Layer:
    """Weights uniform in +-k**-0.5 once dequantized, as dummy FP8 weights are, in the
    FP8 type the model's weights have on this device (fnuz on MI300)."""
    dtype = platform_fp8_dtype(device)
    top = fp8_max(dtype)
    weight = (torch.rand(n, k, generator=gen) * 2 - 1) * top
    scale = torch.full(fmt.scale_shape(n, k), k**-0.5 / top)
    return _Fp8Layer(weight.to(dtype).to(device), scale.to(device), fmt)


def random_fp8_experts(e: int, n: int, k: int, fmt, gen, device):
    """E stacked [n, k] FP8 expert weights, uniform in +-k**-0.5 once dequantized, with
    their block or channel scales (the FP8 type of this device: fnuz on MI300)."""
    dtype = platform_fp8_dtype(device)
    top = fp8_max(dtype)
    weight = (torch.rand(e, n, k, generator=gen) * 2 - 1) * top
    blocks = fmt.granularity == "block"
    shape = (e, n // fmt.block_n, k // fmt.block_k) if blocks else (e, n)
    scale = torch.full(shape, k**-0.5 / top)
    return weight.to(dtype).to(device), scale.to(device)


def attention_batch(cls, shapes, sizes, device, dtype, gen):
    if cls in DECODE_CLASSES:
        n = sizes.tokens(cls)
        q_lens, ctx = [1] * n, [sizes.decode_ctx] * n
    elif cls == "prefill":
        q_lens, ctx = [sizes.prefill_len] * sizes.prefill_seqs, [0] * sizes.prefill_seqs
    else:  # one chunk after a cached prefix, riding along with decodes
        decodes = max(1, sizes.tokens("decode64") - 1)
        q_lens = [sizes.mixed_chunk] + [1] * decodes
        ctx = [sizes.mixed_chunk] + [sizes.decode_ctx] * decodes
    bs = shapes.block_size
    seq_lens = [c + q for c, q in zip(ctx, q_lens)]
    per_seq = [-(-s // bs) for s in seq_lens]
    num_blocks = sum(per_seq) + 1
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables, i = [], 0
    for nb in per_seq:
        tables.append(perm[i : i + nb])
        i += nb
    width = max(per_seq)
    hk, d = shapes.num_kv_heads, shapes.head_dim
    # the engine's block-major cache: per-layer K/V are strided views
    kv_dtype = kv_cache_case(shapes, dtype, device)[0]  # FP8: the same bytes for every candidate
    kv = (torch.randn(num_blocks, 2, 2, bs, hk, d, generator=gen)).to(device=device, dtype=kv_dtype)
    cu = [0]
    for n in q_lens:
        cu.append(cu[-1] + n)
    slots = [
        t[p // bs] * bs + p % bs for t, c, n in zip(tables, ctx, q_lens) for p in range(c, c + n)
    ]
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        cu_seqlens_q=torch.tensor(cu, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=torch.tensor(
            [t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=device
        ),
        max_query_len=max(q_lens),
        max_seq_len=max(seq_lens),
        block_size=bs,
        cu_seqlens_q_cpu=cu,
        seq_lens_cpu=seq_lens,
    )
    q = torch.randn(cu[-1], shapes.num_q_heads, d, generator=gen).to(device=device, dtype=dtype)
    return q, kv[:, 1, 0], kv[:, 1, 1], meta
