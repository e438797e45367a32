"""`priority` through the router (official openai client): a decode worker started
with --scheduling-policy priority takes it (same answer as without one); a worker on
the default fcfs answers 400 naming 'priority', as vLLM does (the field walk in
test_sampling_fields.py checks that side)."""

from __future__ import annotations

import openai
import pytest

from router.config import RouterConfig
from tests.router.helpers import RouterThread
from tests.router.test_integration import wait_ready

SERVED = "smollm2"


@pytest.fixture(scope="module")
def client(model):
    from tests.workers.procs import start_worker

    worker = start_worker("decode", "--scheduling-policy", "priority", model=model)
    cfg = RouterConfig(host="127.0.0.1", port=0, decode=(worker.address,), served_model_name=SERVED)
    try:
        with RouterThread(cfg) as router:
            wait_ready(router)
            yield openai.OpenAI(base_url=router.url + "/v1", api_key="x", max_retries=0)
    finally:
        worker.stop()


def test_a_priority_worker_takes_priorities(client):
    kw = dict(model=SERVED, prompt="The capital of France is", max_tokens=8, temperature=0)
    plain = client.completions.create(**kw).choices[0].text
    for priority in (-5, 0, 7):
        got = client.completions.create(**kw, extra_body={"priority": priority})
        assert got.choices[0].text == plain
    with pytest.raises(openai.BadRequestError) as e:  # still an integer in range
        client.completions.create(**kw, extra_body={"priority": "high"})
    assert e.value.body["param"] == "priority"
