"""The router's HTTP surface without workers: errors, auth, limits, probes, metrics,
admin, request logging. The app runs in-process on a free port; the official openai client talks to it."""

from __future__ import annotations

import hashlib
import logging

import openai
import pytest

from router.config import RouterConfig
from tests.router.helpers import RouterThread, assert_openai_error, http

MSG = [{"role": "user", "content": "hi"}]


def config(**kw) -> RouterConfig:
    kw.setdefault("health_interval", 0.2)
    kw.setdefault("health_timeout", 0.5)
    return RouterConfig(host="127.0.0.1", port=0, **kw)


@pytest.fixture(scope="module")
def router():
    # an address nothing listens on: known to the registry, never healthy
    with RouterThread(
        config(served_model_name="m", decode=("127.0.0.1:9",), max_body_bytes=4096)
    ) as r:
        yield r


@pytest.fixture(scope="module")
def client(router):
    return openai.OpenAI(base_url=router.url + "/v1", api_key="unused", max_retries=0)


def test_health_and_not_ready(router):
    assert http("GET", router.url + "/health").status == 200
    reply = http("GET", router.url + "/ready")
    assert reply.status == 503
    assert reply.json() == {"ready": False, "healthy_prefill": 0, "healthy_decode": 0, "pairs": 0}


def test_no_workers_is_503(router, client):
    with pytest.raises(openai.InternalServerError) as e:
        client.chat.completions.create(model="m", messages=MSG)
    assert e.value.status_code == 503
    assert e.value.body["type"] == "service_unavailable"
    reply = http("POST", router.url + "/v1/completions", {"model": "m", "prompt": "x"})
    assert_openai_error(reply, 503, code="service_unavailable")


def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-4", messages=MSG)
    assert e.value.body["code"] == "model_not_found" and e.value.body["param"] == "model"


def test_bad_input_is_400_never_500(router, client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="m", messages=MSG, temperature=5)
    assert e.value.body["param"] == "temperature"
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="m", prompt="x", max_tokens=0)
    url = router.url + "/v1/chat/completions"
    for raw in (b"{not json", b"\xff\xfe", b"", b"[1, 2]", b"null", b'"x"'):
        assert_openai_error(http("POST", url, raw=raw), 400)
    assert_openai_error(http("POST", url, {"model": "m", "messages": MSG, "n": "2"}), 400, "n")


def test_body_limit_is_413(router):
    big = {"model": "m", "prompt": "x" * 5000}
    err = assert_openai_error(http("POST", router.url + "/v1/completions", big), 413)
    assert "4096" in err["message"]


def test_request_id_echoed_or_created(router):
    reply = http("GET", router.url + "/health", headers={"X-Request-Id": "abc-123"})
    assert reply.headers["X-Request-Id"] == "abc-123"
    reply = http(
        "POST",
        router.url + "/v1/completions",
        {"model": "m", "prompt": "x"},
        headers={"X-Request-Id": "err-7"},
    )
    assert reply.status == 503 and reply.headers["X-Request-Id"] == "err-7"
    created = http("GET", router.url + "/health").headers["X-Request-Id"]
    assert len(created) == 32
    bad = http("GET", router.url + "/health", headers={"X-Request-Id": "x" * 200})
    assert bad.headers["X-Request-Id"] != "x" * 200


def test_models_lists_the_served_name(client):
    assert [m.id for m in client.models.list().data] == ["m"]


def test_unknown_route_and_method(router):
    assert_openai_error(http("GET", router.url + "/v1/nope"), 404)
    assert_openai_error(http("GET", router.url + "/v1/chat/completions"), 405)


def test_metrics(router):
    http("GET", router.url + "/health")
    reply = http("GET", router.url + "/metrics")
    assert reply.status == 200 and reply.headers["Content-Type"].startswith("text/plain")
    text = reply.body.decode()
    assert 'pdserve_router_requests_total{endpoint="/health",status="200"}' in text
    assert 'pdserve_router_worker_healthy{address="127.0.0.1:9",role="decode"} 0.0' in text
    for name in (
        "time_to_first_token_seconds",
        "time_per_output_token_seconds",
        "e2e_request_latency_seconds",
        "queue_time_seconds",
        "kv_transfer_time_seconds",
        "prefill_fallbacks_total",
    ):
        assert f"pdserve_router_{name}" in text, name


def test_overload_is_429_with_retry_after():
    with RouterThread(config(served_model_name="m", max_concurrent_requests=2)) as r:
        limit = r.state.limit
        assert r.run_sync(limit.try_acquire) and r.run_sync(limit.try_acquire)  # 2 in flight
        client = openai.OpenAI(base_url=r.url + "/v1", api_key="x", max_retries=0)
        with pytest.raises(openai.RateLimitError) as e:
            client.chat.completions.create(model="m", messages=MSG)
        assert e.value.response.headers["Retry-After"] == "1"
        assert e.value.body["code"] == "rate_limit_exceeded"
        r.run_sync(limit.release)
        with pytest.raises(openai.InternalServerError):  # admitted, then no workers: 503
            client.chat.completions.create(model="m", messages=MSG)
        assert limit.inflight == 1  # the admitted request released its slot


