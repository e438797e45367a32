"""At most one extra copy of the linear weights per worker.

Two CPU linear candidates keep a weight of their own next to the model's (cpu_backend.py):
cpu_slab its column slabs, cpu_onednn oneDNN's prepacked layout. The tuner picks a
candidate per shape class, so a worker whose decode1 went to one and decode8 to the
other held the weights three times (SmolLM2-135M in fp32: a 2.2 GB decode worker, 1.1 GB
of it copies). The classes are therefore limited to one copying candidate: the one that
loses least against the free choice, as the product over the classes of (time with only
that copy) / (best time). A class that changes is recorded in `TuningResult.one_copy`
and shown by the tuner's table."""

from __future__ import annotations

import math

from services.kernels.cpu_backend import CpuOneDnnBackend, CpuSlabBackend

# candidate -> the layer attribute holding the weight copy it keeps
WEIGHT_COPIES = {b.name: b.weight_copy for b in (CpuSlabBackend, CpuOneDnnBackend)}


def keep_one_weight_copy(
    choices: dict[str, str], times_us: dict[str, dict[str, float]], op: str = "linear"
) -> dict[str, str]:
    """Rewrite `choices` ("op.class" -> candidate) so that `op`'s classes use at most one
    candidate of WEIGHT_COPIES. Returns "op.class" -> the candidate each changed class
    had (empty when the free choice already kept one copy)."""
    keys = [k for k in choices if k.split(".")[0] == op]
    copying = sorted({choices[k] for k in keys} & WEIGHT_COPIES.keys())
    if len(copying) < 2:
        return {}

    def limited(key: str, copy: str) -> str:
        allowed = {c: t for c, t in times_us[key].items() if c == copy or c not in WEIGHT_COPIES}
        return min(allowed, key=allowed.get) if allowed else choices[key]

    def loss(copy: str) -> float:
        return math.prod(
            times_us[k][limited(k, copy)] / times_us[k][choices[k]]
            for k in keys
            if choices[k] in times_us.get(k, {})
        )

    kept = min(copying, key=lambda copy: (loss(copy), copy))
    changed = {}
    for key in keys:
        if choices[key] in WEIGHT_COPIES and choices[key] != kept:
            changed[key], choices[key] = choices[key], limited(key, kept)
    return changed
