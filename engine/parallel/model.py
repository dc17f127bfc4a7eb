"""The Llama-family model of one rank: Megatron tensor parallelism within a pipeline stage.

The layers are ``kvpilot.engine.models.llama``'s own, built from a *rank-local* config (this rank's
heads, KV heads, intermediate size and layer count), so the fused ``qkv_proj`` and ``gate_up_proj`` are
column-parallel as they stand. What changes:

* ``o_proj`` and ``down_proj`` are ``RowParallelLinear``: partial products summed by an all-reduce
  (their bias is loaded on tensor-parallel rank 0 only, so it is added once);
* the embedding and the LM head hold a vocabulary shard; embedding lookups outside the shard are zero
  and summed by an all-reduce, logits are gathered on tensor-parallel rank 0 (the sampling rank);
* a stage other than the first receives its input activations from the previous stage, and a stage
  other than the last sends its output to the next one instead of normalising it.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from kvpilot.engine.models.config import ModelConfig
from kvpilot.engine.models.llama import LlamaForCausalLM
from kvpilot.engine.parallel.comm import ParallelComm
from kvpilot.engine.parallel.layout import RankShard
from kvpilot.kernels import AttentionBackend, AttentionMetadata


def local_config(cfg: ModelConfig, shard: RankShard) -> ModelConfig:
    """``cfg`` as one rank sees it: its heads, KV heads, intermediate size and number of layers."""
    return dataclasses.replace(
        cfg,
        num_attention_heads=shard.num_heads,
        num_key_value_heads=shard.num_kv_heads,
        intermediate_size=shard.intermediate_size,
        num_hidden_layers=shard.num_layers,
    )


class RowParallelLinear(nn.Linear):
    """A linear layer over this rank's slice of the input features; the output is all-reduced."""

    def __init__(self, in_features: int, out_features: int, bias: bool, comm: ParallelComm) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.comm = comm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.comm.tp_all_reduce(super().forward(x))


class VocabParallelEmbedding(nn.Module):
    """Rows ``[vocab_start, vocab_start + num_rows)`` of the embedding table (padded past the vocabulary);
    ``weight``: [num_rows, hidden]."""

    def __init__(self, num_rows: int, hidden_size: int, vocab_start: int, comm: ParallelComm) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_rows, hidden_size))
        self.vocab_start = vocab_start
        self.comm = comm

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.comm.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.weight.shape[0])
        x = F.embedding(local.masked_fill(outside, 0), self.weight)
        return self.comm.tp_all_reduce(x.masked_fill(outside[:, None], 0))


class ParallelLlamaForCausalLM(LlamaForCausalLM):
    """One rank's shard of a Llama-family model (see the module doc). ``config`` is the rank-local
    config, ``full_config`` the model's.

    ``forward`` returns the final hidden states on the last stage and this stage's output (already
    sent on) elsewhere; ``compute_logits`` returns float32 logits [n, vocab] on the sampling rank and
    None on every other rank (tensor-parallel ranks of the last stage still take part in the gather).
    """

    def __init__(
        self,
        cfg: ModelConfig,
        backend: AttentionBackend,
        max_positions: int,
        shard: RankShard,
        comm: ParallelComm,
    ) -> None:
        super().__init__(local_config(cfg, shard), backend, max_positions)
        self.full_config = cfg
        self.shard = shard
        self.comm = comm
        hidden = cfg.hidden_size
        self.embed_tokens = (
            VocabParallelEmbedding(shard.num_vocab_rows, hidden, shard.vocab_start, comm)
            if shard.is_first_stage
            else None
        )
        # The last stage always has its own head (a tied one is loaded from the embedding weights).
        self.lm_head = nn.Linear(hidden, shard.num_vocab_rows, bias=False) if shard.is_last_stage else None
        if not shard.is_last_stage:
            self.norm = None
        for layer in self.layers:
            attn, mlp = layer.self_attn, layer.mlp
            attn.o_proj = RowParallelLinear(attn.q_size, hidden, cfg.o_bias, comm)
            mlp.down_proj = RowParallelLinear(mlp.intermediate_size, hidden, cfg.mlp_bias, comm)

    @property
    def lm_head_weight(self) -> torch.Tensor:
        if self.lm_head is None:
            raise RuntimeError("only the last pipeline stage holds the LM head")
        return self.lm_head.weight

    @property
    def dtype(self) -> torch.dtype:
        return self.layers[0].input_layernorm.weight.dtype

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        if self.embed_tokens is not None:
            x = self.embed_tokens(input_ids)
        else:
            x = self.comm.recv_from_prev_stage((input_ids.shape[0], self.full_config.hidden_size), self.dtype)
        cos_sin = self.rotary.tables(positions, x.dtype)
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            x = layer(x, cos_sin, kv_cache, meta)
        if self.norm is None:
            self.comm.send_to_next_stage(x)
            return x
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """[n, hidden] -> float32 logits [n, vocab] on the sampling rank, None elsewhere."""
        if self.lm_head is None:
            return None
        logits = self.comm.tp_gather_last_dim(F.linear(hidden, self.lm_head.weight))
        if logits is None:
            return None
        return logits[:, : self.full_config.vocab_size].float()
