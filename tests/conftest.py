"""Shared fixtures: tiny random-weight checkpoints in Hugging Face format, built locally once per session."""

from __future__ import annotations

import json
import os
import sysconfig
from pathlib import Path

import pytest

SPECIAL_TOKENS = ["<|begin_of_text|>", "<|end_of_text|>", "<|pad|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

TINY_LLAMA = dict(
    hidden_size=64,
    intermediate_size=160,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    initializer_range=0.08,
)


def _corpus(max_bytes: int = 1_500_000) -> list[str]:
    root = Path(sysconfig.get_paths()["stdlib"])
    texts, total = [], 0
    for path in sorted(root.glob("*.py")):
        text = path.read_text(encoding="utf-8", errors="replace")
        texts.append(text)
        total += len(text)
        if total >= max_bytes:
            break
    return texts


def build_tokenizer(out_dir: Path, vocab_size: int = 1024) -> None:
    """A byte-level BPE tokenizer trained on the standard library's sources, saved for transformers."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=SPECIAL_TOKENS[0],
        eos_token=SPECIAL_TOKENS[1],
        pad_token=SPECIAL_TOKENS[2],
        additional_special_tokens=SPECIAL_TOKENS[3:],
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out_dir)


def build_checkpoint(
    out_dir: Path,
    tokenizer_dir: Path,
    arch: str = "llama",
    seed: int = 0,
    max_shard_size: str | None = None,
    **overrides,
) -> Path:
    """Random-init a transformers model of ``arch`` (llama | mistral | qwen2 | qwen3) and save it with
    safetensors, sharded when ``max_shard_size`` is given; copy the tokenizer beside it."""
    import shutil

    import torch
    import transformers

    out_dir.mkdir(parents=True, exist_ok=True)
    for name in os.listdir(tokenizer_dir):
        shutil.copy(tokenizer_dir / name, out_dir / name)
    tok = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
    kwargs = dict(TINY_LLAMA)
    kwargs.update(
        vocab_size=len(tok), bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id, tie_word_embeddings=False,
    )
    classes = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
    }
    config_cls, model_cls = classes[arch]
    if arch == "mistral":
        kwargs["sliding_window"] = None
    if arch == "qwen3":
        kwargs["head_dim"] = 16
    kwargs.update(overrides)
    config = config_cls(**kwargs)
    torch.manual_seed(seed)
    model = model_cls(config).to(torch.float32)
    save_kwargs = {"safe_serialization": True}
    if max_shard_size:
        save_kwargs["max_shard_size"] = max_shard_size
    model.save_pretrained(out_dir, **save_kwargs)
    return out_dir


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tokenizer")
    build_tokenizer(out)
    return out


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory, tokenizer_dir) -> Path:
    """The session's tiny Llama checkpoint (float32, random weights)."""
    return build_checkpoint(tmp_path_factory.mktemp("tiny-llama"), tokenizer_dir)


def read_config(model_dir: Path) -> dict:
    return json.loads((model_dir / "config.json").read_text())
