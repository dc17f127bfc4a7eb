"""Load a Llama-family checkpoint (single or sharded safetensors) into one rank's model.

The loader walks the checkpoint's tensor names once and maps each to the parameter it fills (and the
part of a fused parameter, the shard id); the parameter's weight loader reads only this rank's part of
the tensor (``kvpilot.engine.models.layers``). Tensors of other pipeline stages are skipped unread.
"""

from __future__ import annotations

import glob
import json
import logging
import os

import torch
from safetensors import safe_open
from torch import nn

from kvpilot.engine.models.config import ModelConfig
from kvpilot.engine.models.layers import Comm, ShardId, default_weight_loader
from kvpilot.engine.models.llama import HeldByOtherStage, LlamaForCausalLM, RotaryEmbedding
from kvpilot.engine.parallel.layout import RankShard
from kvpilot.kernels.backend import AttentionBackend

logger = logging.getLogger(__name__)

# Checkpoint module -> (fused module of the model, shard id of its part).
PACKED_MODULES: dict[str, tuple[str, ShardId]] = {
    "q_proj": ("qkv_proj", "q"),
    "k_proj": ("qkv_proj", "k"),
    "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}
_UNPACKED = {fused: name for name, fused in PACKED_MODULES.items()}


def resolve_model_dir(model: str) -> str:
    """A local directory as is; otherwise a Hugging Face hub id downloaded into the local HF cache."""
    if os.path.isdir(model):
        return model
    if os.path.exists(model):
        raise ValueError(f"model path {model!r} is not a directory")
    if model.startswith(("/", ".")) or model.count("/") != 1:
        raise FileNotFoundError(f"model directory {model!r} does not exist")
    from huggingface_hub import snapshot_download

    logger.info("fetching %s from the Hugging Face hub", model)
    return snapshot_download(
        model, allow_patterns=["*.json", "*.safetensors", "tokenizer*", "*.model", "*.txt", "*.jinja"]
    )


def checkpoint_files(model_dir: str) -> list[str]:
    """The safetensors files of a checkpoint, from its index when sharded."""
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index, encoding="utf-8") as fh:
            weight_map = json.load(fh)["weight_map"]
        return [os.path.join(model_dir, f) for f in sorted(set(weight_map.values()))]
    files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {model_dir} (only safetensors are supported)")
    return files


def parameter_targets(name: str, tie_word_embeddings: bool) -> list[tuple[str, ShardId]]:
    """The parameters checkpoint tensor ``name`` fills: ``[(parameter name, shard id)]``."""
    param_name = name.removeprefix("model.")
    if tie_word_embeddings and param_name == "embed_tokens.weight":
        return [(param_name, None), ("lm_head.weight", None)]
    module, _, kind = param_name.rpartition(".")
    parent, _, leaf = module.rpartition(".")
    if leaf in PACKED_MODULES:
        fused, shard_id = PACKED_MODULES[leaf]
        return [(f"{parent}.{fused}.{kind}", shard_id)]
    return [(param_name, None)]


def _checkpoint_name(param_name: str, shard_id: ShardId, tie_word_embeddings: bool) -> str:
    """The checkpoint tensor that fills ``param_name``'s part ``shard_id`` (for error messages)."""
    if param_name == "lm_head.weight":
        return "model.embed_tokens.weight" if tie_word_embeddings else param_name
    if shard_id is not None:
        module, _, kind = param_name.rpartition(".")
        parent, _, fused = module.rpartition(".")
        param_name = f"{parent}.{_UNPACKED[(fused, shard_id)]}.{kind}"
    return "model." + param_name


def _owner(model: nn.Module, param_name: str) -> nn.Module:
    return model.get_submodule(param_name.rpartition(".")[0])


def _on_other_stage(model: nn.Module, param_name: str) -> bool:
    module: nn.Module | None = model
    for part in param_name.split(".")[:-1]:
        module = module._modules.get(part) if module is not None else None
        if isinstance(module, HeldByOtherStage):
            return True
    return False


def load_model(
    model_dir: str,
    cfg: ModelConfig,
    backend: AttentionBackend,
    dtype: torch.dtype,
    device: torch.device,
    max_positions: int,
    shard: RankShard | None = None,
    comm: Comm | None = None,
) -> LlamaForCausalLM:
    """Build this rank's model (the whole model by default) without initialising weights, then fill
    every parameter from the checkpoint.

    Raises ``ValueError`` naming the tensors the checkpoint lacks or whose shapes do not match.
    """
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg, backend, max_positions, shard, comm)
    model.to_empty(device=device)
    model.to(dtype)
    model.rotary = RotaryEmbedding(cfg, max_positions).to(device)

    tied = cfg.tie_word_embeddings
    params = dict(model.named_parameters())
    filled: dict[str, set[ShardId]] = {name: set() for name in params}
    unexpected = []
    for path in checkpoint_files(model_dir):
        with safe_open(path, framework="pt", device="cpu") as f:
            for name in f.keys():
                for param_name, shard_id in parameter_targets(name, tied):
                    param = params.get(param_name)
                    if param is None:
                        skip = _on_other_stage(model, param_name) or param_name == "lm_head.weight"
                        if not skip and not name.endswith("rotary_emb.inv_freq"):
                            unexpected.append(name)
                        continue
                    # A parameter's weight loader is its module's method: to_empty() and to(dtype)
                    # replace the parameter objects, so an attribute set on them would not survive.
                    weight_loader = getattr(_owner(model, param_name), "weight_loader", default_weight_loader)
                    sl = f.get_slice(name)
                    try:
                        weight_loader(param, sl, shard_id)
                    except ValueError as exc:
                        raise ValueError(
                            f"checkpoint tensor {name} (shape {tuple(sl.get_shape())}) {exc}"
                        ) from None
                    filled[param_name].add(shard_id)
    missing = [
        _checkpoint_name(param_name, shard_id, tied)
        for param_name in params
        for shard_id in getattr(_owner(model, param_name), "shard_ids", (None,))
        if shard_id not in filled[param_name]
    ]
    if missing:
        raise ValueError(f"checkpoint {model_dir} lacks weights for: {', '.join(sorted(missing)[:8])}")
    if unexpected:
        logger.warning("ignored %d unexpected checkpoint tensors, e.g. %s", len(unexpected), unexpected[0])
    model.eval()
    model.requires_grad_(False)
    return model
