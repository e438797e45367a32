"""A step's outputs as what is new in them, to cross a process boundary.

A RequestOutput holds the request's whole output so far (its token list, its text), so
sending it every step would copy O(output) per request per step. The engine process
sends what is new since the request's previous output instead, made straight from its
sequences (LLMEngine.delta_outputs: no RequestOutput is built there), and the receiving
process rebuilds RequestOutputs from its own copy of each request's tokens, text and
logprobs (DeltaDecoder), so the code that reads outputs is the same on both sides of
the boundary. The plain middle of an output (neither its first delta nor its last, no
logprobs) becomes only its News instead: the decode worker's reader
(services/decode/responses.py) takes both, and needs no more than the news from it.

Text is made where it is needed: the engine must detokenize a request with stop
strings (it stops on them), and only those; the receiving side detokenizes the others
(`DeltaDecoder.expect`), so a step's detokenization does not hold up the engine's next
step."""

from __future__ import annotations

from services.engine.outputs import CompletionOutput, RequestOutput
from services.engine.sampling_params import SamplingParams


def engine_makes_text(params: SamplingParams) -> bool:
    """Whether the engine process detokenizes this request (it has stop strings to
    match) or the receiving side does (everything else)."""
    return bool(params.stop)


# one output's news, a plain tuple (cheap to pickle): see make_delta
Delta = tuple


def make_delta(
    request_id: str,
    new_token_ids: list[int],
    new_text: str,
    new_logprobs: list | None,
    finished: bool,
    finish_reason: str | None,
    stop_reason: int | str | None,
    num_cached_tokens: int,
    first: tuple | None,
) -> Delta:
    """The request's output since its previous delta. new_text is "" where the
    receiving side makes the text; new_logprobs None without logprobs; first, in the
    request's first delta only: (prompt_token_ids, prompt_logprobs)."""
    return (
        request_id,
        new_token_ids,
        new_text,
        new_logprobs,
        finished,
        finish_reason,
        stop_reason,
        num_cached_tokens,
        first,
    )


class News:
    """A request's plain news from one step: new tokens and the text they add, in the
    middle of its output (not its first delta or its last, no logprobs). The receiving
    side hands this on instead of a RequestOutput, whose whole-output copy the reader
    would only cut back to the same news (decode/responses.py). num_token_ids counts
    the request's output tokens with these."""

    __slots__ = ("request_id", "new_token_ids", "new_text", "num_token_ids")

    def __init__(self, request_id: str, new_token_ids: list[int], new_text: str, n: int):
        self.request_id = request_id
        self.new_token_ids = new_token_ids
        self.new_text = new_text
        self.num_token_ids = n


class _Copy:
    __slots__ = ("token_ids", "text", "logprobs", "prompt_token_ids", "prompt_logprobs", "detok")

    def __init__(self, prompt_token_ids, prompt_logprobs, with_logprobs: bool, detok):
        self.token_ids: list[int] = []
        self.text = ""
        self.logprobs = [] if with_logprobs else None
        self.prompt_token_ids = prompt_token_ids
        self.prompt_logprobs = prompt_logprobs
        self.detok = detok  # makes the text here (the engine sends none), or None


class DeltaDecoder:
    """The receiving side: each request's output so far, rebuilt from its deltas."""

    def __init__(self):
        self._copies: dict[str, _Copy] = {}
        self._detoks: dict = {}  # request id -> its detokenizer, until its first delta

    def expect(self, request_id: str, detok) -> None:
        """This request's text is made here, by `detok` (an IncrementalDetokenizer):
        the engine sends its tokens without text."""
        self._detoks[request_id] = detok

    def decode(self, delta: Delta) -> RequestOutput | News:
        """The request's output so far, or only its News where the delta is the plain
        middle of the output."""
        rid, new_ids, new_text, new_lps, finished, reason, stop, cached, first = delta
        copy = self._copies.get(rid)
        if (  # the plain middle: tokens went before (so the builder has sent some)
            copy is not None
            and copy.token_ids
            and first is None
            and not finished
            and new_lps is None
        ):
            copy.token_ids += new_ids
            if copy.detok is None:
                copy.text += new_text
            else:  # its text is taken from the detokenizer when an output is built
                new_text = copy.detok.step(new_ids)  # no stop strings: the engine's rule
            return News(rid, new_ids, new_text, len(copy.token_ids))
        if copy is None or first is not None:
            prompt_ids, prompt_lps = first if first is not None else ([], None)
            detok = self._detoks.pop(rid, None)
            copy = self._copies[rid] = _Copy(prompt_ids, prompt_lps, new_lps is not None, detok)
        copy.token_ids += new_ids
        detok = copy.detok
        if detok is None:
            copy.text += new_text
        else:
            detok.step(new_ids)
            if finished:
                detok.flush()
            copy.text = detok.text
        if new_lps is not None:
            copy.logprobs += new_lps
        if finished:
            self._copies.pop(rid, None)  # (forget() may have run meanwhile, on another thread)
        completion = CompletionOutput(
            index=0,
            text=copy.text,
            source=copy.token_ids,
            logprobs=copy.logprobs,
            finish_reason=reason,
            stop_reason=stop,
        )
        return RequestOutput(
            rid, copy.prompt_token_ids, [completion], finished, cached, copy.prompt_logprobs
        )

    def forget(self, request_id: str) -> None:
        self._copies.pop(request_id, None)
        self._detoks.pop(request_id, None)

    def __len__(self) -> int:
        return len(self._copies) + len(self._detoks)
