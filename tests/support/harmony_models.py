"""A tiny tokenizer and checkpoint that speak gpt-oss's chat format ("harmony"), for tests.

`HARMONY_TEMPLATE` is this project's own chat template for the harmony format, written from OpenAI's
description of it (openai/harmony, docs/format.md), in the file beside this one; gpt-oss's own
template cannot be vendored here, so it is not the checkpoint's. `make_harmony_tokenizer` is
tiny_models' byte-level BPE tokenizer with harmony's markup as special tokens, as gpt-oss's tokenizer
has them, and `<|return|>` as its EOS.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Optional

from tests.support.fake_engine import FIXED_OUTPUT_FILE
from tests.support.tiny_models import make_tokenizer

HARMONY_TEMPLATE = (Path(__file__).parent / "harmony_template.jinja").read_text()
HARMONY_TOKENS = ("<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>", "<|call|>")
STOP_TOKENS = ("<|return|>", "<|call|>")
"""The tokens that end gpt-oss's turn (its generation_config.json lists them as EOS)."""


def make_harmony_tokenizer():
    """The tiny tokenizer with harmony's tokens special and the harmony chat template."""
    tokenizer = make_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": list(HARMONY_TOKENS)})
    tokenizer.eos_token = "<|return|>"
    tokenizer.chat_template = HARMONY_TEMPLATE
    return tokenizer


def harmony_checkpoint(model_dir: Path, out: Path, output: Optional[str] = None) -> Path:
    """A copy of the tiny checkpoint `model_dir` in `out` with the harmony tokenizer, `<|return|>`
    and `<|call|>` as its EOS ids and, for fake_engine's FixedOutputEngine, the tokens of `output`
    (harmony text, ending in one of them) as what it says."""
    shutil.copytree(model_dir, out, dirs_exist_ok=True)
    tokenizer = make_harmony_tokenizer()
    tokenizer.save_pretrained(out)
    (out / "chat_template.jinja").write_text(HARMONY_TEMPLATE)
    config = json.loads((out / "config.json").read_text())
    eos = tokenizer.convert_tokens_to_ids(list(STOP_TOKENS))
    (out / "config.json").write_text(json.dumps({**config, "vocab_size": len(tokenizer), "eos_token_id": eos}))
    if output is not None:
        (out / FIXED_OUTPUT_FILE).write_text(json.dumps(tokenizer.encode(output, add_special_tokens=False)))
    return out
