"""The prefill worker checks a request's structured output off its event loop, as the
decode worker does: compiling a grammar can take seconds, and the loop serves every
other call meanwhile. Prefill is called directly on a real prefill worker, with the
session of a real decode worker. No call here writes KV: each one is refused while it is
validated (the decode worker's free blocks may hold its prefix cache)."""

from __future__ import annotations

import json
import re
import time

import grpc
import pytest

from pdpb.v1 import common_pb2, decode_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc
from services.engine import SamplingParams, StructuredOutput
from tests.workers.procs import worker_pair

BLOCK = 16  # the workers' default block size
MAX_MODEL_LEN = 128
# a JSON schema that takes xgrammar seconds to compile (1.8 s for 7000 values, 13 s
# for 20000, on this project's CPU machines)
SLOW = json.dumps({"enum": [f"value number {i}" for i in range(9000)]})
REGEX = r"[a-z]{3}-[0-9]{2}"


@pytest.fixture(scope="module")
def pair(model):
    args = ("--max-model-len", str(MAX_MODEL_LEN))
    with worker_pair(model, prefill_args=args, decode_args=args) as workers:
        yield workers


@pytest.fixture(scope="module")
def session(pair) -> str:
    """The decode worker's transfer session, once it has paired with the prefill worker."""
    prefill, decode = pair
    with decode.channel() as ch:
        stub = decode_pb2_grpc.DecodeServiceStub(ch)
        req = decode_pb2.AddPrefillPeerRequest(prefill_address=prefill.address)
        return stub.AddPrefillPeer(req, timeout=60).session_id


@pytest.fixture(autouse=True)
def no_leaks(pair):
    yield
    for w in pair:
        report = w.wait_all_blocks_free(timeout=5.0)
        assert report.num_free_blocks == report.num_total_blocks, f"{w.role} leaked blocks"


def prefill_request(rid: str, prompt: list[int], kind: str, spec: str, session: str):
    return prefill_pb2.PrefillRequest(
        request_id=rid,
        prompt_token_ids=prompt,
        sampling_params=common_pb2.SamplingParams(
            max_tokens=4,
            temperature=0,
            structured_output=common_pb2.StructuredOutput(kind=kind, spec=spec),
        ),
        decode_session_id=session,
        block_ids=list(range(-(-len(prompt) // BLOCK))),
    )


def test_a_call_compiling_its_grammar_leaves_the_loop_free_and_can_be_aborted(pair, session):
    """While one call's grammar compiles (seconds), the worker answers GetLoad, refuses
    the same request id (the call is in flight), and Abort finds the call and stops it.
    Compiled on the loop, all three would wait for the compilation, and Abort would come
    too late to find the call."""
    prefill, _ = pair
    # too long for max_model_len, which validation checks after the grammar: so the call
    # fails, after compiling, if it is not aborted first
    prompt = [1] * MAX_MODEL_LEN
    with prefill.channel() as ch:
        stub = prefill_pb2_grpc.PrefillServiceStub(ch)
        started = time.monotonic()
        slow = stub.Prefill.future(
            prefill_request("slow", prompt, "json", SLOW, session), timeout=120
        )
        time.sleep(0.5)  # the call is compiling now
        load = prefill.load()
        assert load.role == common_pb2.ROLE_PREFILL and not slow.done()
        with pytest.raises(grpc.RpcError) as dup:
            stub.Prefill(prefill_request("slow", prompt, "regex", REGEX, session), timeout=30)
        assert dup.value.code() == grpc.StatusCode.ALREADY_EXISTS, dup.value.details()
        assert not slow.done()
        aborted = stub.Abort(common_pb2.AbortRequest(request_id="slow"), timeout=30)
        assert aborted.found  # and Abort returned once the call had let go of everything
        slow.cancel()  # as the decode worker does: it aborts only calls it has cancelled
        print(f"aborted after {time.monotonic() - started:.2f}s")
        # the id is free again (refused here for the prompt's length, which validation
        # checks after the grammar)
        with pytest.raises(grpc.RpcError) as err:
            stub.Prefill(prefill_request("slow", prompt, "regex", REGEX, session), timeout=60)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "max_model_len" in err.value.details()


@pytest.mark.parametrize(
    "kind,spec",
    [("regex", "(unclosed"), ("json", '{"type": "nonsense"}'), ("grammar", "root ::= ")],
)
def test_a_bad_spec_is_invalid_argument(pair, session, kind, spec):
    prefill, _ = pair
    prompt = list(range(100, 120))
    with prefill.channel() as ch:
        stub = prefill_pb2_grpc.PrefillServiceStub(ch)
        for _ in range(2):  # the refused call let go of its id
            with pytest.raises(grpc.RpcError) as err:
                stub.Prefill(
                    prefill_request(f"bad-{kind}", prompt, kind, spec, session), timeout=60
                )
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
            assert err.value.details().startswith(f"structured output ({kind})")


def test_a_constrained_first_token_comes_from_the_prefill_worker(pair, colocated):
    """Through the decode worker: the prefill worker compiles the grammar (off its loop),
    samples the constrained first token, and the output equals the colocated engine's."""
    prefill, decode = pair
    prompt = colocated.tokenizer.encode("My licence plate reads")
    so = StructuredOutput("regex", REGEX)
    ref = colocated.generate(
        [prompt], SamplingParams(temperature=0, max_tokens=16, structured_output=so)
    )[0].output.token_ids
    req = decode_pb2.GenerateRequest(
        request_id=f"regex-{time.monotonic_ns()}",
        token_ids=common_pb2.TokenIds(ids=prompt),
        sampling_params=common_pb2.SamplingParams(
            max_tokens=16,
            temperature=0,
            structured_output=common_pb2.StructuredOutput(kind="regex", spec=REGEX),
        ),
        prefill_address=prefill.address,
    )
    tokens, last = [], None
    with decode.channel() as ch:
        for resp in decode_pb2_grpc.DecodeServiceStub(ch).Generate(req, timeout=120):
            tokens.extend(resp.token_ids)
            last = resp
    assert not last.timings.prefill_fallback
    assert tokens == ref
    assert last.finish_reason == common_pb2.FINISH_REASON_STOP
    text = colocated.tokenizer.decode(tokens, skip_special_tokens=True)
    assert re.fullmatch(REGEX, text), text
