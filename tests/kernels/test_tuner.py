"""The kernel tuner: every op and shape class gets a measured, correct, capture-safe
choice; choices are cached per device and reused; a candidate with wrong output is
rejected. (Shape classes and override parsing: test_shape_classes.py; the engine on the
tuned backend: test_engine_backends.py.) On a CPU the Triton candidates run under the
interpreter, so shapes are tiny and the times mean nothing: the mechanics are tested."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from services.engine import EngineConfig  # noqa: E402
from services.kernels import get_backend  # noqa: E402
from services.kernels.shape_classes import (  # noqa: E402
    FP8_OPS,
    GRAPH_CLASSES,
    MOE_OPS,
    NOT_GRAPH_SAFE,
    OP_CLASSES,
    KernelShapes,
    candidates_for,
)
from services.kernels.torch_backend import TorchBackend  # noqa: E402
from services.kernels.tuner import TuningSizes, cache_file, load_candidates, tune  # noqa: E402

SHAPES = KernelShapes(
    hidden_size=64,
    num_q_heads=4,
    num_kv_heads=2,
    head_dim=16,
    intermediate_size=96,
    block_size=16,
    dtype="float32",
)
ALL_KEYS = {f"{op}.{c}" for op, cs in OP_CLASSES.items() for c in cs if op not in MOE_OPS + FP8_OPS}
MOE_SHAPES = KernelShapes(
    **{**SHAPES.__dict__, "num_experts": 4, "top_k": 2, "moe_intermediate_size": 32}
)


@pytest.fixture(scope="module")
def candidates():
    # aiter's kernels are slow under the interpreter; test_aiter covers them
    return load_candidates(("torch", "triton", "sdpa"))


@pytest.fixture(scope="module")
def sizes(device):
    return TuningSizes.tiny() if device == "cpu" else TuningSizes()


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_tune_picks_a_fast_correct_capture_safe_candidate_and_caches_it(
    tmp_path, candidates, sizes, device
):
    shapes = SHAPES if device == "cpu" else KernelShapes(4096, 32, 8, 128, 14336, 16, "bfloat16")
    result = tune(
        shapes, device, candidates=candidates, sizes=sizes, cache_dir=tmp_path, graphs=True
    )
    assert not result.from_cache
    assert set(result.choices) == ALL_KEYS
    for key, choice in result.choices.items():
        op, cls = key.split(".")
        times = result.times_us[key]
        if not times:  # a CPU takes the reference unmeasured where it is the only one
            assert device == "cpu" and choice == "torch", key
            assert [n for n in candidates_for(op, cls) if n in candidates] == ["torch"], key
            continue
        assert times, f"{key}: no candidate measured ({result.rejected.get(key)})"
        assert choice == min(times, key=times.get)
        assert all(t > 0 for t in times.values())
        if cls in GRAPH_CLASSES:
            assert choice not in NOT_GRAPH_SAFE.get(op, ()), key
            assert not set(times) & NOT_GRAPH_SAFE.get(op, set()), key
    assert "sdpa" in result.times_us["paged_attention.prefill"]
    assert "triton" in result.times_us["linear.decode8"]  # own GEMV
    assert "triton" not in result.times_us["linear.prefill"]
    assert result.rejected == {}, result.rejected
    files = list(tmp_path.glob("*.json"))
    assert len(files) == 1 and result.device_name.lower().split()[0] in files[0].name

    again = tune(
        shapes, device, candidates=candidates, sizes=sizes, cache_dir=tmp_path, graphs=True
    )
    assert again.from_cache and again.choices == result.choices
    assert again.times_us == result.times_us
    fresh = tune(
        shapes,
        device,
        candidates=candidates,
        sizes=sizes,
        cache_dir=tmp_path,
        retune=True,
        graphs=True,
    )
    assert not fresh.from_cache and set(fresh.choices) == ALL_KEYS
    table = result.table()
    assert table.count("\n") == len(ALL_KEYS) + 1 and "| paged_attention | prefill |" in table
    assert table.splitlines()[0].endswith("| choice | vs torch |")


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_a_moe_model_gets_fused_moe_choices_that_capture(tmp_path, candidates):
    """Only MoE shapes add fused_moe; its decode and prefill classes never take the torch
    reference (it syncs with the host; both run as graphs); the tuned backend refuses to run without those choices."""
    from services.kernels.tuned_backend import TunedBackend

    sizes = TuningSizes.tiny()
    result = tune(
        MOE_SHAPES, "cpu", candidates=candidates, sizes=sizes, cache_dir=tmp_path, graphs=True
    )
    moe_keys = {f"fused_moe.{c}" for c in OP_CLASSES["fused_moe"]}
    assert set(result.choices) == ALL_KEYS | moe_keys
    assert result.rejected == {}, result.rejected
    for cls in GRAPH_CLASSES:
        assert result.choices[f"fused_moe.{cls}"] == "triton"
        assert "torch" not in result.times_us[f"fused_moe.{cls}"]
    # prefill-sized steps mixing chunks and decode rows are captured too (mixed_graph.py)
    assert set(result.times_us["fused_moe.prefill"]) == {"triton"}
    with pytest.raises(ValueError, match="fused_moe"):
        TunedBackend(
            candidates, {k: v for k, v in result.choices.items() if k in ALL_KEYS}, MOE_SHAPES
        )
    # the launch settings go with the choice (CPU: the kernel's default, not swept)
    from services.kernels.triton.moe_config import default_config

    for cls in OP_CLASSES["fused_moe"]:
        key = f"fused_moe.{cls}"
        if result.choices[key] == "triton":
            want_cfg = default_config(sizes.tokens(cls), 4, 64, 32, 2, torch.float32)
            assert result.configs[key] == want_cfg, key
        else:
            assert key not in result.configs
    assert "| fused_moe | decode1 |" in result.table() and " g1 w4 " in result.table()
    again = tune(
        MOE_SHAPES, "cpu", candidates=candidates, sizes=sizes, cache_dir=tmp_path, graphs=True
    )
    assert again.from_cache and again.configs == result.configs
    backend = TunedBackend(candidates, result.choices, MOE_SHAPES, result.configs)
    assert backend.configs == result.configs
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 64, generator=gen)
    logits = torch.randn(3, 4, generator=gen)
    w13, w2 = (
        torch.randn(4, 64, 64, generator=gen) * 0.1,
        torch.randn(4, 64, 32, generator=gen) * 0.1,
    )
    want = TorchBackend().fused_moe(x, logits, w13, w2, 2, True)
    torch.testing.assert_close(
        backend.fused_moe(x, logits, w13, w2, 2, True), want, rtol=1e-4, atol=1e-4
    )


class _Recording:
    """Observes the config the tuned backend hands to one op of pdserve's Triton."""

    name = "triton"

    def __init__(self, inner, op: str):
        self.inner, self.op, self.seen = inner, op, []

    def __getattr__(self, name):
        method = getattr(self.inner, name)
        if name != self.op:
            return method

        def recorded(*args, config=None):
            self.seen.append(config)
            return method(*args, config=config)

        return recorded


