"""One request's engine outputs as GenerateResponses: each response carries the tokens,
text and logprobs that are new since the previous one, the first one the prompt's ids
and logprobs when asked, the last one the finish reason, usage and timings. Shared by
the per-request Generate stream and the multiplexed GenerateStream."""

from __future__ import annotations

from pdpb.v1 import common_pb2
from services.common import convert
from services.decode.remote_prefill import PrefillTimings
from services.engine import RequestOutput
from services.engine.output_deltas import News


class ResponseBuilder:
    def __init__(self, engine, rid: str, request, prompt_ids: list[int], params):
        self.engine = engine
        self.rid = rid
        self.request = request
        self.prompt_ids = prompt_ids
        self.params = params
        self.timings = PrefillTimings()  # set once the prompt's KV is in place
        self.sent_tokens = 0
        self.sent_chars = 0

    def fill(self, out: RequestOutput, outbox) -> None:
        """Append out's news to this request's response in `outbox` (mux.Outbox): a
        fresh response, or the one not yet written (the Outbox merges while the reader
        is behind)."""
        completion = out.output
        first = self.sent_tokens == 0
        new_ids = completion.token_ids_from(self.sent_tokens)
        text = completion.text[self.sent_chars :]
        params = self.params
        if not (first or out.finished) and params.logprobs is None:
            self._add_plain(new_ids, text, completion.num_token_ids, outbox)
            return
        resp = outbox.response(self.rid, new_ids, text)
        if params.logprobs is not None and completion.logprobs:
            for tid, entry in zip(new_ids, completion.logprobs[self.sent_tokens :]):
                resp.logprobs.append(convert.logprob_to_pb(tid, entry, params.logprobs))
        if first and self.request.return_prompt:
            self._add_prompt(resp)
        if first and out.prompt_logprobs is not None:
            self._add_prompt_logprobs(resp, out)
        self.sent_tokens = completion.num_token_ids
        self.sent_chars += len(text)
        if out.finished:
            resp.finish_reason = convert.finish_reason_to_pb(completion.finish_reason)
            if isinstance(completion.stop_reason, int):
                resp.stop_token_id = completion.stop_reason
            elif isinstance(completion.stop_reason, str):
                resp.stop_string = completion.stop_reason
            resp.usage.CopyFrom(
                common_pb2.Usage(
                    prompt_tokens=len(self.prompt_ids),
                    completion_tokens=self.sent_tokens,
                    cached_tokens=out.num_cached_tokens,
                )
            )
            resp.timings.CopyFrom(convert.timings_to_pb(self.timings))

    def fill_news(self, news: News, outbox) -> None:
        """Append a News (the plain middle of the output, from the engine process's
        deltas: never its first, OutboxSink checks its place) to this request's
        response in `outbox`."""
        self._add_plain(news.new_token_ids, news.new_text, news.num_token_ids, outbox)

    def _add_plain(self, new_ids: list[int], text: str, num_token_ids: int, outbox) -> None:
        """The plain middle of the output: tokens and text only (a TokenDeltas entry
        where the reader takes them)."""
        if new_ids or text:
            outbox.delta(self.rid, new_ids, text)
            self.sent_tokens = num_token_ids
            self.sent_chars += len(text)

    def fill_aborted(self, outbox) -> None:
        """The last response of a request ended by Abort()."""
        resp = outbox.response(self.rid)
        resp.finish_reason = common_pb2.FINISH_REASON_ABORT
        resp.usage.CopyFrom(
            common_pb2.Usage(prompt_tokens=len(self.prompt_ids), completion_tokens=self.sent_tokens)
        )

    def _add_prompt(self, resp) -> None:
        resp.prompt_token_ids.extend(self.prompt_ids)
        if self.request.HasField("text"):
            resp.prompt_text = self.request.text
        elif self.engine.tokenizer is not None:
            resp.prompt_text = self.engine.tokenizer.decode(self.prompt_ids)

    def _add_prompt_logprobs(self, resp, out: RequestOutput) -> None:
        # the first prompt token has no logprob (rank 0); its text is still needed (echo)
        prompt_ids = self.prompt_ids
        first = self.engine.decode_token(prompt_ids[0]) or ""
        resp.prompt_logprobs.append(
            common_pb2.TokenLogprob(token_id=prompt_ids[0], rank=0, token=first)
        )
        resp.prompt_logprobs.extend(
            convert.prompt_logprobs_to_pb(
                prompt_ids, out.prompt_logprobs, self.params.prompt_logprobs
            )
        )
