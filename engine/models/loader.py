"""Load a Llama-family checkpoint from a Hugging Face directory (single or sharded safetensors)."""

from __future__ import annotations

import glob
import json
import logging
import os
import re

import torch
from safetensors import safe_open

from kvpilot.engine.models.config import ModelConfig
from kvpilot.engine.models.llama import LlamaForCausalLM, RotaryEmbedding
from kvpilot.kernels import AttentionBackend

logger = logging.getLogger(__name__)

_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


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


def _target(model: LlamaForCausalLM, name: str) -> tuple[torch.Tensor, slice | None] | None:
    """Where checkpoint tensor ``name`` goes: (parameter, row slice of a fused parameter) or None."""
    cfg = model.config
    if name == "model.embed_tokens.weight":
        return model.embed_tokens.weight, None
    if name == "model.norm.weight":
        return model.norm.weight, None
    if name == "lm_head.weight":
        return None if model.lm_head is None else (model.lm_head.weight, None)
    m = _LAYER.match(name)
    if m is None:
        return None
    layer = model.layers[int(m.group(1))]
    rest = m.group(2)
    attn, mlp = layer.self_attn, layer.mlp
    q, kv, inter = attn.q_size, attn.kv_size, cfg.intermediate_size
    fused = {
        "self_attn.q_proj": (attn.qkv_proj, slice(0, q)),
        "self_attn.k_proj": (attn.qkv_proj, slice(q, q + kv)),
        "self_attn.v_proj": (attn.qkv_proj, slice(q + kv, q + 2 * kv)),
        "mlp.gate_proj": (mlp.gate_up_proj, slice(0, inter)),
        "mlp.up_proj": (mlp.gate_up_proj, slice(inter, 2 * inter)),
    }
    module_name, _, kind = rest.rpartition(".")
    if module_name in fused:
        module, rows = fused[module_name]
        return getattr(module, kind), rows
    plain = {
        "self_attn.o_proj": attn.o_proj,
        "mlp.down_proj": mlp.down_proj,
        "input_layernorm": layer.input_layernorm,
        "post_attention_layernorm": layer.post_attention_layernorm,
        "self_attn.q_norm": attn.q_norm,
        "self_attn.k_norm": attn.k_norm,
    }
    module = plain.get(module_name)
    if module is None or not hasattr(module, kind):
        return None
    return getattr(module, kind), None


def load_model(
    model_dir: str,
    cfg: ModelConfig,
    backend: AttentionBackend,
    dtype: torch.dtype,
    device: torch.device,
    max_positions: int,
) -> LlamaForCausalLM:
    """Build the model without initialising weights, then fill every parameter from the checkpoint.

    Raises ``ValueError`` naming the parameters the checkpoint does not provide.
    """
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg, backend, max_positions)
    model.to_empty(device=device)
    model.to(dtype)
    model.rotary = RotaryEmbedding(cfg, max_positions).to(device)

    params = dict(model.named_parameters())
    filled: dict[int, int] = {}  # parameter id -> rows filled
    unexpected = []
    for path in checkpoint_files(model_dir):
        with safe_open(path, framework="pt", device="cpu") as f:
            for name in f.keys():
                target = _target(model, name)
                if target is None:
                    if not name.endswith("rotary_emb.inv_freq") and name != "lm_head.weight":
                        unexpected.append(name)
                    continue
                param, rows = target
                tensor = f.get_tensor(name)
                dst = param.data if rows is None else param.data[rows]
                if dst.shape != tensor.shape:
                    raise ValueError(
                        f"checkpoint tensor {name} has shape {tuple(tensor.shape)}, "
                        f"expected {tuple(dst.shape)}"
                    )
                dst.copy_(tensor)
                filled[id(param)] = filled.get(id(param), 0) + tensor.shape[0]
    missing = [n for n, p in params.items() if filled.get(id(p), 0) != p.shape[0]]
    if missing:
        raise ValueError(f"checkpoint {model_dir} lacks weights for: {', '.join(sorted(missing)[:8])}")
    if unexpected:
        logger.warning("ignored %d unexpected checkpoint tensors, e.g. %s", len(unexpected), unexpected[0])
    model.eval()
    model.requires_grad_(False)
    return model
