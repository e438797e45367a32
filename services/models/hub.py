"""Models named by their Hugging Face Hub id (`--model Qwen/Qwen2.5-7B-Instruct`), as
vLLM and SGLang take them: the files the engine reads are fetched into the Hub's cache
(`huggingface_hub.snapshot_download`; HF_HOME / HF_HUB_CACHE, or --download-dir) and the
local snapshot folder is loaded. HF_TOKEN authorises gated repos; HF_HUB_OFFLINE=1 uses
what the cache already holds, with no network. Several workers starting at once share
one download (the library locks each file)."""

from __future__ import annotations

import logging
import re
from pathlib import Path

log = logging.getLogger(__name__)

# owner/name, as the Hub spells repo ids
_REPO_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*")

# what the engine reads, from the repo's top folder: config and generation config,
# safetensors weights and their index, tokenizer files (tokenizer.json / .model / vocab
# + merges / tiktoken) and chat templates; not .bin / .pth weights, not subfolders
# (Llama's original/), and not the duplicate consolidated weights some repos ship
# beside the transformers ones (Mistral's consolidated.safetensors)
ALLOW_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.txt", "*.tiktoken", "*.jinja"]
IGNORE_PATTERNS = ["*/*", "consolidated*.safetensors"]


def looks_like_repo_id(name: str) -> bool:
    return bool(_REPO_ID.fullmatch(name))


def download_model(
    repo_id: str, revision: str | None = None, download_dir: str | None = None
) -> Path:
    """The local folder of repo_id at revision (a branch, tag or commit; None: main),
    fetched first where the cache lacks it. Raises ValueError saying what went wrong:
    no such repo or revision, a gated repo without a token, no network and nothing
    cached."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    where = f"{repo_id}" + (f" at revision {revision}" if revision else "")
    try:
        path = snapshot_download(
            repo_id,
            revision=revision,
            cache_dir=download_dir,
            allow_patterns=ALLOW_PATTERNS,
            ignore_patterns=IGNORE_PATTERNS,
        )
    except GatedRepoError:
        raise ValueError(
            f"model {where} is gated on the Hugging Face Hub: accept its license there and "
            "set HF_TOKEN to a token of that account"
        ) from None
    except RevisionNotFoundError:
        raise ValueError(f"model {repo_id} has no revision {revision!r} on the Hub") from None
    except RepositoryNotFoundError:
        raise ValueError(
            f"model {repo_id!r}: no such folder, and no such repository on the Hugging Face "
            "Hub (or it is private: set HF_TOKEN)"
        ) from None
    except LocalEntryNotFoundError as e:
        raise ValueError(
            f"model {where} is not in the Hugging Face cache "
            f"({download_dir or 'HF_HOME / HF_HUB_CACHE'}) and could not be downloaded "
            f"(offline: HF_HUB_OFFLINE=1, or the Hub is unreachable): {e}"
        ) from None
    except HfHubHTTPError as e:
        raise ValueError(f"model {where}: the Hugging Face Hub answered {e}") from None
    folder = Path(path)
    if not (folder / "config.json").exists():
        raise ValueError(f"model {where} has no config.json (not a transformers checkpoint)")
    log.info("model %s: %s", where, folder)
    return folder
