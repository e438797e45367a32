"""Command line and RouterConfig validation."""

from __future__ import annotations

import argparse

import pytest

from router.cli import add_router_args, config_from_args
from router.config import RouterConfig, normalize_address, parse_address


def parse(*argv):
    p = argparse.ArgumentParser()
    add_router_args(p)
    return p.parse_args(list(argv))


def test_defaults(monkeypatch):
    monkeypatch.delenv("PDSERVE_API_KEY", raising=False)
    monkeypatch.delenv("PDSERVE_ADMIN_TOKEN", raising=False)
    cfg = config_from_args(parse())
    assert (cfg.host, cfg.port) == ("0.0.0.0", 8000)
    assert (cfg.prefill_policy, cfg.decode_policy) == ("round_robin", "least_load")
    assert cfg.api_keys == () and cfg.admin_token is None and cfg.served_model_name is None
    assert cfg.enable_log_requests is False  # no prompt text in logs unless asked for


def test_flags(monkeypatch):
    monkeypatch.setenv("PDSERVE_API_KEY", "from-env")
    args = parse(
        "--prefill", "10.0.0.1:50051", "--prefill", "prefill.svc:50051",
        "--decode", "[::1]:6000", "--decode-policy", "prefix_aware",
        "--api-key", "a,b", "--api-key", "c", "--admin-token", "t",
        "--served-model-name", "llama", "--max-body-bytes", "2048",
        "--request-timeout", "30", "--health-interval", "1", "--max-concurrent-requests", "0",
        "--max-retries", "0", "--port", "9000", "--enable-log-requests",
    )  # fmt: skip
    cfg = config_from_args(args)
    assert cfg.prefill == ("10.0.0.1:50051", "prefill.svc:50051") and cfg.decode == ("[::1]:6000",)
    assert cfg.api_keys == ("a", "b", "c")  # flags win over the environment
    assert cfg.decode_policy == "prefix_aware" and cfg.admin_token == "t"
    assert cfg.served_model_name == "llama" and cfg.max_body_bytes == 2048 and cfg.port == 9000
    assert cfg.max_concurrent_requests == 0 and cfg.max_retries == 0
    assert cfg.enable_log_requests is True
    assert config_from_args(parse()).api_keys == ("from-env",)
    monkeypatch.setenv("PDSERVE_API_KEY", "x, y")
    assert config_from_args(parse()).api_keys == ("x", "y")


def test_admin_token_from_the_environment(monkeypatch):
    monkeypatch.setenv("PDSERVE_ADMIN_TOKEN", "env-token")
    assert config_from_args(parse()).admin_token == "env-token"
    assert config_from_args(parse("--admin-token", "flag")).admin_token == "flag"
    monkeypatch.setenv("PDSERVE_ADMIN_TOKEN", "")
    assert config_from_args(parse()).admin_token is None  # empty: admin stays off


def test_bad_policy_is_rejected_by_the_parser():
    with pytest.raises(SystemExit):
        parse("--decode-policy", "random")


@pytest.mark.parametrize(
    "kw",
    [
        dict(port=70000),
        dict(decode=("nohost",)),
        dict(decode=("host:0",)),
        dict(decode=("host:abc",)),
        dict(prefill=(":5",)),
        dict(prefill=("a:b:5",)),
        dict(prefill_policy="random"),
        dict(api_keys=("",)),
        dict(admin_token=" "),
        dict(served_model_name=""),
        dict(max_body_bytes=10),
        dict(request_timeout=0),
        dict(health_interval=-1),
        dict(max_concurrent_requests=-1),
        dict(max_retries=-1),
        dict(retry_after=0),
    ],
)
def test_config_validation(kw):
    with pytest.raises(ValueError):
        RouterConfig(**kw)


def test_addresses():
    assert parse_address("[::1]:80") == ("::1", 80)
    assert parse_address(" h:1 ") == ("h", 1)
    assert normalize_address("[::1]:80") == "[::1]:80"
    with pytest.raises(ValueError):
        parse_address("[::1]80")


def test_log_level_in_either_case_and_an_unknown_one_refused(capsys):
    # Python's names in either case (the Helm chart passes INFO); an unknown level is an
    # error naming the flag, not INFO in its place
    assert parse().log_level == "info"
    assert parse("--log-level", "DEBUG").log_level == "debug"
    assert parse("--log-level", "critical").log_level == "critical"
    with pytest.raises(SystemExit):
        parse("--log-level", "verbose")
    assert "--log-level" in capsys.readouterr().err
