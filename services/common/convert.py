"""Protobuf <-> engine types, at the edge of the services. The engine never sees pb."""

from __future__ import annotations

import json

from kvtransfer import KVAgentInfo, KVLayout
from pdpb.v1 import common_pb2, decode_pb2
from services.engine import SamplingParams
from services.engine.sampling_params import StructuredOutput
from services.engine.sequence import Logprob

_FINISH = {
    "stop": common_pb2.FINISH_REASON_STOP,
    "length": common_pb2.FINISH_REASON_LENGTH,
    "abort": common_pb2.FINISH_REASON_ABORT,
}


def sampling_params_from_pb(pb: common_pb2.SamplingParams) -> SamplingParams:
    """Raises ValueError for out-of-range values (callers answer INVALID_ARGUMENT)."""
    kwargs: dict = dict(
        presence_penalty=pb.presence_penalty,
        frequency_penalty=pb.frequency_penalty,
        stop=list(pb.stop),
        stop_token_ids=list(pb.stop_token_ids),
        include_stop_str_in_output=pb.include_stop_str_in_output,
        ignore_eos=pb.ignore_eos,
        min_tokens=pb.min_tokens,
    )
    for name in (
        "max_tokens",
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "seed",
        "repetition_penalty",
        "logprobs",
        "skip_special_tokens",
        "prompt_logprobs",
        "truncate_prompt_tokens",
    ):
        if pb.HasField(name):
            kwargs[name] = getattr(pb, name)
    kwargs["logit_bias"] = dict(pb.logit_bias)
    kwargs["priority"] = pb.priority
    kwargs["bad_words"] = list(pb.bad_words)
    if pb.HasField("allowed_token_ids"):
        kwargs["allowed_token_ids"] = list(pb.allowed_token_ids.ids)
    if pb.HasField("structured_output"):
        so = pb.structured_output
        kwargs["structured_output"] = StructuredOutput(so.kind, so.spec)
    if "max_tokens" not in kwargs:
        kwargs["max_tokens"] = None  # unset: until the context is full or a stop
    return SamplingParams(**kwargs)


def structured_output_to_pb(so: StructuredOutput) -> common_pb2.StructuredOutput:
    return common_pb2.StructuredOutput(kind=so.kind, spec=so.spec)


def logprob_to_pb(
    token_id: int, entry: dict[int, Logprob], num_top: int
) -> common_pb2.TokenLogprob:
    chosen = entry[token_id]
    # entry holds the top-n plus the chosen token, which may rank below them
    top = sorted(
        ((t, lp) for t, lp in entry.items() if lp.rank <= num_top), key=lambda kv: kv[1].rank
    )
    return common_pb2.TokenLogprob(
        token_id=token_id,
        logprob=chosen.logprob,
        rank=chosen.rank,
        token=chosen.decoded_token or "",
        top=[
            common_pb2.TopLogprob(token_id=tid, logprob=lp.logprob, token=lp.decoded_token or "")
            for tid, lp in top
        ],
    )


def prompt_logprobs_to_pb(
    prompt_ids: list[int], entries: list, num_top: int
) -> list[common_pb2.TokenLogprob]:
    """RequestOutput.prompt_logprobs ([None, {token id: Logprob}, ...]) -> pb, one per
    prompt token after the first."""
    return [logprob_to_pb(t, e, num_top) for t, e in zip(prompt_ids[1:], entries[1:])]


def logprob_from_pb(pb: common_pb2.TokenLogprob, num_top: int):
    """Back to the sampler's (logprob, rank, [(token id, logprob)]) form."""
    top = [(t.token_id, t.logprob) for t in pb.top][:num_top]
    return pb.logprob, pb.rank, top


def finish_reason_to_pb(reason: str | None) -> int:
    return _FINISH.get(reason or "", common_pb2.FINISH_REASON_UNSPECIFIED)


def agent_to_pb(info: KVAgentInfo) -> common_pb2.KVAgentInfo:
    return common_pb2.KVAgentInfo(
        session_id=info.session_id,
        base_addr=info.base_addr,
        layout=common_pb2.KVLayout(**info.layout.to_dict()),
        backend=info.backend,
        protocol=info.protocol,
    )


def agent_from_pb(pb: common_pb2.KVAgentInfo) -> KVAgentInfo:
    """Raises ValueError for an incomplete or invalid description."""
    fields = (
        "num_blocks",
        "block_size",
        "num_layers",
        "num_kv_heads",
        "head_dim",
        "dtype",
        "layout",
        "k_scales",
        "v_scales",
        "tp_rank",
        "total_kv_heads",  # 0 (unset) is normalised by KVLayout
    )
    layout = KVLayout(
        **{f: getattr(pb.layout, f) for f in fields},
        tp_size=pb.layout.tp_size or 1,  # unset by a peer that predates TP
    )
    return KVAgentInfo(
        session_id=pb.session_id,
        base_addr=pb.base_addr,
        layout=layout,
        backend=pb.backend,
        protocol=pb.protocol,
    )


def timings_to_pb(timings) -> decode_pb2.Timings:
    """services.decode.remote_prefill.PrefillTimings -> pb."""
    return decode_pb2.Timings(
        queue_seconds=timings.queue_seconds,
        prefill_seconds=timings.prefill_seconds,
        kv_transfer_seconds=timings.kv_transfer_seconds,
        prefill_fallback=timings.prefill_fallback,
    )


def chat_messages_from_pb(chat: common_pb2.Conversation) -> tuple[list[dict], list[dict] | None]:
    """A Conversation's messages as the chat template reads them (each message's tool
    fields merged in) and its tools; raises ValueError for malformed tool JSON."""
    messages = [{"role": m.role, "content": m.content} for m in chat.messages]
    extras = list(chat.message_tools_json)
    if extras and len(extras) != len(messages):
        raise ValueError("message_tools_json must have one entry per message")
    for message, extra in zip(messages, extras):
        if extra:
            fields = json.loads(extra)
            if not isinstance(fields, dict):
                raise ValueError("a message's tool fields must be a JSON object")
            message.update(fields)
    tools = json.loads(chat.tools_json) if chat.tools_json else None
    if tools is not None and not isinstance(tools, list):
        raise ValueError("tools must be a JSON list")
    return messages, tools
