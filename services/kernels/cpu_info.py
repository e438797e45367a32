"""Which CPU this is, for the caches keyed by it (the tuner's choices, the cpu_native
build) and the benchmarks' reports. A VM often names only its vendor line ("AMD EPYC"
for an AVX2-only Zen 2 and an AVX-512 Zen 4 alike), so the family/model numbers and the
instruction-set flags say the rest."""

from __future__ import annotations

import functools
import hashlib
import platform

# the flags that change which kernel candidate wins, shown in the CPU's label
ISA_SHOWN = ("avx2", "avx512f", "avx512_bf16", "amx_bf16")


def parse_cpuinfo(text: str) -> dict[str, str]:
    """The first processor's fields of a /proc/cpuinfo text (every core repeats them)."""
    fields: dict[str, str] = {}
    for line in text.splitlines():
        if not line.strip():
            if fields:
                break
            continue
        key, sep, value = line.partition(":")
        if sep:
            fields.setdefault(key.strip(), value.strip())
    return fields


@functools.lru_cache(maxsize=1)
def _this_cpu() -> dict[str, str]:
    try:
        with open("/proc/cpuinfo") as f:
            return parse_cpuinfo(f.read())
    except OSError:
        return {}


def cpu_flags(fields: dict[str, str] | None = None) -> list[str]:
    """Instruction-set flags (x86 `flags`, Arm `Features`), sorted."""
    fields = _this_cpu() if fields is None else fields
    return sorted((fields.get("flags") or fields.get("Features") or "").split())


def cpu_flags_digest(fields: dict[str, str] | None = None) -> str:
    return hashlib.sha256(" ".join(cpu_flags(fields)).encode()).hexdigest()[:16]


def cpu_model(fields: dict[str, str] | None = None) -> str:
    """e.g. 'AMD EPYC (family 25 model 17; avx2 avx512f avx512_bf16)'."""
    fields = _this_cpu() if fields is None else fields
    name = fields.get("model name") or platform.processor() or platform.machine() or "unknown"
    details = []
    if "cpu family" in fields and "model" in fields:
        details.append(f"family {fields['cpu family']} model {fields['model']}")
    flags = set(cpu_flags(fields))
    isa = [f for f in ISA_SHOWN if f in flags]
    if isa:
        details.append(" ".join(isa))
    return f"{name} ({'; '.join(details)})" if details else name
