"""The LLM engine shared by the prefill and decode workers (nano-vllm shaped)."""

from services.engine.config import EngineConfig
from services.engine.llm import LLM
from services.engine.llm_engine import LLMEngine
from services.engine.outputs import CompletionOutput, RequestOutput
from services.engine.pd_roles import KVReservation, NoFreeBlocksError
from services.engine.sampling_params import SamplingParams, StructuredOutput
from services.models.tokenizer import apply_chat_template

__all__ = [
    "LLM",
    "CompletionOutput",
    "EngineConfig",
    "KVReservation",
    "LLMEngine",
    "NoFreeBlocksError",
    "RequestOutput",
    "SamplingParams",
    "StructuredOutput",
    "apply_chat_template",
]
