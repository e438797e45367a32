"""TLS and mutual TLS on every gRPC hop, with certificates generated here (tests/pki.py):
a prefill and a decode worker serving mTLS, the decode worker calling the prefill
worker over mTLS, the router presenting its client certificate. A request through the
router with the official openai client equals the colocated engine; clients that are
plaintext, present no certificate, or a certificate from another CA are refused.

Also: the settings refuse half a configuration (a key without its certificate, a CA
without a server certificate, a key that is not the certificate's) naming the flag."""

from __future__ import annotations

import asyncio
import shutil
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from router.config import RouterConfig
from services.common.settings import WorkerSettings
from tests.pki import SERVER_NAME, make_pki

SERVED = "smollm2"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return make_pki(tmp_path_factory.mktemp("pki"))


def _mtls_args(pki, pair=None, *extra: str) -> tuple[str, ...]:
    pair = pair or pki.server
    return (
        "--tls-cert-file",
        pair.cert,
        "--tls-key-file",
        pair.key,
        "--tls-ca-file",
        pki.ca,
        *extra,
    )


NAME_OVERRIDE = (("grpc.ssl_target_name_override", SERVER_NAME),)


@pytest.fixture(scope="module")
def pair(model, pki):
    """The prefill worker's certificate names SERVER_NAME only, as a pod's does (pods are
    dialed by IP): the decode worker and the router reach it only through their
    server-name override. The decode worker's also names 127.0.0.1."""
    from tests.workers.procs import worker_pair

    decode_args = _mtls_args(pki, pki.server, "--tls-server-name", SERVER_NAME)
    with worker_pair(model, _mtls_args(pki, pki.named), decode_args) as (prefill, decode):
        for w in (prefill, decode):
            w.credentials = grpc.ssl_channel_credentials(
                _read(pki.ca), _read(pki.client.key), _read(pki.client.cert)
            )
        prefill.channel_options = NAME_OVERRIDE
        yield prefill, decode


def _read(path: str) -> bytes:
    return Path(path).read_bytes()


def _check(address: str, credentials=None, options=()) -> int:
    """The worker's grpc.health.v1 status, through a plaintext channel or a TLS one."""
    if credentials is None:
        channel = grpc.insecure_channel(address)
    else:
        channel = grpc.secure_channel(address, credentials, list(options))
    with channel:
        stub = health_pb2_grpc.HealthStub(channel)
        return stub.Check(health_pb2.HealthCheckRequest(), timeout=10).status


def _refused(address: str, credentials=None, options=()) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        _check(address, credentials, options)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE, info.value
    return info.value


SERVING = health_pb2.HealthCheckResponse.SERVING

# ----------------------------------------------------------------------------- the stack


def test_completion_through_the_router_over_mtls(pair, pki, colocated):
    import openai

    from services.engine import SamplingParams
    from tests.router.helpers import RouterThread

    prefill, decode = pair
    config = RouterConfig(
        host="127.0.0.1",
        port=0,
        prefill=(prefill.address,),
        decode=(decode.address,),
        served_model_name=SERVED,
        health_interval=0.5,
        worker_tls_ca_file=pki.ca,
        worker_tls_cert_file=pki.client.cert,
        worker_tls_key_file=pki.client.key,
        worker_tls_server_name=SERVER_NAME,
    )
    ref = colocated.chat(QUESTION, SamplingParams(temperature=0, max_tokens=32))[0]
    with RouterThread(config) as r:
        # usable once the router's probes and the decode -> prefill handshake pass
        registry = r.state.registry
        deadline = time.monotonic() + 30
        while not registry.usable_pairs():
            assert time.monotonic() < deadline, [w.describe() for w in registry.workers.values()]
            time.sleep(0.05)
        client = openai.OpenAI(base_url=r.url + "/v1", api_key="x", max_retries=0)
        out = client.chat.completions.create(
            model=SERVED, messages=QUESTION, temperature=0, max_tokens=32
        )
    assert out.choices[0].message.content == ref.output.text == "The capital of France is Paris."
    assert out.usage.completion_tokens == len(ref.output.token_ids)
    # the prefill ran on the prefill worker and its KV moved to the decode worker
    assert decode.load().prefill_fallbacks == 0
    assert prefill.load().kv_transfers_ok >= 1


def test_valid_client_certificate_accepted(pair, pki):
    prefill, decode = pair
    for w in pair:
        assert _check(w.address, w.credentials, w.channel_options) == SERVING
    # a worker's own pair is a client identity too (what the decode worker presents)
    own = grpc.ssl_channel_credentials(_read(pki.ca), _read(pki.server.key), _read(pki.server.cert))
    assert _check(decode.address, own) == SERVING
    assert _check(prefill.address, own, NAME_OVERRIDE) == SERVING


# ----------------------------------------------------------------------------- refusals


def test_plaintext_client_refused(pair):
    for w in pair:
        _refused(w.address)


def test_client_without_certificate_refused(pair, pki):
    for w in pair:
        _refused(w.address, grpc.ssl_channel_credentials(_read(pki.ca)), w.channel_options)


def test_client_certificate_from_another_ca_refused(pair, pki):
    stranger = grpc.ssl_channel_credentials(
        _read(pki.ca), _read(pki.stranger.key), _read(pki.stranger.cert)
    )
    for w in pair:
        _refused(w.address, stranger, w.channel_options)


