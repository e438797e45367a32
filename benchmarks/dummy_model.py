"""A model directory for benchmarks without weights: a config.json (run the workers with
`--load-format dummy`) and a synthetic tokenizer in which every token id decodes to its
own word, so streamed responses carry one piece of text per generated token (random
weights pick any id; a real tokenizer may decode many of them to nothing).

    python benchmarks/dummy_model.py --config benchmarks/configs/llama3-8b.json \\
        --out /tmp/llama3-8b-dummy
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path


def make_dummy_model(config: str | Path, out: str | Path) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    shutil.copy(config, out / "config.json")
    vocab_size = json.loads(Path(config).read_text())["vocab_size"]
    vocab = {f"w{i}": i for i in range(vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok).save_pretrained(out)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", required=True, help="a model's config.json")
    ap.add_argument("--out", required=True, help="directory to write")
    args = ap.parse_args()
    print(make_dummy_model(args.config, args.out))


if __name__ == "__main__":
    main()
