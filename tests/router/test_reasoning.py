"""Reasoning parsers on recorded outputs of each family's format: the whole-output split,
and the same split when the output arrives in deltas cut at every position (tags split
across deltas included)."""

from __future__ import annotations

import pytest

from router.config import RouterConfig
from router.protocol import parse_chat_request
from router.reasoning import ReasoningStream, make_reasoning_parser
from router.responses import ResponseBuilder

# Qwen3 with its own template: the model opens the block itself.
QWEN3 = (
    "<think>\nOkay, the user asks for the capital of France. That is Paris.\n</think>\n\n"
    "The capital of France is **Paris**."
)
# DeepSeek-R1 (template opens `<think>\n` in the prompt): only the end tag is generated.
R1 = (
    "Okay, 2 + 3: adding gives 5. Check: 5 - 3 = 2. Right.\n</think>\n\n"
    "2 + 3 = **5**. Note that `</think>` may appear again in the answer."
)
# Qwen3 with enable_thinking false: the template closed the block in the prompt.
QWEN3_NO_THINK = "The capital of France is Paris."
# Stopped by max_tokens inside the block.
TRUNCATED = "<think>\nLet me count the letters: s, t, r, a"


def streamed(text: str, cuts: list[int], thinking: bool = True) -> tuple[str, str, bool]:
    stream = ReasoningStream(thinking)
    reasoning = content = ""
    for a, b in zip([0, *cuts], [*cuts, len(text)]):
        r, c = stream.feed(text[a:b])
        reasoning, content = reasoning + r, content + c
    r, c = stream.finish()
    return reasoning + r, content + c, stream.ended


@pytest.mark.parametrize("name", ["qwen3", "deepseek_r1"])
def test_split_of_recorded_outputs(name):
    parser = make_reasoning_parser(name)
    assert parser.split(QWEN3) == (
        "\nOkay, the user asks for the capital of France. That is Paris.\n",
        "\n\nThe capital of France is **Paris**.",
    )
    reasoning, content = parser.split(R1)
    assert reasoning == "Okay, 2 + 3: adding gives 5. Check: 5 - 3 = 2. Right.\n"
    assert content.startswith("\n\n2 + 3 = **5**.") and content.endswith(
        "`</think>` may appear again in the answer."
    )
    assert parser.split(TRUNCATED) == ("\nLet me count the letters: s, t, r, a", None)
    assert parser.split("</think>") == ("", None)


def test_qwen3_enable_thinking_false_is_all_content():
    qwen3, r1 = make_reasoning_parser("qwen3"), make_reasoning_parser("deepseek_r1")
    kwargs = {"enable_thinking": False}
    assert qwen3.thinking(kwargs) is False and qwen3.thinking({"enable_thinking": True})
    assert qwen3.split(QWEN3_NO_THINK, qwen3.thinking(kwargs)) == (None, QWEN3_NO_THINK)
    # deepseek_r1 has no such switch: an output without </think> is reasoning
    assert r1.thinking(kwargs) is True
    assert r1.split(QWEN3_NO_THINK, r1.thinking(kwargs)) == (QWEN3_NO_THINK, None)


@pytest.mark.parametrize("text", [QWEN3, R1, TRUNCATED, "a</thi", "<thin", "x</think"])
def test_every_single_cut_streams_like_the_whole(text):
    parser = make_reasoning_parser("deepseek_r1")
    whole_r, whole_c = parser.split(text)
    for cut in range(len(text) + 1):
        r, c, ended = streamed(text, [cut])
        assert r == (whole_r or ""), (cut, r)
        assert c == (whole_c or ""), (cut, c)


@pytest.mark.parametrize("text", [QWEN3, R1])
def test_char_by_char_streams_like_the_whole(text):
    whole_r, whole_c = make_reasoning_parser("qwen3").split(text)
    assert streamed(text, list(range(1, len(text)))) == (whole_r, whole_c, True)


def test_held_back_partial_tag_is_not_released_early():
    stream = ReasoningStream()
    assert stream.feed("abc</th") == ("abc", "")
    assert stream.feed("ink>def") == ("", "def")
    # a held-back piece that turns out not to be a tag is released as reasoning
    stream = ReasoningStream()
    assert stream.feed("a</") == ("a", "")
    assert stream.feed("b") == ("</b", "")


def test_unknown_parser_is_refused_at_construction():
    with pytest.raises(ValueError, match="unknown reasoning_parser 'qwen2'.*deepseek_r1"):
        RouterConfig(decode=("127.0.0.1:1",), reasoning_parser="qwen2")
    with pytest.raises(ValueError, match="unknown reasoning parser"):
        make_reasoning_parser("nope")


class _Resp:
    """The fields of a GenerateResponse that ResponseBuilder reads."""

    def __init__(self, text: str, finish: int = 0):
        from pdpb.v1 import common_pb2, decode_pb2

        self.pb = decode_pb2.GenerateResponse(text=text, token_ids=[1], finish_reason=finish)
        if finish:
            self.pb.usage.CopyFrom(common_pb2.Usage(prompt_tokens=3, completion_tokens=9))


def test_chat_chunks_and_message_carry_reasoning_apart():
    from pdpb.v1 import common_pb2

    req = parse_chat_request({"messages": [{"role": "user", "content": "hi"}], "stream": True})
    parser = make_reasoning_parser("deepseek_r1")
    pieces = ["<think>\nhmm", " ok</th", "ink>\n\nHel", "lo"]
    builder = ResponseBuilder(req, "r1", "m", parser)
    deltas = []
    for i, p in enumerate(pieces):
        finish = common_pb2.FINISH_REASON_STOP if i == len(pieces) - 1 else 0
        for chunk in builder.chunks(0, _Resp(p, finish).pb):
            deltas.append(chunk["choices"][0]["delta"])
    reasoning = "".join(d.get("reasoning", "") for d in deltas)
    assert reasoning == "".join(d.get("reasoning_content", "") for d in deltas) == "\nhmm ok"
    assert "".join(d.get("content", "") for d in deltas) == "\n\nHello"
    message = builder.response()["choices"][0]["message"]
    assert message["reasoning"] == message["reasoning_content"] == "\nhmm ok"
    assert message["content"] == "\n\nHello"
    # without a parser the text is content, tags and all
    plain = ResponseBuilder(req, "r2", "m")
    for p in pieces:
        plain.add(0, _Resp(p).pb)
    assert plain.response()["choices"][0]["message"] == {
        "role": "assistant",
        "content": "".join(pieces),
    }
