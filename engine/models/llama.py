"""Llama-family decoder (Llama, Mistral, Qwen2, Qwen3) over a flattened, paged batch, for one rank.

There is no batch dimension: ``input_ids`` and ``positions`` are ``[num_tokens]`` for all requests of
the step together (prefill chunks and decodes mixed); attention finds each request's context through
the ``AttentionMetadata`` block tables. Numerics follow Hugging Face transformers' implementation
(RMSNorm in float32, rotary tables in float32 cast to the activation dtype) so that greedy outputs
match it token for token. On the ``cpu`` backend in bfloat16 and float32 the residual add + RMSNorm,
the rotary embedding and SiLU x up run as the backend's fused ops (``kvpilot.kernels.cpu_ops.FusedOps``),
which keep those roundings. A layer returns its MLP output and the residual stream separately, so that their
add can fuse with the next norm.

One model for every parallel size: a rank holds its ``RankShard`` of the model, with the tensor-parallel
layers of ``kvpilot.engine.models.layers`` (the identity at size 1) and only its pipeline stage's layers.
The first stage embeds, later stages receive their input activations from the previous one; the last
stage normalises and holds the LM head, the others send their output on. Parameter names are the
checkpoint's without its ``model.`` prefix (``layers.3.mlp.down_proj.weight``), except for the fused
``qkv_proj`` and ``gate_up_proj``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from kvpilot.engine.models.config import ModelConfig
from kvpilot.engine.models.layers import (
    Comm,
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RowParallelLinear,
    SingleRankComm,
    VocabParallelEmbedding,
)
from kvpilot.engine.parallel.layout import ParallelLayout, RankShard
from kvpilot.kernels.backend import AttentionBackend
from kvpilot.kernels.metadata import AttentionMetadata


def fused_for(backend: AttentionBackend, dtype: torch.dtype):
    """The backend's fused decoder-layer ops when they take ``dtype``, else None (torch ops)."""
    fused = backend.fused
    return fused if fused is not None and dtype in fused.DTYPES else None


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32, cast back, then scale: transformers' order of operations.
        h = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        return self.weight * h.to(x.dtype)

    def add_forward(
        self, x: torch.Tensor, residual: torch.Tensor, fused
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(self(residual + x), residual + x)``; with ``fused`` ops the sum is written into
        ``residual`` in place and both happen in one pass."""
        if fused is not None:
            return fused.add_rms_norm_(x, residual, self.weight, self.eps), residual
        residual = residual + x
        return self(residual), residual


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
        # index_select: advanced indexing (tensor[positions]) is several times slower on CPU.
        cos, sin = self.cos.index_select(0, positions), self.sin.index_select(0, positions)
        return cos.to(dtype).unsqueeze(1), sin.to(dtype).unsqueeze(1)

    @staticmethod
    def apply(
        cos_sin: tuple[torch.Tensor, torch.Tensor], q: torch.Tensor, k: torch.Tensor, fused=None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotated ``q`` and ``k``; with ``fused`` ops they are rotated in place (same values)."""
        cos, sin = cos_sin
        if fused is not None:
            fused.rotary_(q, k, cos.squeeze(1), sin.squeeze(1))
            return q, k
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Attention(nn.Module):
    """This rank's attention heads (and KV heads) of one layer."""

    def __init__(self, cfg: ModelConfig, shard: RankShard, comm: Comm, backend: AttentionBackend) -> None:
        super().__init__()
        self.num_heads = shard.num_heads
        self.num_kv_heads = shard.num_kv_heads
        self.head_dim = d = cfg.head_dim
        self.q_size = self.num_heads * d
        self.kv_size = self.num_kv_heads * d
        self.scale = d**-0.5
        # q, k and v projections fused into one matmul; the loader fills the row ranges.
        self.qkv_proj = QKVParallelLinear(
            cfg.hidden_size,
            d,
            shard.q_head_start,
            shard.num_heads,
            shard.kv_head_start,
            shard.num_kv_heads,
            cfg.qkv_bias,
        )
        self.o_proj = RowParallelLinear(
            self.q_size, cfg.hidden_size, cfg.o_bias, shard.q_head_start * d, comm
        )
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps) if cfg.qk_norm else None
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
        q, k = RotaryEmbedding.apply(cos_sin, q, k, fused_for(self.backend, q.dtype))
        k_cache, v_cache = kv_cache
        self.backend.write_kv_cache(k, v, k_cache, v_cache, meta.slot_mapping)
        out = self.backend.paged_attention(q, k_cache, v_cache, meta, self.scale)
        return self.o_proj(out.reshape(num_tokens, self.q_size))


