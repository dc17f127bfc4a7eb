"""How a model is split over tensor-parallel ranks and pipeline stages (torch-free).

Global rank ``r = pp_rank * tensor_parallel_size + tp_rank``; rank 0 is the driver (the engine's own
process), the others are workers. Within a stage the Megatron split is::

    attention heads   rank t holds q heads [t*H/T, (t+1)*H/T)
    KV heads          K % T == 0: [t*K/T, (t+1)*K/T);   T % K == 0: the one head t // (T/K) (replicated)
    gate/up, down     rows / columns [t*I/T, (t+1)*I/T) of the intermediate dimension
    embedding, head   vocabulary rows [t*ceil(V/T), (t+1)*ceil(V/T)) (the last rank's shard is padded)

Stages hold contiguous layer ranges (earlier stages take the remainder); the first stage embeds, the
last one normalises, computes logits and samples (on its tensor-parallel rank 0).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvpilot.engine.errors import ConfigError
from kvpilot.engine.models.config import ModelConfig


def allowed_tensor_parallel_sizes(
    num_attention_heads: int, num_key_value_heads: int, intermediate_size: int
) -> list[int]:
    """The one rule for tensor-parallel sizes, shared by the engine and the operator (torch-free): the
    sizes that split a model evenly divide the attention heads and the intermediate size, and divide the
    KV heads or are a multiple of them (KV heads are then replicated). Ascending, 1 first."""
    heads, kv_heads = num_attention_heads, num_key_value_heads
    return [
        t
        for t in range(1, heads + 1)
        if heads % t == 0 and intermediate_size % t == 0 and (kv_heads % t == 0 or t % kv_heads == 0)
    ]


def validate_parallel_sizes(
    cfg: ModelConfig,
    tensor_parallel_size: int,
    pipeline_parallel_size: int,
    device_type: str,
    num_devices: int,
) -> ParallelLayout:
    """The layout of ``tensor_parallel_size x pipeline_parallel_size`` ranks for this model.

    Raises ``ConfigError`` naming the allowed values when the sizes do not fit the model, or (on CUDA)
    when there are fewer visible devices than ranks.
    """
    tp, pp = tensor_parallel_size, pipeline_parallel_size
    allowed = allowed_tensor_parallel_sizes(
        cfg.num_attention_heads, cfg.num_key_value_heads, cfg.intermediate_size
    )
    if tp not in allowed:
        raise ConfigError(
            f"tensor_parallel_size {tp} does not split this model ({cfg.num_attention_heads} attention "
            f"heads, {cfg.num_key_value_heads} KV heads, intermediate size {cfg.intermediate_size}): it "
            "must divide the attention heads and the intermediate size, and divide the KV heads or be a "
            f"multiple of them. Allowed for this model: {', '.join(map(str, allowed))}"
        )
    if pp > cfg.num_hidden_layers:
        raise ConfigError(
            f"pipeline_parallel_size {pp} exceeds the model's {cfg.num_hidden_layers} layers "
            f"(each stage needs at least one). Allowed for this model: 1 to {cfg.num_hidden_layers}"
        )
    if device_type == "cuda" and tp * pp > num_devices:
        raise ConfigError(
            f"tensor_parallel_size x pipeline_parallel_size = {tp} x {pp} = {tp * pp} ranks need one CUDA "
            f"device each, but {num_devices} are visible; choose sizes whose product is at most "
            f"{num_devices} (or make more devices visible)"
        )
    return ParallelLayout(tp, pp, cfg)


@dataclass(frozen=True)
class RankShard:
    """What one rank holds."""

    rank: int
    tp_rank: int
    pp_rank: int
    layer_start: int  # global index of the first layer held
    layer_end: int  # exclusive
    q_head_start: int
    num_heads: int
    kv_head_start: int
    num_kv_heads: int
    intermediate_start: int
    intermediate_size: int
    vocab_start: int  # first vocabulary row held (first and last stage only)
    num_vocab_rows: int  # rows of the (padded) vocabulary shard; vocab_start + rows may exceed vocab
    is_first_stage: bool
    is_last_stage: bool
    is_sampler: bool  # the one rank that computes full logits and samples

    @property
    def num_layers(self) -> int:
        return self.layer_end - self.layer_start


@dataclass(frozen=True)
class ParallelLayout:
    """``tensor_parallel_size x pipeline_parallel_size`` ranks over one model (see the module doc)."""

    tensor_parallel_size: int
    pipeline_parallel_size: int
    model_config: ModelConfig

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def is_parallel(self) -> bool:
        return self.world_size > 1

    @property
    def sampler_rank(self) -> int:
        """The rank that samples: tensor-parallel rank 0 of the last stage."""
        return (self.pipeline_parallel_size - 1) * self.tensor_parallel_size

    def stage_layers(self, pp_rank: int) -> tuple[int, int]:
        """Global layer range ``[start, end)`` of stage ``pp_rank``."""
        num_layers, pp = self.model_config.num_hidden_layers, self.pipeline_parallel_size
        base, extra = divmod(num_layers, pp)
        start = pp_rank * base + min(pp_rank, extra)
        return start, start + base + (1 if pp_rank < extra else 0)

    def shard(self, rank: int) -> RankShard:
        """What global ``rank`` holds; raises ``ValueError`` for a rank outside the layout."""
        cfg, tp, pp = self.model_config, self.tensor_parallel_size, self.pipeline_parallel_size
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside the {self.world_size} ranks of this layout")
        pp_rank, tp_rank = divmod(rank, tp)
        heads, kv_heads = cfg.num_attention_heads // tp, cfg.num_key_value_heads
        if kv_heads >= tp:
            kv_heads //= tp
            kv_start = tp_rank * kv_heads
        else:
            kv_start = tp_rank // (tp // kv_heads)
            kv_heads = 1
        inter = cfg.intermediate_size // tp
        vocab_rows = -(-cfg.vocab_size // tp)
        start, end = self.stage_layers(pp_rank)
        return RankShard(
            rank=rank,
            tp_rank=tp_rank,
            pp_rank=pp_rank,
            layer_start=start,
            layer_end=end,
            q_head_start=tp_rank * heads,
            num_heads=heads,
            kv_head_start=kv_start,
            num_kv_heads=kv_heads,
            intermediate_start=tp_rank * inter,
            intermediate_size=inter,
            vocab_start=tp_rank * vocab_rows,
            num_vocab_rows=vocab_rows,
            is_first_stage=pp_rank == 0,
            is_last_stage=pp_rank == pp - 1,
            is_sampler=rank == self.sampler_rank,
        )

    def describe(self, rank: int) -> str:
        """One start-up line: what ``rank`` holds, e.g. ``rank 1 (tp 1, stage 0): layers 0-11, ...``."""
        s = self.shard(rank)
        cfg = self.model_config
        parts = [
            f"layers {s.layer_start}-{s.layer_end - 1} of {cfg.num_hidden_layers}",
            f"q heads {s.q_head_start}-{s.q_head_start + s.num_heads - 1} of {cfg.num_attention_heads}",
            f"KV heads {s.kv_head_start}-{s.kv_head_start + s.num_kv_heads - 1} of {cfg.num_key_value_heads}"
            + (" (replicated)" if self.tensor_parallel_size > cfg.num_key_value_heads else ""),
        ]
        if s.is_first_stage or s.is_last_stage:
            last_row = min(s.vocab_start + s.num_vocab_rows, cfg.vocab_size) - 1
            held = [
                name for name, on in (("embedding", s.is_first_stage), ("LM head", s.is_last_stage)) if on
            ]
            parts.append(f"{' + '.join(held)} rows {s.vocab_start}-{last_row} of {cfg.vocab_size}")
        if s.is_sampler:
            parts.append("samples")
        return f"rank {rank} (tp {s.tp_rank}, stage {s.pp_rank}): " + ", ".join(parts)
