"""Worker flags reach the engine's config, and a bad value is refused naming the flag."""

from __future__ import annotations

import pytest

from pdserve.cli import build_parser, engine_config_from_args


def _config(*flags):
    args = build_parser().parse_args(["decode", "--model", "m", *flags])
    return engine_config_from_args(args, "decode")


def test_cuda_graph_capture_size_flag():
    assert _config().cuda_graph_max_batch == 256
    assert _config("--max-cudagraph-capture-size", "512").cuda_graph_max_batch == 512
    with pytest.raises(ValueError, match="--max-cudagraph-capture-size"):
        _config("--max-cudagraph-capture-size", "0")
