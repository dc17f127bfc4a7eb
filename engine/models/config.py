"""The model's shape, read from a Hugging Face ``config.json`` (torch-free)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

from kvpilot.engine.errors import UnsupportedModelError

# Architectures this engine implements, and what distinguishes them from plain Llama.
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": {},
    "MistralForCausalLM": {},
    "Qwen2ForCausalLM": {"qkv_bias": True},
    "Qwen3ForCausalLM": {"qk_norm": True},
}
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass
class ModelConfig:
    """Everything the model code needs to know about a checkpoint's architecture."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    tie_word_embeddings: bool
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    sliding_window: int | None = None
    torch_dtype: str | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    bos_token_id: int | None = None

    @property
    def rope_type(self) -> str:
        if not self.rope_scaling:
            return "default"
        return self.rope_scaling.get("rope_type", self.rope_scaling.get("type", "default"))

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        """Parse a ``config.json`` dict; raise ``UnsupportedModelError`` naming what is unsupported."""
        archs = raw.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            named = ", ".join(archs) if archs else f"model_type={raw.get('model_type')!r}"
            raise UnsupportedModelError(
                f"unsupported model architecture {named}; kvpilot supports "
                f"{', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        features = SUPPORTED_ARCHITECTURES[arch]
        act = raw.get("hidden_act", "silu")
        if act != "silu":
            raise UnsupportedModelError(f"{arch} with hidden_act={act!r} is not supported (only silu)")
        num_heads = raw["num_attention_heads"]
        hidden = raw["hidden_size"]
        # transformers v5 nests rope settings under rope_parameters; v4 used rope_theta + rope_scaling.
        rope_params = raw.get("rope_parameters") or {}
        rope_scaling = raw.get("rope_scaling") or None
        if rope_params and rope_scaling is None:
            rope_type = rope_params.get("rope_type", rope_params.get("type", "default"))
            rope_scaling = None if rope_type == "default" else dict(rope_params)
        rope_theta = raw.get("rope_theta", rope_params.get("rope_theta", 10000.0))
        eos = raw.get("eos_token_id")
        eos_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        sliding = raw.get("sliding_window")
        if arch.startswith("Qwen") and not raw.get("use_sliding_window", False):
            sliding = None
        cfg = cls(
            architecture=arch,
            vocab_size=raw["vocab_size"],
            hidden_size=hidden,
            intermediate_size=raw["intermediate_size"],
            num_hidden_layers=raw["num_hidden_layers"],
            num_attention_heads=num_heads,
            num_key_value_heads=raw.get("num_key_value_heads") or num_heads,
            head_dim=raw.get("head_dim") or hidden // num_heads,
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            max_position_embeddings=raw.get("max_position_embeddings", 2048),
            rope_theta=float(rope_theta),
            rope_scaling=rope_scaling,
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            # Qwen2 always has q/k/v biases and none on o_proj; elsewhere attention_bias covers all four.
            qkv_bias=bool(features.get("qkv_bias", raw.get("attention_bias", False))),
            o_bias=False if features.get("qkv_bias") else bool(raw.get("attention_bias", False)),
            mlp_bias=bool(raw.get("mlp_bias", False)),
            qk_norm=features.get("qk_norm", False),
            sliding_window=sliding,
            torch_dtype=raw.get("torch_dtype") or raw.get("dtype"),
            eos_token_ids=eos_ids,
            bos_token_id=raw.get("bos_token_id"),
        )
        if cfg.rope_type not in SUPPORTED_ROPE_TYPES:
            raise UnsupportedModelError(
                f"rope scaling type {cfg.rope_type!r} is not supported; supported: "
                f"{', '.join(SUPPORTED_ROPE_TYPES)}"
            )
        if cfg.num_attention_heads % cfg.num_key_value_heads:
            raise UnsupportedModelError(
                f"num_attention_heads ({num_heads}) is not a multiple of num_key_value_heads "
                f"({cfg.num_key_value_heads})"
            )
        return cfg

    @classmethod
    def from_pretrained(cls, model_dir: str) -> ModelConfig:
        path = os.path.join(model_dir, "config.json")
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{model_dir} has no config.json: not a Hugging Face model directory")
        with open(path, encoding="utf-8") as fh:
            return cls.from_dict(json.load(fh))