def test_tuned_backend_passes_the_tuned_launch_config(candidates):
    from services.kernels.tuned_backend import TunedBackend

    spy = _Recording(candidates["triton"], "fused_moe")
    choices = {k: "torch" for k in ALL_KEYS}
    choices |= {f"fused_moe.{c}": "triton" for c in OP_CLASSES["fused_moe"]}
    small = dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=16, GROUP_M=2, num_warps=4, num_stages=2)
    backend = TunedBackend(
        {"torch": candidates["torch"], "triton": spy},
        choices,
        MOE_SHAPES,
        {"fused_moe.decode8": small},
    )
    gen = torch.Generator().manual_seed(1)
    w13, w2 = torch.randn(4, 64, 64, generator=gen) * 0.1, torch.randn(4, 64, 32, generator=gen)
    for t in (3, 1):  # decode8, then decode1 (no tuned config: the kernel's default)
        x, logits = torch.randn(t, 64, generator=gen), torch.randn(t, 4, generator=gen)
        out = backend.fused_moe(x, logits, w13, w2, 2, True)
        want = TorchBackend().fused_moe(x, logits, w13, w2, 2, True)
        torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-4)
    assert spy.seen == [small, None]


def test_tuned_backend_passes_the_tuned_row_stages(candidates):
    """linear.decode1's tuned K-loop depth goes with every one-row call, nothing with
    the other classes' calls."""
    from services.kernels.tuned_backend import TunedBackend

    spy = _Recording(candidates["triton"], "linear")
    choices = {k: "torch" for k in ALL_KEYS} | {"linear.decode1": "triton"}
    choices["linear.decode8"] = "triton"
    tuned = {"linear.decode1": {"row_stages": 3}}
    backend = TunedBackend({"torch": candidates["torch"], "triton": spy}, choices, SHAPES, tuned)
    gen = torch.Generator().manual_seed(3)
    layer = torch.nn.Linear(64, 48)
    for rows in (1, 3, 1):
        x = torch.randn(rows, 64, generator=gen)
        torch.testing.assert_close(backend.linear(x, layer), layer(x), rtol=1e-5, atol=1e-5)
    assert spy.seen == [{"row_stages": 3}, None, {"row_stages": 3}]


