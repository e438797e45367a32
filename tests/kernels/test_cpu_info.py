"""The CPU's identity for the tuner's cache: a VM that names only "AMD EPYC" for an AVX2
Zen 2 and an AVX-512 Zen 4 must not share one set of kernel choices."""

from __future__ import annotations

from services.kernels import tuner
from services.kernels.cpu_info import cpu_flags, cpu_flags_digest, cpu_model, parse_cpuinfo
from services.kernels.shape_classes import KernelShapes
from services.kernels.tuner import TuningSizes, load_candidates, tune

ZEN2 = """processor\t: 0
vendor_id\t: AuthenticAMD
cpu family\t: 23
model\t\t: 49
model name\t: AMD EPYC
flags\t\t: fpu sse2 avx avx2 fma

processor\t: 1
model name\t: something else
"""
ZEN4 = ZEN2.replace("23", "25").replace("49", "17").replace("fma", "fma avx512f avx512_bf16")
ARM = "processor\t: 0\nFeatures\t: fp asimd sve bf16\nCPU implementer\t: 0x41\n"


def test_the_first_processor_block_is_read():
    fields = parse_cpuinfo(ZEN2)
    assert fields["model name"] == "AMD EPYC" and fields["cpu family"] == "23"
    assert cpu_flags(fields) == ["avx", "avx2", "fma", "fpu", "sse2"]
    assert cpu_flags(parse_cpuinfo(ARM)) == ["asimd", "bf16", "fp", "sve"]


def test_two_epycs_of_one_name_are_told_apart():
    zen2, zen4 = parse_cpuinfo(ZEN2), parse_cpuinfo(ZEN4)
    assert cpu_model(zen2) == "AMD EPYC (family 23 model 49; avx2)"
    assert cpu_model(zen4) == "AMD EPYC (family 25 model 17; avx2 avx512f avx512_bf16)"
    assert cpu_flags_digest(zen2) != cpu_flags_digest(zen4)
    assert cpu_flags_digest(zen2) == cpu_flags_digest(parse_cpuinfo(ZEN2))


def test_cached_cpu_choices_are_not_reused_on_a_cpu_with_other_flags(tmp_path, monkeypatch):
    shapes = KernelShapes(64, 4, 2, 16, 96, 16, "float32")
    kwargs = dict(candidates=load_candidates(("torch",)), sizes=TuningSizes.tiny(),
                  cache_dir=tmp_path)  # fmt: skip
    first = tune(shapes, "cpu", **kwargs)
    assert not first.from_cache and tune(shapes, "cpu", **kwargs).from_cache
    monkeypatch.setattr(tuner, "cpu_flags_digest", lambda: "another-cpu")
    assert not tune(shapes, "cpu", **kwargs).from_cache
    assert len(list(tmp_path.glob("*.json"))) == 1  # same name, one more key inside
