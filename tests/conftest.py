"""Shared fixtures: the default model, transformers references and small random-weight
checkpoints built inside the tests."""

from __future__ import annotations

import os

import pytest

# Keep CPU tests within two cores' worth of threads and deterministic.
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


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
