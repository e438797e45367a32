"""Shared fixtures: the default model, transformers references and small random-weight
checkpoints built inside the tests."""

from __future__ import annotations

import os

import pytest

# Keep CPU tests within two cores' worth of threads and deterministic.
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# `make test` runs `pytest -n auto`. One test process, with its engines and the worker
# processes it starts, peaks near 6 GB (docs/performance.md), so memory caps how many
# run. Up to two cores, one process per core with torch's default threads (the
# measured setup); past that, one per two cores, each given its share of the cores for
# torch's threads (inherited by the workers it starts), so the processes do not
# oversubscribe the machine. (One thread per process was faster on two cores, but
# three test_norm_fold_engine.py cases lost their bit-exact equality at one thread.)
GB_PER_TEST_PROCESS = 6


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


def pytest_xdist_auto_num_workers(config):
    from services.engine.kv_memory import host_available_bytes

    cores = _cores()
    available = host_available_bytes()
    by_memory = cores if available is None else available // (GB_PER_TEST_PROCESS << 30)
    return max(1, min(cores if cores <= 2 else cores // 2, by_memory))


if "PYTEST_XDIST_WORKER_COUNT" in os.environ and _cores() > 2:
    share = _cores() // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])
    os.environ.setdefault("OMP_NUM_THREADS", str(max(2, share)))


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
