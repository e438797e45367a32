"""No prompt or completion text in any log unless asked for: requests with a distinctive
prompt go through the router to real prefill and decode workers (logging at DEBUG, the
most they can), and neither the router's log records nor the workers' output contain the
prompt, the stop string or the answers. With --enable-log-requests the router logs the
request bodies at INFO; the workers still log no text."""

from __future__ import annotations

import logging
import time

import openai
import pytest

from router.config import RouterConfig
from tests.router.helpers import RouterThread, http
from tests.router.test_integration import wait_ready

SERVED = "smollm2"
SECRET = "Quixotic-Marmalade-7741"  # appears in no model vocabulary as one token run
PROMPT = f"My password is {SECRET}. Repeat my password."
STOP = "Zanzibar-Stop-5521"


@pytest.fixture(scope="module")
def pair(model):
    from tests.workers.procs import worker_pair

    debug = ("--log-level", "debug")
    with worker_pair(model, prefill_args=debug, decode_args=debug) as workers:
        yield workers


def _run_requests(r: RouterThread) -> list[str]:
    """Chat and completions, plain and streamed; returns the answers' texts."""
    client = openai.OpenAI(base_url=r.url + "/v1", api_key="x", max_retries=0)
    messages = [{"role": "user", "content": PROMPT}]
    answers = []
    chat = client.chat.completions.create(
        model=SERVED, messages=messages, max_tokens=16, temperature=0, stop=[STOP]
    )
    answers.append(chat.choices[0].message.content)
    out = client.completions.create(model=SERVED, prompt=PROMPT, max_tokens=16, temperature=0)
    answers.append(out.choices[0].text)
    stream = client.completions.create(
        model=SERVED, prompt=PROMPT, max_tokens=16, temperature=0, stream=True, stop=[STOP]
    )
    answers.append("".join(c.choices[0].text for c in stream if c.choices))
    with client.chat.completions.create(
        model=SERVED, messages=messages, max_tokens=64, stream=True
    ) as early:  # the client goes away mid-stream: the cancellation path logs too
        next(iter(early))
    # a refused prompt (a lone surrogate): the error path logs no text either
    bad = {"model": SERVED, "prompt": f"{PROMPT} \ud800", "max_tokens": 4}
    assert http("POST", r.url + "/v1/completions", bad).status == 400
    time.sleep(0.5)  # let the workers' last lines reach their logs
    return [a.strip() for a in answers if len(a.strip()) >= 8]


def _router_text(caplog) -> str:
    return "\n".join(f"{r.getMessage()} {r.exc_text or ''}" for r in caplog.records)


def test_no_prompt_or_completion_text_in_logs_by_default(pair, caplog):
    caplog.set_level(logging.DEBUG)  # every level of every logger, not only INFO
    prefill, decode = pair
    cfg = RouterConfig(
        host="127.0.0.1",
        port=0,
        prefill=(prefill.address,),
        decode=(decode.address,),
        served_model_name=SERVED,
    )
    with RouterThread(cfg) as r:
        wait_ready(r)
        answers = _run_requests(r)
    assert answers, "the model answered nothing long enough to look for"
    router_log = _router_text(caplog)
    assert "done: model=smollm2" in router_log  # the router did log the requests
    for w in pair:
        assert any("DEBUG" in line for line in w.log), f"{w.role} did not log at DEBUG"
    logs = {"router": router_log, **{w.role: "".join(w.log) for w in pair}}
    for where, text in logs.items():
        for secret in (SECRET, STOP, *answers):
            assert secret not in text, f"{secret!r} in the {where} log"


def test_enable_log_requests_logs_bodies_on_the_router_only(pair, caplog):
    caplog.set_level(logging.INFO)
    prefill, decode = pair
    cfg = RouterConfig(
        host="127.0.0.1",
        port=0,
        prefill=(prefill.address,),
        decode=(decode.address,),
        served_model_name=SERVED,
        enable_log_requests=True,
    )
    with RouterThread(cfg) as r:
        wait_ready(r)
        _run_requests(r)
    bodies = [m for m in caplog.messages if "POST /v1/" in m and " body: " in m]
    assert len(bodies) == 5 and all(SECRET in m for m in bodies), bodies
    assert all(STOP in m for m in bodies if '"stop"' in m)
    for w in pair:
        assert SECRET not in "".join(w.log), f"the {w.role} worker logged the prompt"
