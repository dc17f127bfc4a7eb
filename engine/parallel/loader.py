"""Load one rank's shard straight from the safetensors files.

Every tensor is read with ``safe_open(...).get_slice(name)[rows]`` (or ``[:, cols]``): a rank reads only
the rows and columns it holds, and only for its own layers, so no process ever materialises the full
model. Row-parallel biases are loaded on tensor-parallel rank 0 and zero elsewhere (the all-reduce adds
them once); vocabulary rows past the end of the vocabulary (padding of the last shard) are zero.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import torch
from safetensors import safe_open

from kvpilot.engine.models.config import ModelConfig
from kvpilot.engine.models.llama import RotaryEmbedding
from kvpilot.engine.models.loader import checkpoint_files
from kvpilot.engine.parallel.comm import ParallelComm
from kvpilot.engine.parallel.layout import RankShard
from kvpilot.engine.parallel.model import ParallelLlamaForCausalLM
from kvpilot.kernels import AttentionBackend

_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")

# A read of one checkpoint tensor: (slice object, callable giving the tensor) -> the part this rank holds.
_Reader = Callable[[object], torch.Tensor]


def _rows(start: int, stop: int) -> _Reader:
    return lambda sl: sl[start:stop]


def _cols(start: int, stop: int) -> _Reader:
    return lambda sl: sl[:, start:stop]


def _whole(sl) -> torch.Tensor:
    return sl[:]


class _Plan:
    """Where each checkpoint tensor of this rank goes: name -> [(parameter, destination rows, reader)]."""

    def __init__(self, model: ParallelLlamaForCausalLM, cfg: ModelConfig, shard: RankShard) -> None:
        self.targets: dict[str, list[tuple[torch.Tensor, slice | None, _Reader]]] = {}
        self.zero_filled: list[tuple[torch.Tensor, slice | None]] = []
        d = cfg.head_dim
        q0, nq = shard.q_head_start * d, shard.num_heads * d
        k0, nk = shard.kv_head_start * d, shard.num_kv_heads * d
        i0, ni = shard.intermediate_start, shard.intermediate_size
        v0 = shard.vocab_start
        real_rows = max(0, min(shard.num_vocab_rows, cfg.vocab_size - v0))
        if model.embed_tokens is not None:
            self._vocab("model.embed_tokens.weight", model.embed_tokens.weight, v0, real_rows)
        if model.lm_head is not None:
            head = "model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"
            self._vocab(head, model.lm_head.weight, v0, real_rows)
            self.add("model.norm.weight", model.norm.weight, None, _whole)
        row_bias_here = shard.tp_rank == 0
        for local, layer in enumerate(model.layers):
            p = f"model.layers.{shard.layer_start + local}."
            attn, mlp = layer.self_attn, layer.mlp
            for kind in ("weight", "bias") if cfg.qkv_bias else ("weight",):
                fused = getattr(attn.qkv_proj, kind)
                self.add(f"{p}self_attn.q_proj.{kind}", fused, slice(0, nq), _rows(q0, q0 + nq))
                self.add(f"{p}self_attn.k_proj.{kind}", fused, slice(nq, nq + nk), _rows(k0, k0 + nk))
                self.add(
                    f"{p}self_attn.v_proj.{kind}", fused, slice(nq + nk, nq + 2 * nk), _rows(k0, k0 + nk)
                )
            self.add(f"{p}self_attn.o_proj.weight", attn.o_proj.weight, None, _cols(q0, q0 + nq))
            for kind in ("weight", "bias") if cfg.mlp_bias else ("weight",):
                fused = getattr(mlp.gate_up_proj, kind)
                self.add(f"{p}mlp.gate_proj.{kind}", fused, slice(0, ni), _rows(i0, i0 + ni))
                self.add(f"{p}mlp.up_proj.{kind}", fused, slice(ni, 2 * ni), _rows(i0, i0 + ni))
            self.add(f"{p}mlp.down_proj.weight", mlp.down_proj.weight, None, _cols(i0, i0 + ni))
            for name, bias, present in (
                ("self_attn.o_proj.bias", attn.o_proj.bias, cfg.o_bias),
                ("mlp.down_proj.bias", mlp.down_proj.bias, cfg.mlp_bias),
            ):
                if not present:
                    continue
                if row_bias_here:
                    self.add(p + name, bias, None, _whole)
                else:
                    self.zero_filled.append((bias, None))
            for norm in ("input_layernorm", "post_attention_layernorm"):
                self.add(f"{p}{norm}.weight", getattr(layer, norm).weight, None, _whole)
            if attn.q_norm is not None:
                self.add(f"{p}self_attn.q_norm.weight", attn.q_norm.weight, None, _whole)
                self.add(f"{p}self_attn.k_norm.weight", attn.k_norm.weight, None, _whole)

    def add(self, name: str, param: torch.Tensor, rows: slice | None, reader: _Reader) -> None:
        self.targets.setdefault(name, []).append((param, rows, reader))

    def _vocab(self, name: str, param: torch.Tensor, start: int, real_rows: int) -> None:
        self.add(name, param, slice(0, real_rows), _rows(start, start + real_rows))
        if real_rows < param.shape[0]:
            self.zero_filled.append((param, slice(real_rows, param.shape[0])))


def load_model_shard(
    model_dir: str,
    cfg: ModelConfig,
    shard: RankShard,
    comm: ParallelComm,
    backend: AttentionBackend,
    dtype: torch.dtype,
    device: torch.device,
    max_positions: int,
) -> ParallelLlamaForCausalLM:
    """Build this rank's model without initialising weights, then fill it from the checkpoint.

    Raises ``ValueError`` naming the tensors the checkpoint lacks or whose shapes do not match.
    """
    with torch.device("meta"):
        model = ParallelLlamaForCausalLM(cfg, backend, max_positions, shard, comm)
    model.to_empty(device=device)
    model.to(dtype)
    model.rotary = RotaryEmbedding(model.config, max_positions).to(device)

    plan = _Plan(model, cfg, shard)
    filled: dict[int, int] = {}  # parameter id -> elements filled
    for param, rows in plan.zero_filled:
        dst = param.data if rows is None else param.data[rows]
        dst.zero_()
        filled[id(param)] = filled.get(id(param), 0) + dst.numel()
    seen: set[str] = set()
    for path in checkpoint_files(model_dir):
        with safe_open(path, framework="pt", device="cpu") as f:
            for name in f.keys():
                targets = plan.targets.get(name)
                if not targets:
                    continue
                seen.add(name)
                sl = f.get_slice(name)
                for param, rows, reader in targets:
                    tensor = reader(sl)
                    dst = param.data if rows is None else param.data[rows]
                    if dst.shape != tensor.shape:
                        raise ValueError(
                            f"checkpoint tensor {name} (shape {tuple(sl.get_shape())}) gives this rank a "
                            f"{tuple(tensor.shape)} part, expected {tuple(dst.shape)}"
                        )
                    dst.copy_(tensor)
                    filled[id(param)] = filled.get(id(param), 0) + dst.numel()
    missing = sorted(set(plan.targets) - seen)
    if missing:
        raise ValueError(f"checkpoint {model_dir} lacks weights for: {', '.join(missing[:8])}")
    params = dict(model.named_parameters())
    partial = [n for n, p in params.items() if filled.get(id(p), 0) != p.numel()]
    if partial:
        raise ValueError(f"checkpoint {model_dir} does not fill parameters: {', '.join(sorted(partial)[:8])}")
    model.eval()
    model.requires_grad_(False)
    return model
