"""A decode worker whose engine runs in its own process (--engine-process): what
crosses the pipe (output deltas, logprobs, stop strings, structured outputs, errors,
Abort, GetLoad) gives the colocated engine's answers, every request's blocks come back,
and the worker does not outlive its engine process nor the other way round.
GenerateStream and remote prefill with it: test_generate_stream.py."""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time
import urllib.request

import grpc
import pytest

from pdpb.v1 import common_pb2, decode_pb2, decode_pb2_grpc
from services.engine import SamplingParams
from services.engine.detokenizer import IncrementalDetokenizer
from services.engine.output_deltas import DeltaDecoder, News
from services.engine.outputs import RequestOutput
from services.engine.sampling_params import StructuredOutput
from tests.engine.helpers import assert_all_blocks_free
from tests.workers.procs import start_worker


@pytest.fixture(scope="module")
def decode(model):
    worker = start_worker("decode", "--engine-process", "--metrics-port", "0", model=model)
    yield worker
    worker.stop()


def _engine_pid(worker) -> int:
    for line in worker.log:
        m = re.search(r"engine process (\d+) ready", line)
        if m:
            return int(m.group(1))
    raise AssertionError("the worker did not log its engine process")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie (exited, not yet reaped) counts as gone
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split(")")[-1].split()[0] != "Z"


def _request(rid, prompt, **params):
    return decode_pb2.GenerateRequest(
        request_id=rid,
        token_ids=common_pb2.TokenIds(ids=prompt),
        sampling_params=common_pb2.SamplingParams(temperature=0, **params),
    )


def _generate(worker, req, timeout=60):
    with worker.channel() as ch:
        return list(decode_pb2_grpc.DecodeServiceStub(ch).Generate(req, timeout=timeout))


def _snapshot(out: RequestOutput) -> tuple:
    """out as it is now (its logprob lists are live: they grow with later steps)."""
    c = out.output
    lps = None if c.logprobs is None else list(c.logprobs)
    prompt_lps = None if out.prompt_logprobs is None else list(out.prompt_logprobs)
    return (
        out.request_id, out.prompt_token_ids, list(c.token_ids), c.text, lps,
        out.finished, c.finish_reason, c.stop_reason, out.num_cached_tokens, prompt_lps,
    )  # fmt: skip


def test_deltas_rebuild_every_output(colocated):
    """Unit: an engine with delta outputs (an engine process's) sends deltas that
    DeltaDecoder turns back into the outputs the same engine returns without them,
    output after output (tokens, text, logprobs, prompt logprobs, finish and stop
    reasons), the plain middle of an output as the News that extends the output before
    it; it detokenizes only requests with stop strings, and the receiving side
    makes the others' text. Neither side keeps state for an ended request, and every
    block comes back."""
    tok = colocated.tokenizer
    prompts = [tok.encode("The capital of France is"), tok.encode("Count: one, two, three,")]
    kinds = {
        "plain": SamplingParams(temperature=0, max_tokens=24),
        "stop": SamplingParams(temperature=0, max_tokens=24, stop=[" five"]),
        "logprobs": SamplingParams(temperature=0, max_tokens=12, logprobs=2, prompt_logprobs=1),
    }
    engine = colocated.engine

    news: list[str] = []  # the requests that got News (the plain middle)

    def run(decoder: DeltaDecoder | None) -> dict[str, list[tuple]]:
        seen: dict[str, list[tuple]] = {}
        for i, prompt in enumerate(prompts):
            for kind, params in kinds.items():
                rid = f"{kind}{i}"
                if decoder is not None and kind != "stop":
                    decoder.expect(rid, IncrementalDetokenizer(tok, params))
                engine.add_request(rid, prompt, params)
        while engine.has_unfinished_requests():
            for out in engine.step():
                if decoder is not None:
                    if not out[0].startswith("stop"):
                        assert out[2] == ""  # no text from the engine
                    out = decoder.decode(out)
                if isinstance(out, News):  # the plain middle: the last snapshot plus it
                    last = seen[out.request_id][-1]
                    assert last[4] is None and not last[5]  # no logprobs, not finished
                    tokens = last[2] + out.new_token_ids
                    assert out.num_token_ids == len(tokens)
                    snapshot = (*last[:2], tokens, last[3] + out.new_text, *last[4:])
                    seen[out.request_id].append(snapshot)
                    news.append(out.request_id)
                else:
                    seen.setdefault(out.request_id, []).append(_snapshot(out))
        return seen

    want = run(None)
    engine.delta_outputs = True
    decoder = DeltaDecoder()
    try:
        got = run(decoder)
    finally:
        engine.delta_outputs = False
    assert got == want
    # News for the plain middle of the outputs without logprobs, and only for those
    assert {rid[:-1] for rid in news} == {"plain", "stop"}
    assert all(outs[-1][5] for outs in got.values())  # every request finished
    assert "five" not in got["stop1"][-1][3]  # the engine's stop string cut the text
    assert got["logprobs0"][-1][9] is not None  # prompt logprobs crossed in the first delta
    assert len(decoder) == 0 and not engine.requests
    assert_all_blocks_free(colocated)


