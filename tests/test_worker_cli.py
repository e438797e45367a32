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


def _engine_process(*flags) -> bool:
    from pdserve.cli import _engine_process

    return _engine_process(build_parser().parse_args(["decode", "--model", "m", *flags]))


def test_engine_process_default_follows_the_device():
    # on a GPU the engine runs in its own process unless told not to; on CPU on a thread
    assert _engine_process("--device", "cuda:0") is True
    assert _engine_process() is False
    assert _engine_process("--device", "cuda:1", "--no-engine-process") is False
    assert _engine_process("--engine-process") is True
    with pytest.raises(SystemExit):  # a prefill worker has no such flag
        build_parser().parse_args(["prefill", "--model", "m", "--engine-process"])


def test_log_level_in_either_case_and_an_unknown_one_refused(capsys):
    parse = build_parser().parse_args
    for given in ("DEBUG", "debug", "Warning"):
        assert parse(["decode", "--model", "m", "--log-level", given]).log_level == given.lower()
    with pytest.raises(SystemExit):
        parse(["decode", "--model", "m", "--log-level", "verbose"])
    assert "--log-level" in capsys.readouterr().err