def test_one_api_key_cannot_hold_every_slot():
    cfg = config(
        served_model_name="m",
        api_keys=("k1", "k2"),
        max_concurrent_requests=8,
        max_concurrent_requests_per_key=1,
    )
    with RouterThread(cfg) as r:
        limit = r.state.limit
        k1 = hashlib.sha256(b"k1").digest()
        assert r.run_sync(lambda: limit.try_acquire(k1))  # k1's one request in flight
        busy = openai.OpenAI(base_url=r.url + "/v1", api_key="k1", max_retries=0)
        with pytest.raises(openai.RateLimitError) as e:
            busy.chat.completions.create(model="m", messages=MSG)
        assert "this API key" in e.value.body["message"]
        other = openai.OpenAI(base_url=r.url + "/v1", api_key="k2", max_retries=0)
        with pytest.raises(openai.InternalServerError):  # admitted, then no workers: 503
            other.chat.completions.create(model="m", messages=MSG)
        r.run_sync(lambda: limit.release(k1))
        assert limit.inflight == 0 and not limit.by_key  # every slot given back


def test_api_keys():
    with RouterThread(config(served_model_name="m", api_keys=("k1", "k2"))) as r:
        for key in ("wrong", "k1x"):
            bad = openai.OpenAI(base_url=r.url + "/v1", api_key=key, max_retries=0)
            with pytest.raises(openai.AuthenticationError) as e:
                bad.models.list()
            assert e.value.body["code"] == "invalid_api_key"
        missing = http("POST", r.url + "/v1/chat/completions", {"model": "m", "messages": MSG})
        assert_openai_error(missing, 401, code="invalid_api_key")
        for key in ("k1", "k2"):
            good = openai.OpenAI(base_url=r.url + "/v1", api_key=key, max_retries=0)
            assert [m.id for m in good.models.list().data] == ["m"]
        # probes and metrics stay open for Kubernetes and Prometheus
        for path in ("/health", "/metrics"):
            assert http("GET", r.url + path).status == 200
        # a key that is a prefix, an extension or a non-UTF-8 header never passes
        for key in ("k", "k1k2", "k1\u00e9"):
            reply = http("GET", r.url + "/v1/models", headers={"Authorization": f"Bearer {key}"})
            assert_openai_error(reply, 401, code="invalid_api_key")


def test_admin_is_off_without_a_token(caplog):
    """No admin token: every /admin call is a 404 in OpenAI's shape saying how to turn
    them on (the start-up log says it too), and no worker can be added."""
    caplog.set_level(logging.INFO, logger="pdserve.router")
    with RouterThread(config()) as r:
        url = r.url + "/admin/workers"
        body = {"role": "decode", "address": "127.0.0.1:7"}
        for method, payload in (("GET", None), ("POST", body), ("DELETE", body), ("PUT", body)):
            auth = {"Authorization": "Bearer anything"}
            for headers in (None, auth):
                err = assert_openai_error(http(method, url, payload, headers=headers), 404)
                assert "--admin-token" in err["message"], err
        assert r.state.registry.targets == {}
    assert any(
        "admin endpoints (/admin/workers) off" in m and "PDSERVE_ADMIN_TOKEN" in m
        for m in caplog.messages
    )


def test_admin_workers():
    with RouterThread(config(admin_token="secret")) as r:
        url = r.url + "/admin/workers"
        auth = {"Authorization": "Bearer secret"}
        assert_openai_error(http("GET", url), 401)
        for bad in ("nope", "secre", "secret2"):
            bad_auth = {"Authorization": f"Bearer {bad}"}
            assert_openai_error(http("GET", url, headers=bad_auth), 401)
            added = http("POST", url, {"role": "decode", "address": "a:1"}, headers=bad_auth)
            assert_openai_error(added, 401, code="invalid_admin_token")
        assert http("GET", url, headers={"X-Admin-Token": "secret"}).status == 200
        assert http("GET", url, headers=auth).json()["workers"] == []
        added = http("POST", url, {"role": "decode", "address": "localhost:7"}, headers=auth)
        assert added.status == 201 and added.json()["resolved"] == ["127.0.0.1:7"]
        http("POST", url, {"role": "prefill", "address": "127.0.0.1:8"}, headers=auth)
        listing = http("GET", url, headers=auth).json()
        assert {(w["role"], w["address"]) for w in listing["workers"]} == {
            ("decode", "127.0.0.1:7"),
            ("prefill", "127.0.0.1:8"),
        }
        assert all(not w["healthy"] for w in listing["workers"])
        for body, param in (
            ({"role": "router", "address": "a:1"}, "role"),
            ({"role": "decode", "address": "nope"}, "address"),
            ({"role": "decode", "address": "a:99999"}, "address"),
            ({"role": "decode"}, "address"),
        ):
            assert_openai_error(http("POST", url, body, headers=auth), 400, param)
        gone = http("DELETE", url, {"role": "decode", "address": "localhost:7"}, headers=auth)
        assert gone.status == 200
        assert_openai_error(
            http("DELETE", url + "?role=decode&address=localhost:7", headers=auth), 404
        )
        assert http("DELETE", url + "?role=prefill&address=127.0.0.1:8", headers=auth).status == 200
        assert http("GET", url, headers=auth).json()["workers"] == []


def test_request_bodies_logged_only_when_asked(caplog):
    """--enable-log-requests logs each body at INFO (after auth); by default no body."""
    caplog.set_level(logging.DEBUG)
    prompt = "zebra-quartz-31337 says hello"
    for enabled in (False, True):
        caplog.clear()
        cfg = config(served_model_name="m", enable_log_requests=enabled, api_keys=("k",))
        with RouterThread(cfg) as r:
            url = r.url + "/v1/completions"
            http(
                "POST", url, {"model": "m", "prompt": prompt}, headers={"Authorization": "Bearer k"}
            )
            http("POST", url, {"model": "m", "prompt": "refused-by-auth"})  # 401: never logged
        text = "\n".join(caplog.messages)
        assert (prompt in text) is enabled, text
        assert "refused-by-auth" not in text