def test_outputs_equal_the_colocated_engine(decode, colocated):
    tok = colocated.tokenizer
    prompts = [tok.encode("The capital of France is"), tok.encode("Count: one, two, three,")]
    params = dict(max_tokens=16, logprobs=2)
    refs = colocated.generate(prompts, SamplingParams(temperature=0, max_tokens=16, logprobs=2))
    for i, (prompt, ref) in enumerate(zip(prompts, refs)):
        responses = _generate(decode, _request(f"eq{i}", prompt, **params))
        tokens = [t for r in responses for t in r.token_ids]
        assert tokens == ref.output.token_ids
        assert "".join(r.text for r in responses) == ref.output.text
        lps = [lp for r in responses for lp in r.logprobs]
        assert [lp.token_id for lp in lps] == tokens
        want = [entry[t].logprob for t, entry in zip(tokens, ref.output.logprobs)]
        # the worker's kernels and batches differ from the in-process engine's: fp32
        # rounding only (test_integration.py's tolerance); a delta carried to the wrong
        # token would be off by far more
        assert [lp.logprob for lp in lps] == pytest.approx(want, abs=1e-3)
        assert responses[-1].usage.completion_tokens == len(tokens)
    decode.wait_all_blocks_free()


def test_stop_strings_and_structured_outputs(decode, colocated):
    tok = colocated.tokenizer
    prompt = tok.encode("Count: one, two, three,")
    (ref,) = colocated.generate(
        [prompt], SamplingParams(temperature=0, max_tokens=32, stop=[" five"])
    )
    responses = _generate(decode, _request("stop", prompt, max_tokens=32, stop=[" five"]))
    assert "".join(r.text for r in responses) == ref.output.text
    assert responses[-1].stop_string == " five"

    schema = json.dumps(
        {
            "type": "object",
            "properties": {"answer": {"enum": ["yes", "no"]}},
            "required": ["answer"],
            "additionalProperties": False,
        }
    )
    question = tok.encode("Is Paris in France? Answer in JSON:")
    (ref,) = colocated.generate(
        [question],
        SamplingParams(
            temperature=0, max_tokens=24, structured_output=StructuredOutput("json", schema)
        ),
    )
    structured = common_pb2.StructuredOutput(kind="json", spec=schema)
    responses = _generate(
        decode, _request("json", question, max_tokens=24, structured_output=structured)
    )
    text = "".join(r.text for r in responses)
    assert text == ref.output.text and json.loads(text)["answer"] in ("yes", "no")

    bad = common_pb2.StructuredOutput(kind="json", spec="{not json")
    with pytest.raises(grpc.RpcError) as err:
        _generate(decode, _request("bad", prompt, max_tokens=4, structured_output=bad))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    decode.wait_all_blocks_free()


