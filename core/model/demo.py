"""The built-in demo model: a small random-weight Mixtral checkpoint (transformers' own class and `save_pretrained`:
a real checkpoint for the real loader) and a byte-level BPE tokenizer trained on the bundled MT-Bench questions,
built deterministically on first use into the user cache. No network; its outputs are gibberish.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

from core import platform
from core.assets import MT_BENCH
from core.telemetry import EventSink, Progress, ignore

DEMO_VERSION = "v1"
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
SPECIALS = ["<unk>", "<s>", "</s>", "<pad>", "<|user|>", "<|assistant|>", "<|system|>"]


cache_dir = platform.cache_dir  # one cache folder for everything mlight keeps, on Windows too


def training_text() -> list[str]:
    lines = []
    with open(MT_BENCH, encoding="utf-8") as f:
        for line in f:
            q = json.loads(line)
            lines += q["turns"] + [r for r in q.get("reference", []) if isinstance(r, str)]
    return lines


def build_tokenizer(out_dir: str | Path, vocab_size: int = 512) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(training_text(), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                   pad_token="<pad>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(out_dir))


def build_demo_model(out_dir: str | Path) -> None:
    import torch
    from transformers import MixtralConfig, MixtralForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # core never prints; the caller shows Progress events

    build_tokenizer(out_dir, vocab_size=512)
    cfg = MixtralConfig(
        vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=8,
        num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2, max_position_embeddings=2048,
        bos_token_id=1, eos_token_id=2, pad_token_id=3, initializer_range=0.1, tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    MixtralForCausalLM(cfg).to(torch.float32).eval().save_pretrained(str(out_dir))


def demo_model_dir(progress: EventSink = ignore) -> Path:
    """Path of the demo checkpoint, building it on first use (a second or two)."""
    target = cache_dir() / f"demo-mixtral-{DEMO_VERSION}"
    if (target / "config.json").is_file() and (target / "tokenizer.json").is_file():
        return target
    progress(Progress("building the demo model", 0, 1))
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".demo-", dir=target.parent))
    try:
        build_demo_model(tmp)
        try:
            platform.replace(tmp, target)  # waits out a virus scanner holding a new file (Windows)
        except OSError:  # another process finished first; theirs is identical
            if not (target / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    progress(Progress("building the demo model", 1, 1))
    return target