def test_one_row_gemvs_tune_their_k_loop_depth_on_a_gpu():
    """A GPU times the one-row GEMV (linear, fp8_linear) at each K-loop depth and with
    a folded tile at decode1 only (more rows run other kernels); a CPU (the
    interpreter) its default."""
    from services.kernels.tuner import ROW_FOLDS, ROW_STAGES, _launch_configs, config_label

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert 1 in ROW_STAGES and len(ROW_STAGES) > 1  # today's plain loads stay a candidate
    for op in ("linear", "fp8_linear"):
        got = _launch_configs(op, "decode1", SHAPES, None, cuda, {})
        folded = [{"row_stages": 1, "row_fold": tile} for tile in ROW_FOLDS[op]]
        assert got == [{"row_stages": s} for s in ROW_STAGES] + folded
        assert _launch_configs(op, "decode8", SHAPES, None, cuda, {}) == [None]
        assert _launch_configs(op, "decode1", SHAPES, None, cpu, {}) == [None]
    assert config_label({"row_stages": 3}) == "gemv s3"
    assert config_label({"row_stages": 1, "row_fold": [2048, 8, 4]}) == "gemv s1 k2048f8w4"
    sixteen = {"row_stages": 1, "row_fold": [2048, 16, 4, 16]}
    assert config_label(sixteen) == "gemv s1 k2048f16w4 n16"
    assert any(len(t) == 4 for t in ROW_FOLDS["fp8_linear"])  # 16 rows share x's quantization
    moe = {"kernel": "gemv", "BLOCK_N": 8, "BLOCK_K": 256, "num_warps": 4}
    assert config_label(moe) == "gemv 8x256 w4"
    assert config_label({**moe, "num_stages": 3, "down_num_stages": 2}) == "gemv 8x256 w4 s3 ds2"


class _WrongNorm(TorchBackend):
    """A deliberately broken candidate (fault injected on purpose)."""

    name = "wrong"

    def rms_norm(self, x, weight, eps):
        return torch.zeros_like(x)


def test_a_candidate_with_wrong_output_is_rejected(tmp_path, monkeypatch):
    import services.kernels.shape_classes as shape_classes

    monkeypatch.setitem(shape_classes.CANDIDATES, "rms_norm", ("torch", "wrong"))
    cands = {"torch": TorchBackend(), "wrong": _WrongNorm()}
    result = tune(SHAPES, "cpu", candidates=cands, sizes=TuningSizes.tiny(), cache_dir=tmp_path)
    for cls in OP_CLASSES["rms_norm"]:
        assert result.choices[f"rms_norm.{cls}"] == "torch"
        assert "relative error" in result.rejected[f"rms_norm.{cls}"]["wrong"]
        assert "wrong" not in result.times_us[f"rms_norm.{cls}"]