def test_abort_and_cancel_free_the_blocks(decode, colocated):
    prompt = colocated.tokenizer.encode("Write a long story:")
    with decode.channel() as ch:
        stub = decode_pb2_grpc.DecodeServiceStub(ch)
        call = stub.Generate(_request("ab", prompt, max_tokens=4000, ignore_eos=True), timeout=60)
        first = next(call)
        assert first.token_ids
        assert decode.load().num_running == 1
        assert stub.Abort(common_pb2.AbortRequest(request_id="ab"), timeout=10).found
        last = list(call)[-1]
        assert last.finish_reason == common_pb2.FINISH_REASON_ABORT
        assert not stub.Abort(common_pb2.AbortRequest(request_id="ab"), timeout=10).found

        call = stub.Generate(_request("cc", prompt, max_tokens=4000, ignore_eos=True), timeout=60)
        next(call)
        call.cancel()
    start = time.monotonic()
    report = decode.wait_all_blocks_free(timeout=1.0)
    assert report.num_free_blocks == report.num_total_blocks and report.num_running == 0
    assert time.monotonic() - start < 1.5


def test_the_engine_process_collector_pauses_are_counted(decode):
    """The engine process's GC pauses reach the worker's /metrics, apart from the
    worker's own (its status reports carry them, about once a second)."""
    (ready,) = [line for line in decode.log if line.startswith("PDSERVE ") and '"ready"' in line]
    port = json.loads(ready[len("PDSERVE ") :])["metrics_port"]
    # logprobs: objects that live as long as the request, so the young generation fills
    # (a plain decode step's garbage is freed as it goes and may never trigger one)
    gc_req = _request("gc", [5 + i for i in range(8)], max_tokens=200, logprobs=5, ignore_eos=True)
    _generate(decode, gc_req)
    deadline = time.monotonic() + 10
    while True:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
            text = r.read().decode()
        counts = re.findall(
            r'^pdserve_engine_gc_pause_seconds_count\{generation="0"\} (\S+)', text, re.M
        )
        if counts and float(counts[0]) > 0:
            break
        assert time.monotonic() < deadline, "no engine-process GC pause was reported"
        time.sleep(0.2)
    assert re.search(r'^pdserve_gc_pause_seconds_count\{generation="0"\}', text, re.M)


def test_the_worker_ends_with_its_engine_process(model):
    worker = start_worker("decode", "--engine-process", model=model)
    try:
        engine_pid = _engine_pid(worker)
        prompt = [5 + i for i in range(8)]
        errors = []

        def stream():
            try:
                _generate(worker, _request("k", prompt, max_tokens=4000, ignore_eos=True))
            except grpc.RpcError as e:
                errors.append(e.code())

        reader = threading.Thread(target=stream)
        reader.start()
        deadline = time.monotonic() + 30
        while worker.load().num_running == 0:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        os.kill(engine_pid, signal.SIGKILL)
        reader.join(30)
        assert errors and errors[0] != grpc.StatusCode.OK  # the stream failed, not hung
        assert worker.proc.wait(30) != 0  # the worker went down with it, non-zero
        assert any("engine process exited" in line for line in worker.log)
    finally:
        worker.stop()


def test_the_engine_process_ends_with_its_worker(model):
    worker = start_worker("decode", "--engine-process", model=model)
    engine_pid = _engine_pid(worker)
    worker.stop()  # SIGTERM: drains, stops the engine process, exits
    assert worker.proc.returncode == 0
    deadline = time.monotonic() + 10
    while _alive(engine_pid):
        assert time.monotonic() < deadline, "the engine process outlived its worker"
        time.sleep(0.05)

    worker = start_worker("decode", "--engine-process", model=model)
    engine_pid = _engine_pid(worker)
    worker.proc.kill()  # no drain, no stop command: the pipe's end closes
    worker.proc.wait(10)
    deadline = time.monotonic() + 10
    while _alive(engine_pid):
        assert time.monotonic() < deadline, "the engine process outlived a killed worker"
        time.sleep(0.05)
