"""`pdserve up`: which device each worker gets, and bad device flags refused before any
process starts."""

from __future__ import annotations

import argparse

import pytest

from services.cli import main
from services.launcher import plan_workers


def _args(**kw) -> argparse.Namespace:
    base = {"prefill": 1, "decode": 1, "device": "cpu", "prefill_device": None}
    return argparse.Namespace(**{**base, "decode_device": None, **kw})


def test_every_worker_on_device_by_default():
    assert plan_workers(_args(prefill=2, decode=1, device="cuda")) == [
        ("prefill-0", "cuda"),
        ("prefill-1", "cuda"),
        ("decode-0", "cuda"),
    ]


def test_role_devices_are_cycled_per_worker():
    plan = plan_workers(
        _args(prefill=1, decode=3, prefill_device="cuda:0", decode_device="cuda:1, cuda:2")
    )
    assert plan == [
        ("prefill-0", "cuda:0"),
        ("decode-0", "cuda:1"),
        ("decode-1", "cuda:2"),
        ("decode-2", "cuda:1"),
    ]


def test_no_prefill_workers_is_colocated_decode():
    assert plan_workers(_args(prefill=0, decode_device="cuda:3")) == [("decode-0", "cuda:3")]


@pytest.mark.parametrize("flag", ["--device", "--prefill-device", "--decode-device"])
def test_bad_device_is_refused_before_starting(flag, capsys):
    assert main(["up", flag, "gpu0", "--port", "1"]) == 2
    err = capsys.readouterr().err
    assert f"{flag}: 'gpu0' is not cpu, cuda or cuda:N" in err


def test_hint_when_gpu_workers_would_move_kv_over_tcp():
    from services.launcher import transport_hint

    gpus = plan_workers(_args(prefill_device="cuda:0", decode_device="cuda:1"))
    assert "nvlink_intra" in transport_hint(gpus, [])
    assert transport_hint(gpus, ["--transfer-protocol", "nvlink_intra"]) is None
    assert transport_hint(gpus, ["--transfer-protocol=rdma"]) is None
    assert transport_hint(plan_workers(_args()), []) is None  # CPU
    assert transport_hint(plan_workers(_args(prefill=0, device="cuda")), []) is None
