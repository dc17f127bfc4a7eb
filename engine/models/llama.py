"""Llama-family decoder (Llama, Mistral, Qwen2, Qwen3) over a flattened, paged batch.

There is no batch dimension: ``input_ids`` and ``positions`` are ``[num_tokens]`` for all requests of
the step together (prefill chunks and decodes mixed); attention finds each request's context through
the ``AttentionMetadata`` block tables. Numerics follow Hugging Face transformers' implementation
(RMSNorm in float32, rotary tables in float32 cast to the activation dtype) so that greedy outputs
match it token for token.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from kvpilot.engine.models.config import ModelConfig
from kvpilot.kernels import AttentionBackend, AttentionMetadata


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32, cast back, then scale: transformers' order of operations.
        h = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        return self.weight * h.to(x.dtype)


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """Rotary inverse frequencies [head_dim // 2], with ``linear`` or ``llama3`` scaling applied."""
    dim = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = cfg.rope_scaling or {}
    if cfg.rope_type == "linear":
        inv_freq = inv_freq / float(scaling["factor"])
    elif cfg.rope_type == "llama3":
        factor = float(scaling["factor"])
        low_freq_factor = float(scaling.get("low_freq_factor", 1.0))
        high_freq_factor = float(scaling.get("high_freq_factor", 4.0))
        old_ctx = float(scaling.get("original_max_position_embeddings", 8192))
        low_freq_wavelen = old_ctx / low_freq_factor
        high_freq_wavelen = old_ctx / high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_ctx / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
        inv_freq = torch.where(is_medium, smoothed, scaled)
    return inv_freq


class RotaryEmbedding(nn.Module):
    """Neox-style rotary embedding from a float32 cos/sin table indexed by position."""

    def __init__(self, cfg: ModelConfig, max_positions: int) -> None:
        super().__init__()
        inv_freq = rope_inv_freq(cfg)
        t = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin rows for ``positions``, as ``[T, 1, D]`` in ``dtype`` (computed once per step)."""
        return self.cos[positions].to(dtype).unsqueeze(1), self.sin[positions].to(dtype).unsqueeze(1)

    @staticmethod
    def apply(
        cos_sin: tuple[torch.Tensor, torch.Tensor], q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = cos_sin
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, backend: AttentionBackend) -> None:
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim**-0.5
        # q, k and v projections fused into one matmul; the loader fills the row ranges.
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=cfg.o_bias)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.backend = backend

    def forward(
        self,
        x: torch.Tensor,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        num_tokens = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = RotaryEmbedding.apply(cos_sin, q, k)
        k_cache, v_cache = kv_cache
        self.backend.write_kv_cache(k, v, k_cache, v_cache, meta.slot_mapping)
        out = self.backend.paged_attention(q, k_cache, v_cache, meta, self.scale)
        return self.o_proj(out.reshape(num_tokens, self.q_size))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.intermediate_size = cfg.intermediate_size
        # gate and up projections fused into one matmul.
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, backend: AttentionBackend) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, backend)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, cos_sin, kv_cache, meta):
        x = x + self.self_attn(self.input_layernorm(x), cos_sin, kv_cache, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaForCausalLM(nn.Module):
    """The decoder stack plus LM head. ``forward`` returns final hidden states; ``compute_logits``
    projects the rows that need sampling."""

    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, max_positions: int) -> None:
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList([DecoderLayer(cfg, backend) for _ in range(cfg.num_hidden_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = RotaryEmbedding(cfg, max_positions)
        if cfg.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        cos_sin = self.rotary.tables(positions, x.dtype)
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            x = layer(x, cos_sin, kv_cache, meta)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[n, hidden] -> float32 logits [n, vocab]."""
        return F.linear(hidden, self.lm_head_weight).float()
