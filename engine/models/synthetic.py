"""Random-weight checkpoints in Hugging Face format, built locally (tests, benchmarks, the demo).

The tokenizer is a byte-level BPE trained with ``tokenizers`` on the Python standard library's own
sources, so nothing is downloaded. Weights are random (seeded) from transformers' own initialisation;
the result loads in transformers and in kvpilot alike.

    python -m kvpilot.engine.models.synthetic --size 100m --out /tmp/llama-100m
"""

from __future__ import annotations

import argparse
import shutil
import sysconfig
from pathlib import Path

SPECIAL_TOKENS = ["<|begin_of_text|>", "<|end_of_text|>", "<|pad|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# name -> (LlamaConfig fields, tokenizer vocabulary size)
SIZES = {
    # ~0.2M parameters: unit tests.
    "test": (
        dict(
            hidden_size=64,
            intermediate_size=160,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=512,
            initializer_range=0.08,
        ),
        1024,
    ),
    # ~7M parameters.
    "10m": (
        dict(
            hidden_size=256,
            intermediate_size=768,
            num_hidden_layers=4,
            num_attention_heads=8,
            num_key_value_heads=4,
            max_position_embeddings=2048,
        ),
        8192,
    ),
    # ~100M parameters.
    "100m": (
        dict(
            hidden_size=768,
            intermediate_size=2048,
            num_hidden_layers=12,
            num_attention_heads=12,
            num_key_value_heads=4,
            max_position_embeddings=2048,
        ),
        16384,
    ),
    # ~1.2B parameters (GPU benchmarks).
    "1b": (
        dict(
            hidden_size=2048,
            intermediate_size=8192,
            num_hidden_layers=16,
            num_attention_heads=32,
            num_key_value_heads=8,
            max_position_embeddings=4096,
        ),
        32000,
    ),
}


def _corpus(max_bytes: int) -> list[str]:
    root = Path(sysconfig.get_paths()["stdlib"])
    texts, total = [], 0
    for path in sorted(root.rglob("*.py")):
        if "test" in path.parts or "site-packages" in path.parts:
            continue
        text = path.read_text(encoding="utf-8", errors="replace")
        texts.append(text)
        total += len(text)
        if total >= max_bytes:
            break
    return texts


def train_byte_level_bpe(corpus, vocab_size: int, special_tokens: list[str]):
    """A GPT-2-style ``tokenizers.Tokenizer`` (byte-level pre-tokenizer and decoder) trained on the
    texts of ``corpus``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=special_tokens,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer=trainer)
    return tok


def train_sentencepiece_bpe(corpus, vocab_size: int, special_tokens: list[str], limit_alphabet: int):
    """A Llama-2-style ``tokenizers.Tokenizer`` trained on ``corpus``: Metaspace with a leading-space
    scheme, a BPE with byte fallback (``<0xE2>`` tokens for the characters outside its
    ``limit_alphabet`` most frequent ones), decoded by Replace, ByteFallback, Fuse and Strip (which
    drops the first space). The byte tokens are ordinary vocabulary entries, as in a converted
    SentencePiece model; only ``special_tokens`` stay added tokens."""
    import json

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>", fuse_unk=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first")
    tok.decoder = decoders.Sequence(
        [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=special_tokens + byte_tokens,
        limit_alphabet=limit_alphabet,
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer=trainer)
    spec = json.loads(tok.to_str())
    spec["added_tokens"] = [t for t in spec["added_tokens"] if t["content"] in special_tokens]
    return Tokenizer.from_str(json.dumps(spec))


def build_tokenizer(out_dir: Path, vocab_size: int) -> None:
    """Train and save a byte-level BPE tokenizer (with a ChatML-style chat template)."""
    from transformers import PreTrainedTokenizerFast

    tok = train_byte_level_bpe(_corpus(max(1_500_000, vocab_size * 400)), vocab_size, SPECIAL_TOKENS)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=SPECIAL_TOKENS[0],
        eos_token=SPECIAL_TOKENS[1],
        pad_token=SPECIAL_TOKENS[2],
        additional_special_tokens=SPECIAL_TOKENS[3:],
    )
    fast.chat_template = CHAT_TEMPLATE
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(out_dir)


def build_checkpoint(
    out_dir: Path,
    tokenizer_dir: Path | None = None,
    size: str = "test",
    arch: str = "llama",
    seed: int = 0,
    dtype: str = "float32",
    max_shard_size: str | None = None,
    **overrides,
) -> Path:
    """Write a random-weight ``arch`` (llama | mistral | qwen2 | qwen3) checkpoint of ``size`` into
    ``out_dir``, with the tokenizer from ``tokenizer_dir`` (trained when None). ``overrides`` are config
    fields. Returns ``out_dir``."""
    import torch
    import transformers

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    fields, vocab = SIZES[size]
    if tokenizer_dir is None:
        build_tokenizer(out_dir, vocab)
    else:
        for path in Path(tokenizer_dir).iterdir():
            if path.is_file():
                shutil.copy(path, out_dir / path.name)
    tok = transformers.AutoTokenizer.from_pretrained(out_dir)
    kwargs = dict(rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False, **fields)
    kwargs.update(
        vocab_size=len(tok),
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
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
        kwargs["head_dim"] = kwargs["hidden_size"] // kwargs["num_attention_heads"]
    kwargs.update(overrides)
    config = config_cls(**kwargs)
    torch.manual_seed(seed)
    model = model_cls(config).to(getattr(torch, dtype))
    save_kwargs = {}
    if max_shard_size:
        save_kwargs["max_shard_size"] = max_shard_size
    model.save_pretrained(out_dir, **save_kwargs)
    return out_dir


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Build a random-weight Llama-family checkpoint locally.")
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--size", choices=sorted(SIZES), default="100m")
    ap.add_argument("--arch", choices=["llama", "mistral", "qwen2", "qwen3"], default="llama")
    ap.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="bfloat16")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    build_checkpoint(args.out, size=args.size, arch=args.arch, dtype=args.dtype, seed=args.seed)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