class MLP(nn.Module):
    """This rank's slice of the intermediate dimension of one layer."""

    def __init__(self, cfg: ModelConfig, shard: RankShard, comm: Comm, backend: AttentionBackend) -> None:
        super().__init__()
        self.backend = backend
        self.intermediate_size = inter = shard.intermediate_size
        start = shard.intermediate_start
        # gate and up projections fused into one matmul.
        self.gate_up_proj = MergedColumnParallelLinear(cfg.hidden_size, 2, inter, start, cfg.mlp_bias)
        self.down_proj = RowParallelLinear(inter, cfg.hidden_size, cfg.mlp_bias, start, comm)

    # Rows per pass of a long CPU prefill through the packed matmuls: the [rows, 2 * intermediate]
    # activation then stays in cache (a 4096-token MLP measured 1.6x faster in passes of 1024 rows).
    CPU_PASS_ROWS = 1024

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = self.CPU_PASS_ROWS
        if x.shape[0] > rows and self.gate_up_proj.packed_weight is not None:
            return torch.cat([self._forward(x[i : i + rows]) for i in range(0, x.shape[0], rows)])
        return self._forward(x)

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        fused = fused_for(self.backend, gate_up.dtype)
        if fused is not None:
            return self.down_proj(fused.silu_and_mul(gate_up))
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, shard: RankShard, comm: Comm, backend: AttentionBackend) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, shard, comm, backend)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg, shard, comm, backend)
        self.backend = backend

    def forward(self, x, residual, cos_sin, kv_cache, meta):
        """``(mlp_out, residual)``: the layer's output hidden states are ``residual + mlp_out``, an add
        left to the next norm (fused with it where the backend has fused ops). ``residual`` None: ``x``
        is the layer's input; otherwise its input is ``residual + x``."""
        fused = fused_for(self.backend, x.dtype)
        if residual is None:
            residual = x
            h = self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm.add_forward(x, residual, fused)
        a = self.self_attn(h, cos_sin, kv_cache, meta)
        h, residual = self.post_attention_layernorm.add_forward(a, residual, fused)
        return self.mlp(h), residual


class HeldByOtherStage(nn.Module):
    """Stands where a module of another pipeline stage would be (it keeps the global layer indices, and
    the loader skips the checkpoint tensors below it)."""

    def forward(self, *args, **kwargs):
        raise RuntimeError("this module is held by another pipeline stage")


class LlamaForCausalLM(nn.Module):
    """One rank's share of the model (all of it at size 1): ``config`` is the whole model's config,
    ``shard`` what this rank holds (default: everything), ``comm`` its collectives (default: none).

    The stage holds ``layers[layer_start:layer_end]``; the other layers, and the embedding, norm and
    head where another stage holds them, are ``HeldByOtherStage`` placeholders. ``lm_head`` is None
    where the tied embedding table serves as the head (a last stage that also embeds); a last stage
    that does not embed holds its own copy of the tied table.
    """

    def __init__(
        self,
        cfg: ModelConfig,
        backend: AttentionBackend,
        max_positions: int,
        shard: RankShard | None = None,
        comm: Comm | None = None,
    ) -> None:
        super().__init__()
        self.config = cfg
        self.backend = backend
        self.shard = shard = ParallelLayout(1, 1, cfg).shard(0) if shard is None else shard
        self.comm = comm = SingleRankComm() if comm is None else comm
        hidden = cfg.hidden_size
        vocab = (shard.num_vocab_rows, hidden, shard.vocab_start, cfg.vocab_size, comm)
        self.embed_tokens = VocabParallelEmbedding(*vocab) if shard.is_first_stage else HeldByOtherStage()
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, shard, comm, backend)
            if shard.layer_start <= i < shard.layer_end
            else HeldByOtherStage()
            for i in range(cfg.num_hidden_layers)
        )
        # A plain list (not registered twice): the layers this stage runs, in order.
        self.stage_layers = list(self.layers)[shard.layer_start : shard.layer_end]
        self.norm = RMSNorm(hidden, cfg.rms_norm_eps) if shard.is_last_stage else HeldByOtherStage()
        self.rotary = RotaryEmbedding(cfg, max_positions)
        if not shard.is_last_stage:
            self.lm_head = HeldByOtherStage()
        elif cfg.tie_word_embeddings and shard.is_first_stage:
            self.lm_head = None
        else:
            self.lm_head = ParallelLMHead(*vocab)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """The normalised final hidden states on the last stage; elsewhere this stage's output, already
        sent to the next stage."""
        if self.shard.is_first_stage:
            x = self.embed_tokens(input_ids)
        else:
            dtype = self.stage_layers[0].input_layernorm.weight.dtype
            x = self.comm.recv_from_prev_stage((input_ids.shape[0], self.config.hidden_size), dtype)
        cos_sin = self.rotary.tables(positions, x.dtype)
        residual = None
        for layer, kv_cache in zip(self.stage_layers, kv_caches, strict=True):
            x, residual = layer(x, residual, cos_sin, kv_cache, meta)
        if not self.shard.is_last_stage:
            x = x if residual is None else residual + x
            self.comm.send_to_next_stage(x)
            return x
        if residual is None:
            return self.norm(x)
        return self.norm.add_forward(x, residual, fused_for(self.backend, x.dtype))[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """[n, hidden] -> float32 logits [n, vocab] on the sampling rank, None on every other rank
        (tensor-parallel ranks of the last stage still take part in the gather)."""
        if not self.shard.is_last_stage:
            return None
        head = self.embed_tokens if self.lm_head is None else self.lm_head
        return head.logits(hidden)
