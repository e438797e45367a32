"""Maps a checkpoint's `architectures` entry to our model class."""

from __future__ import annotations

from services.models.llama import LlamaForCausalLM
from services.models.mixtral import MixtralForCausalLM
from services.models.phi3 import Phi3ForCausalLM
from services.models.qwen2 import Qwen2ForCausalLM
from services.models.qwen2_moe import Qwen2MoeForCausalLM
from services.models.qwen3 import Qwen3ForCausalLM
from services.models.qwen3_moe import Qwen3MoeForCausalLM

_ARCHITECTURES = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen2MoeForCausalLM": Qwen2MoeForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "Phi3ForCausalLM": Phi3ForCausalLM,
}


def model_class(hf_config):
    for arch in getattr(hf_config, "architectures", None) or []:
        if arch in _ARCHITECTURES:
            return _ARCHITECTURES[arch]
    raise ValueError(
        f"unsupported architectures {hf_config.architectures!r}; "
        f"supported: {', '.join(sorted(_ARCHITECTURES))}"
    )