def test_tuning_sizes_need_one_count_per_decode_class():
    with pytest.raises(ValueError, match="one token count per decode class"):
        TuningSizes(decode_tokens=(2, 24, 128))


def test_engine_config_validates_kernel_options():
    with pytest.raises(ValueError, match="kernel_backend must be one of"):
        EngineConfig(model="x", kernel_backend="cutlass")
    with pytest.raises(ValueError, match="only applies to the tuned"):
        EngineConfig(model="x", kernel_backend="torch", kernel_choices="rms_norm=torch")
    with pytest.raises(ValueError, match="unknown kernel op"):
        EngineConfig(model="x", kernel_backend="tuned", kernel_choices="gemm=torch")
    assert EngineConfig(model="x", device="cpu").kernel_backend_name == "tuned"
    assert EngineConfig(model="x", device="cuda:0").kernel_backend_name == "tuned"


def test_get_backend_tuned_needs_shapes():
    with pytest.raises(ValueError, match="needs the model shapes"):
        get_backend("tuned")


def test_cache_location_and_unwritable_cache(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path / "models"))
    monkeypatch.delenv("PDSERVE_KERNEL_TUNING_DIR", raising=False)
    assert cache_file("NVIDIA H200") == tmp_path / "models" / "kernel_tuning" / "nvidia-h200.json"
    monkeypatch.setenv("PDSERVE_KERNEL_TUNING_DIR", str(tmp_path / "tuning"))
    assert cache_file("NVIDIA H200") == tmp_path / "tuning" / "nvidia-h200.json"
    # a cache that cannot be written (here: its folder would be under a file) is skipped
    # with a warning: the worker still starts with the measured choices
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("PDSERVE_KERNEL_TUNING_DIR", str(blocker / "sub"))
    cands = {"torch": TorchBackend()}
    result = tune(SHAPES, "cpu", candidates=cands, sizes=TuningSizes.tiny())
    assert set(result.choices) == ALL_KEYS and not result.from_cache
    assert "could not save kernel tuning" in caplog.text


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("tag", ["fp8_block_32x32", "fp8_channel"])
def test_an_fp8_model_gets_fp8_linear_choices(tmp_path, candidates, tag):
    """FP8 weights are their own op: measured on FP8 layers of the model's format, and
    the tuned backend sends FP8 layers there and unquantized ones to `linear`."""
    from services.kernels.fp8 import fp8_linear_reference
    from services.kernels.tuned_backend import TunedBackend
    from services.kernels.tuner_cases import random_fp8_layer

    shapes = KernelShapes(**{**SHAPES.__dict__, "weight_quant": tag})
    sizes = TuningSizes.tiny()
    result = tune(shapes, "cpu", candidates=candidates, sizes=sizes, cache_dir=tmp_path)
    fp8_keys = {f"fp8_linear.{c}" for c in OP_CLASSES["fp8_linear"]}
    assert set(result.choices) == ALL_KEYS | fp8_keys
    assert result.rejected == {}, result.rejected
    for key in fp8_keys:
        assert set(result.times_us[key]) == {"torch", "triton"}, key
    backend = TunedBackend(candidates, result.choices, shapes)
    gen = torch.Generator().manual_seed(2)
    layer = random_fp8_layer(64, 48, shapes.fp8_format(), gen, "cpu")
    x = torch.randn(3, 64, generator=gen)
    torch.testing.assert_close(
        backend.linear(x, layer), fp8_linear_reference(x, layer), rtol=1e-4, atol=1e-4
    )
    dense = TunedBackend(candidates, {k: "torch" for k in ALL_KEYS}, SHAPES)
    with pytest.raises(ValueError, match="FP8 linear"):
        dense.linear(x, layer)


