from pdpb.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class HandshakeRequest(_message.Message):
    __slots__ = ("decode_agent", "decode_rank_agents")
    DECODE_AGENT_FIELD_NUMBER: _ClassVar[int]
    DECODE_RANK_AGENTS_FIELD_NUMBER: _ClassVar[int]
    decode_agent: _common_pb2.KVAgentInfo
    decode_rank_agents: _containers.RepeatedCompositeFieldContainer[_common_pb2.KVAgentInfo]
    def __init__(self, decode_agent: _Optional[_Union[_common_pb2.KVAgentInfo, _Mapping]] = ..., decode_rank_agents: _Optional[_Iterable[_Union[_common_pb2.KVAgentInfo, _Mapping]]] = ...) -> None: ...

class HandshakeResponse(_message.Message):
    __slots__ = ("prefill_agent", "model", "prefill_rank_agents")
    PREFILL_AGENT_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    PREFILL_RANK_AGENTS_FIELD_NUMBER: _ClassVar[int]
    prefill_agent: _common_pb2.KVAgentInfo
    model: str
    prefill_rank_agents: _containers.RepeatedCompositeFieldContainer[_common_pb2.KVAgentInfo]
    def __init__(self, prefill_agent: _Optional[_Union[_common_pb2.KVAgentInfo, _Mapping]] = ..., model: _Optional[str] = ..., prefill_rank_agents: _Optional[_Iterable[_Union[_common_pb2.KVAgentInfo, _Mapping]]] = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling_params", "decode_session_id", "block_ids", "num_cached_tokens")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_PARAMS_FIELD_NUMBER: _ClassVar[int]
    DECODE_SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling_params: _common_pb2.SamplingParams
    decode_session_id: str
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    num_cached_tokens: int
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling_params: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., decode_session_id: _Optional[str] = ..., block_ids: _Optional[_Iterable[int]] = ..., num_cached_tokens: _Optional[int] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("request_id", "first_token_id", "first_logprob", "num_blocks_sent", "bytes_sent", "prefill_seconds", "transfer_seconds", "prompt_logprobs")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_LOGPROB_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_SENT_FIELD_NUMBER: _ClassVar[int]
    BYTES_SENT_FIELD_NUMBER: _ClassVar[int]
    PREFILL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    first_token_id: int
    first_logprob: _common_pb2.TokenLogprob
    num_blocks_sent: int
    bytes_sent: int
    prefill_seconds: float
    transfer_seconds: float
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprob]
    def __init__(self, request_id: _Optional[str] = ..., first_token_id: _Optional[int] = ..., first_logprob: _Optional[_Union[_common_pb2.TokenLogprob, _Mapping]] = ..., num_blocks_sent: _Optional[int] = ..., bytes_sent: _Optional[int] = ..., prefill_seconds: _Optional[float] = ..., transfer_seconds: _Optional[float] = ..., prompt_logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprob, _Mapping]]] = ...) -> None: ...