def test_client_refuses_a_worker_it_cannot_verify(pair, pki):
    prefill, decode = pair
    c = pki.client
    creds = grpc.ssl_channel_credentials(_read(pki.ca), _read(c.key), _read(c.cert))
    # a CA that did not sign the worker's certificate
    other = grpc.ssl_channel_credentials(_read(pki.other_ca), _read(c.key), _read(c.cert))
    _refused(decode.address, other)
    # a name the worker's certificate does not carry: another one, or the IP dialed
    _refused(decode.address, creds, [("grpc.ssl_target_name_override", "other.example")])
    _refused(prefill.address, creds)


def test_plaintext_router_sees_tls_workers_unhealthy(pair):
    from router.registry import WorkerRegistry

    _, decode = pair

    async def probe():
        reg = WorkerRegistry(RouterConfig(decode=(decode.address,), health_timeout=5))
        reg._resolve_literal("decode", decode.address)
        reg._sync_workers()
        (worker,) = reg.workers.values()
        await reg.probe(worker)
        await reg.close()
        return worker

    worker = asyncio.run(probe())
    assert not worker.healthy and worker.error.startswith("UNAVAILABLE"), worker.error


# ----------------------------------------------------------------------------- settings


def test_worker_settings_validate_tls(pki, tmp_path):
    s = WorkerSettings(tls_cert_file=pki.server.cert, tls_key_file=pki.server.key)
    assert s.tls and s.tls_client_pair == (pki.server.cert, pki.server.key)
    s = WorkerSettings(
        tls_cert_file=pki.server.cert,
        tls_key_file=pki.server.key,
        tls_ca_file=pki.ca,
        tls_client_cert_file=pki.client.cert,
        tls_client_key_file=pki.client.key,
    )
    assert s.tls_client_pair == (pki.client.cert, pki.client.key)
    assert not WorkerSettings().tls

    not_pem = tmp_path / "not.pem"
    not_pem.write_text("hello")
    cases = [
        (dict(tls_key_file=pki.server.key), "--tls-key-file needs --tls-cert-file"),
        (dict(tls_cert_file=pki.server.cert), "--tls-cert-file needs --tls-key-file"),
        (dict(tls_ca_file=pki.ca), "--tls-ca-file needs --tls-cert-file"),
        (dict(tls_server_name="x"), "--tls-server-name needs --tls-cert-file"),
        (
            dict(tls_client_cert_file=pki.client.cert, tls_client_key_file=pki.client.key),
            "--tls-client-cert-file needs --tls-cert-file",
        ),
        (
            dict(tls_cert_file=pki.server.cert, tls_key_file=str(tmp_path / "missing.key")),
            "--tls-key-file",
        ),
        (dict(tls_cert_file=pki.server.cert, tls_key_file=pki.client.key), "not a usable pair"),
        (
            dict(
                tls_cert_file=pki.server.cert, tls_key_file=pki.server.key, tls_ca_file=str(not_pem)
            ),
            "--tls-ca-file",
        ),
    ]
    for kwargs, message in cases:
        with pytest.raises(ValueError, match=message):
            WorkerSettings(**kwargs)


def test_router_config_validates_tls(pki, tmp_path):
    assert not RouterConfig().worker_tls
    assert RouterConfig(worker_tls_ca_file=pki.ca).worker_tls
    cases = [
        (dict(worker_tls_key_file=pki.client.key), "--worker-tls-key-file needs"),
        (dict(worker_tls_server_name=SERVER_NAME), "--worker-tls-server-name needs"),
        (dict(worker_tls_ca_file=str(tmp_path / "nope.crt")), "--worker-tls-ca-file"),
        (
            dict(worker_tls_cert_file=pki.client.cert, worker_tls_key_file=pki.server.key),
            "not a usable pair",
        ),
    ]
    for kwargs, message in cases:
        with pytest.raises(ValueError, match=message):
            RouterConfig(**kwargs)


def test_cli_flags_reach_the_settings(pki):
    from pdserve.cli import build_parser
    from router.cli import config_from_args

    tls_args = _mtls_args(pki, None, "--tls-server-name", "w")
    args = build_parser().parse_args(["decode", *tls_args])
    assert (args.tls_cert_file, args.tls_ca_file, args.tls_server_name) == (
        pki.server.cert,
        pki.ca,
        "w",
    )
    with pytest.raises(SystemExit):  # a prefill worker dials nobody: no client flags
        build_parser().parse_args(["prefill", "--tls-server-name", "w"])
    flags = ["--worker-tls-ca-file", pki.ca, "--worker-tls-server-name", SERVER_NAME]
    config = config_from_args(build_parser().parse_args(["router", *flags]))
    assert config.worker_tls and config.worker_tls_server_name == SERVER_NAME


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs openssl")
def test_encrypted_key_refused_without_prompting(pki, tmp_path):
    import subprocess

    key = tmp_path / "enc.key"
    subprocess.run(
        ["openssl", "pkey", "-in", pki.server.key, "-aes256", "-passout", "pass:x", "-out", key],
        check=True,
        capture_output=True,
    )
    with pytest.raises(ValueError, match="encrypted"):
        WorkerSettings(tls_cert_file=pki.server.cert, tls_key_file=str(key))