def test_weight_quant_tags():
    from services.kernels.fp8 import Fp8Format
    from services.kernels.shape_classes import weight_quant_tag

    for fmt in (Fp8Format("block", 128, 64), Fp8Format("channel"), Fp8Format("tensor")):
        shapes = KernelShapes(**{**SHAPES.__dict__, "weight_quant": weight_quant_tag(fmt)})
        assert shapes.fp8_format() == fmt
    assert weight_quant_tag(None) == "" and KernelShapes(**SHAPES.__dict__).fp8_format() is None
    for bad in ("fp8", "fp8_block_128", "int8_channel", "fp8_block_ax1"):
        with pytest.raises(ValueError, match="weight_quant"):
            KernelShapes(**{**SHAPES.__dict__, "weight_quant": bad})


def test_the_cpu_tuner_measures_the_cpus_own_candidates(tmp_path):
    """No candidates given on a CPU: torch, cpu_slab, cpu_onednn and cpu_native (no
    interpreted Triton), no graph rule: linears time the first three, the small ops
    torch against cpu_native, every class; the cache file names the CPU model and
    thread count."""
    result = tune(SHAPES, "cpu", cache_dir=tmp_path)
    assert set(result.choices) == ALL_KEYS and result.rejected == {}
    assert set(result.choices.values()) <= {"torch", "cpu_slab", "cpu_onednn", "cpu_native"}
    for cls in OP_CLASSES["linear"]:
        assert set(result.times_us[f"linear.{cls}"]) == {"torch", "cpu_slab", "cpu_onednn"}
    small_ops = ("rms_norm", "fused_add_rms_norm", "rotary_embedding", "silu_and_mul",
                 "store_kv_cache", "paged_attention")  # fmt: skip
    for op in small_ops:
        for cls in OP_CLASSES[op]:
            assert set(result.times_us[f"{op}.{cls}"]) == {"torch", "cpu_native"}, op
    assert result.device_name.startswith("cpu ") and "threads" in result.device_name
    (path,) = tmp_path.glob("*.json")
    assert path.name.startswith("cpu-")
    assert tune(SHAPES, "cpu", cache_dir=tmp_path).from_cache


def test_a_cpu_times_decode_sized_linears_over_the_models_layers(monkeypatch):
    """A CPU decode step streams every layer's weights once, so decode-sized linear
    cases run over num_layers layers' weights, each in memory of its own, up to a byte
    cap; prefill-sized ones (compute-bound) and a GPU's over one layer. Only the first
    layer's outputs are compared with the reference."""
    from services.kernels import tuner_cases

    shapes = KernelShapes(**{**SHAPES.__dict__, "num_layers": 5})
    per_layer = len(shapes.linear_shapes())
    layer_bytes = sum(i * o for i, o in shapes.linear_shapes()) * 4
    sizes = TuningSizes.tiny()
    seen: list[int] = []

    class Recording(TorchBackend):
        def linear(self, x, layer):
            seen.append(layer.weight.data_ptr())
            return super().linear(x, layer)

    def weights_run(cls):
        seen.clear()
        _, out = tuner_cases.run_case(
            "linear", cls, shapes, sizes, torch.device("cpu"), torch.float32, Recording()
        )
        assert len(out) == per_layer
        assert len(set(seen)) == len(seen)  # no two share memory
        return len(seen)

    for cls in OP_CLASSES["linear"]:
        layers = 5 if sizes.tokens(cls) <= 64 else 1
        assert weights_run(cls) == layers * per_layer, cls
    monkeypatch.setattr(tuner_cases, "_CPU_WORKING_SET_BYTES", 2 * layer_bytes)
    assert weights_run("decode1") == 2 * per_layer
    assert tuner_cases._cpu_copies(shapes, 1, "cuda", torch.float32) == 1
