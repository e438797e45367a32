"""Shared fixtures: the default model, transformers references and small random-weight
checkpoints built inside the tests."""

from __future__ import annotations

import os

import pytest

# Keep CPU tests within two cores' worth of threads and deterministic.
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# `make test` runs `pytest -n auto`: one test process per core, as many as memory holds
# (one, with its engines and the worker processes it starts, peaks near 6 GB:
# docs/performance.md), each with its share of the cores for torch's threads.
GB_PER_TEST_PROCESS = 6


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


def pytest_xdist_auto_num_workers(config):
    from services.engine.kv_memory import host_available_bytes

    available = host_available_bytes()
    by_memory = _cores() if available is None else available // (GB_PER_TEST_PROCESS << 30)
    return max(1, min(_cores(), by_memory))


if "PYTEST_XDIST_WORKER_COUNT" in os.environ:
    # Set before torch loads, and inherited by the worker processes a test starts. numpy's
    # OpenBLAS (tl.dot under Triton's interpreter) would follow OMP_NUM_THREADS too, and
    # its blocking, so the last bits of a dot, changes with its thread count: the
    # bit-exact engine comparisons of test_norm_fold_engine.py hold at its default (one
    # thread a core), which it keeps.
    os.environ.setdefault("OPENBLAS_NUM_THREADS", str(_cores()))
    share = max(1, _cores() // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))
    os.environ.setdefault("OMP_NUM_THREADS", str(share))


def pytest_collection_modifyitems(config, items):
    try:
        import torch

        has_gpu = torch.cuda.is_available()
    except ImportError:
        has_gpu = False
    if has_gpu:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def default_model_dir():
    from services.models.default_model import default_model_dir as convert

    return convert()


@pytest.fixture(scope="session")
def model(default_model_dir):
    """The default model's folder as the workers' --model argument."""
    return str(default_model_dir)


@pytest.fixture(scope="session")
def colocated(model):
    """The colocated engine on the default model: the reference that disaggregated runs
    must equal token for token."""
    from services.engine import LLM

    return LLM(model)
