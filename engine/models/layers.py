"""Tensor-parallel layers: the identity of ``nn.Linear`` / ``nn.Embedding`` at tensor-parallel size 1.

Megatron's split, within one pipeline stage::

    ColumnParallelLinear   this rank's output features (weight rows); the output stays sharded
    RowParallelLinear      this rank's input features (weight columns); partial products all-reduced
    VocabParallelEmbedding this rank's vocabulary rows; lookups outside them are zero, then all-reduced
    ParallelLMHead         this rank's vocabulary rows as an output projection; logits gathered on tp rank 0

Each layer's ``weight_loader(param, loaded, shard_id=None)`` copies only this rank's part of a
checkpoint tensor into ``param``. ``loaded`` is anything indexable like a tensor (a safetensors
``get_slice`` object reads only the indexed rows or columns, so no rank materialises the full tensor).

On CPU, ``prepack_cpu_linears(model)`` gives each linear (and the LM head) a packed weight, once the
weights are loaded:

- bfloat16: a copy in oneDNN's blocked layout, reordered once (``F.linear`` on a plain weight reorders
  it on every call). The results are bit for bit those of ``F.linear``; the plain weight stays the
  parameter (loaders, tied embeddings and ``state_dict`` see no change).
- float32 whose every weight is a bfloat16 value (a bfloat16 checkpoint computed in float32 on a CPU
  without native bfloat16): ``PanelWeight``, the weight in bfloat16 panels that the C++ kernel widens
  in registers (``cpu_ops.linear_bf16w``). The float32 parameter is emptied, so the weights take half
  the memory and a step reads half the bytes; a tied embedding looks its rows up in the panels. The
  products are float32 products of the same values, summed in another order than ``F.linear``'s
  (within float32 summation's bound of each other). Loading weights again needs a new model.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

LOG = logging.getLogger("kvpilot.engine")

# Names the parts of a fused parameter: "q", "k", "v" of qkv_proj, 0 and 1 of gate_up_proj.
ShardId = str | int | None


class Comm(Protocol):
    """The collectives the layers and the model need (``kvpilot.engine.parallel.comm.ParallelComm``)."""

    tp_size: int
    tp_rank: int

    def tp_all_reduce(self, x: torch.Tensor) -> torch.Tensor: ...

    def tp_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor | None: ...

    def send_to_next_stage(self, x: torch.Tensor) -> None: ...

    def recv_from_prev_stage(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor: ...


class SingleRankComm:
    """The comm of a one-rank engine: every tensor-parallel collective is the identity, and there is no
    other pipeline stage to talk to."""

    tp_size = 1
    tp_rank = 0

    def tp_all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def tp_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def send_to_next_stage(self, x: torch.Tensor) -> None:
        raise RuntimeError("a single-rank engine has no next pipeline stage")

    def recv_from_prev_stage(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        raise RuntimeError("a single-rank engine has no previous pipeline stage")


def token_bucket(num_tokens: int) -> int:
    """The row count a packed matmul runs at: powers of two up to 16, multiples of 16 up to 256, then
    multiples of 256. oneDNN builds (and keeps) a primitive per shape, about a millisecond each, so a
    run whose token counts vary step by step would otherwise pay that on most steps."""
    if num_tokens <= 16:
        return 1 << max(0, num_tokens - 1).bit_length()
    if num_tokens <= 256:
        return -(-num_tokens // 16) * 16
    return -(-num_tokens // 256) * 256


class PanelWeight:
    """A float32 linear's weight, every value of which is a bfloat16, as the bfloat16 panels
    ``[ceil(N / 16), K, 16]`` of ``cpu_ops.linear_bf16w`` (``op``: the extension's function)."""

    __slots__ = ("op", "out_features", "panels")

    def __init__(self, weight: torch.Tensor, op) -> None:
        from kvpilot.kernels import cpu_ops

        self.panels = cpu_ops.pack_bf16_panels(weight)
        self.out_features = weight.shape[0]
        self.op = op

    @property
    def nbytes(self) -> int:
        return self.panels.numel() * self.panels.element_size()

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``F.linear(x, weight, bias)`` in float32, ``x: [..., in_features]``."""
        flat = x.reshape(-1, x.shape[-1])
        if flat.stride(-1) != 1:
            flat = flat.contiguous()
        y = self.op(flat, self.panels, self.out_features)
        if bias is not None:
            y.add_(bias)
        return y.view(*x.shape[:-1], self.out_features)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` of the weight, float32 (a tied embedding's lookup)."""
        return self.panels[ids // 16, :, ids % 16].float()


def is_bf16_exact(weight: torch.Tensor) -> bool:
    """Whether every value of the float32 ``weight`` is a bfloat16 (its low 16 bits are zero)."""
    return weight.dtype == torch.float32 and not bool((weight.detach().view(torch.int32) & 0xFFFF).any())


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, packed) -> torch.Tensor:
    """``F.linear(x, weight, bias)``, through the packed weight when there is one: a ``PanelWeight``,
    or the oneDNN-packed copy of ``weight`` (``x: [num_tokens, in_features]`` zero-padded to
    ``token_bucket`` rows; rows are independent, so the padding changes no real row's result)."""
    if packed is None:
        return F.linear(x, weight, bias)
    if type(packed) is PanelWeight:
        return packed.matmul(x, bias)
    num_tokens = x.shape[0]
    rows = token_bucket(num_tokens) if x.dim() == 2 else num_tokens
    if rows == num_tokens:
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    padded = x.new_zeros(rows, x.shape[1])
    padded[:num_tokens] = x
    return torch.ops.mkldnn._linear_pointwise(padded, packed, bias, "none", [], "")[:num_tokens]


def can_prepack(weight: torch.Tensor) -> bool:
    """Whether ``weight`` can get a oneDNN-packed copy: a bfloat16 CPU tensor, with this torch's
    mkldnn ops present and giving exactly ``F.linear``'s result on a small probe."""
    if weight.device.type != "cpu" or weight.dtype != torch.bfloat16 or weight.dim() != 2:
        return False
    return _prepack_works()


_PREPACK_OK: bool | None = None


def _prepack_works() -> bool:
    global _PREPACK_OK
    if _PREPACK_OK is None:
        try:
            g = torch.Generator().manual_seed(0)
            w = torch.randn(48, 32, generator=g).to(torch.bfloat16)
            x = torch.randn(5, 32, generator=g).to(torch.bfloat16)
            packed = torch.ops.mkldnn._reorder_linear_weight(w, 64)
            _PREPACK_OK = bool(torch.equal(linear(x, w, None, packed), F.linear(x, w)))
        except (AttributeError, RuntimeError, NotImplementedError):
            _PREPACK_OK = False
    return _PREPACK_OK


def _panel_op():
    """The extension's ``linear_bf16w`` where its build has a vector path for it (AVX2 or AVX-512),
    else None: the portable loop is not measured to beat ``F.linear``."""
    from kvpilot.kernels import cpu_ops
    from kvpilot.kernels.cpu_build import load_extension

    if cpu_ops.linear_bf16w_path() not in ("avx2", "avx512"):
        return None
    return load_extension().linear_bf16w


def prepack_cpu_linears(model: nn.Module, batch_hint: int = 64) -> int:
    """Give every linear layer of ``model`` (and a tied LM head) a packed weight where one applies (see
    the module doc): oneDNN's copy of a bfloat16 weight that ``can_prepack``, or a ``PanelWeight`` of
    a float32 one that ``is_bf16_exact``, whose float32 parameter is then emptied. ``batch_hint``: the
    token count oneDNN's layout is chosen for; any count runs. Call once, after the weights are
    loaded. Returns the bytes the packed weights take."""
    total = unpacked = 0
    panel_layers = 0
    panel_op = False  # not looked up yet
    # An embedding table is a matmul operand only where it serves as the (tied) output projection.
    tied_head = getattr(model, "embed_tokens", None) if getattr(model, "lm_head", False) is None else None
    for module in model.modules():
        if isinstance(module, (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding)):
            module.packed_weight = None
            is_matmul = not isinstance(module, VocabParallelEmbedding) or isinstance(module, ParallelLMHead)
            weight = module.weight
            if not (is_matmul or module is tied_head) or weight.device.type != "cpu":
                continue
            if can_prepack(weight):
                module.packed_weight = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), batch_hint)
                total += weight.numel() * weight.element_size()
            elif weight.dtype == torch.bfloat16:
                unpacked += 1
            elif weight.dim() == 2 and is_bf16_exact(weight):
                if panel_op is False:
                    panel_op = _panel_op()
                if panel_op is None:
                    continue
                module.packed_weight = PanelWeight(weight, panel_op)
                module.weight.data = weight.new_empty(0)
                total += module.packed_weight.nbytes
                panel_layers += 1
    if unpacked:
        LOG.warning(
            "bfloat16 linears run unpacked (%d layers): this torch's oneDNN packed linear is missing or "
            "does not match F.linear on this CPU",
            unpacked,
        )
    if panel_layers:
        LOG.info(
            "float32 linears over bfloat16 weight panels (%d layers, %.1f MiB): the weights are bfloat16 "
            "values, read at half their float32 size",
            panel_layers,
            total / (1 << 20),
        )
    return total


def copy_part(dst: torch.Tensor, part: torch.Tensor) -> None:
    """``dst.copy_(part)``; raises ``ValueError`` when the shapes differ (the loader names the tensor)."""
    if dst.shape != part.shape:
        raise ValueError(f"gives this rank a {tuple(part.shape)} part, expected {tuple(dst.shape)}")
    dst.copy_(part)


def default_weight_loader(param: torch.Tensor, loaded, shard_id: ShardId = None) -> None:
    """A replicated parameter (norms): the whole tensor."""
    copy_part(param.data, loaded[:])


class ColumnParallelLinear(nn.Module):
    """``y = x W^T + b`` over this rank's output features; ``y`` stays sharded over the ranks.

    ``partitions`` maps each shard id to ``(rows held, first row held in the checkpoint tensor)``, in the
    order the outputs are laid out: a plain layer has the one shard id None, a fused one (``qkv_proj``,
    ``gate_up_proj``) one per checkpoint tensor it fuses.
    """

    def __init__(self, in_features: int, partitions: Mapping[ShardId, tuple[int, int]], bias: bool) -> None:
        super().__init__()
        self._parts: dict[ShardId, tuple[int, int, int]] = {}  # shard id -> (dst row, rows, src row)
        row = 0
        for shard_id, (num_rows, src_start) in partitions.items():
            self._parts[shard_id] = (row, num_rows, src_start)
            row += num_rows
        self.shard_ids = tuple(self._parts)
        self.weight = nn.Parameter(torch.empty(row, in_features))
        self.bias = nn.Parameter(torch.empty(row)) if bias else None
        self.packed_weight = None  # see prepack_cpu_linears

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.packed_weight)

    def weight_loader(self, param: torch.Tensor, loaded, shard_id: ShardId = None) -> None:
        """Rows of checkpoint tensor ``shard_id`` (weight or bias) into their place in ``param``."""
        dst, num_rows, src = self._parts[shard_id]
        copy_part(param.data[dst : dst + num_rows], loaded[src : src + num_rows])


class MergedColumnParallelLinear(ColumnParallelLinear):
    """``num_outputs`` projections of the same input fused into one matmul (gate and up): rank ``t`` holds
    rows ``[start, start + rows)`` of each; shard ids ``0 .. num_outputs - 1``."""

    def __init__(self, in_features: int, num_outputs: int, rows: int, start: int, bias: bool) -> None:
        super().__init__(in_features, {i: (rows, start) for i in range(num_outputs)}, bias)


class QKVParallelLinear(ColumnParallelLinear):
    """The q, k and v projections fused (shard ids ``"q"``, ``"k"``, ``"v"``) over this rank's heads."""

    def __init__(
        self,
        hidden_size: int,
        head_dim: int,
        q_head_start: int,
        num_heads: int,
        kv_head_start: int,
        num_kv_heads: int,
        bias: bool,
    ) -> None:
        kv = (num_kv_heads * head_dim, kv_head_start * head_dim)
        parts = {"q": (num_heads * head_dim, q_head_start * head_dim), "k": kv, "v": kv}
        super().__init__(hidden_size, parts, bias)


class RowParallelLinear(nn.Module):
    """``y = sum over ranks (x_t W_t^T) + b``: this rank holds input features
    ``[input_start, input_start + in_features)``; the bias is loaded on tensor-parallel rank 0 and zero
    elsewhere, so that the all-reduce adds it once."""

    def __init__(self, in_features: int, out_features: int, bias: bool, input_start: int, comm: Comm) -> None:
        super().__init__()
        self.input_start = input_start
        self.comm = comm
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.packed_weight = None  # see prepack_cpu_linears

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.comm.tp_all_reduce(linear(x, self.weight, self.bias, self.packed_weight))

    def weight_loader(self, param: torch.Tensor, loaded, shard_id: ShardId = None) -> None:
        if param is self.bias:
            if self.comm.tp_rank == 0:
                copy_part(param.data, loaded[:])
            else:
                param.data.zero_()
            return
        start, num = self.input_start, param.shape[1]
        copy_part(param.data, loaded[:, start : start + num])


class VocabParallelEmbedding(nn.Module):
    """Rows ``[vocab_start, vocab_start + num_rows)`` of a ``vocab_size``-row table; ``weight``:
    ``[num_rows, hidden]``, rows past the vocabulary (padding of the last shard) zero."""

    def __init__(
        self, num_rows: int, hidden_size: int, vocab_start: int, vocab_size: int, comm: Comm
    ) -> None:
        super().__init__()
        self.vocab_start = vocab_start
        self.vocab_size = vocab_size
        self.comm = comm
        self.weight = nn.Parameter(torch.empty(num_rows, hidden_size))
        self.packed_weight = None  # the output projection's; see prepack_cpu_linears

    def _lookup(self, ids: torch.Tensor) -> torch.Tensor:
        if type(self.packed_weight) is PanelWeight:  # the float32 table was emptied (prepack_cpu_linears)
            return self.packed_weight.rows(ids)
        return F.embedding(ids, self.weight)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.comm.tp_size == 1:
            return self._lookup(input_ids)
        local = input_ids - self.vocab_start
        num_rows = (
            self.packed_weight.out_features
            if type(self.packed_weight) is PanelWeight
            else self.weight.shape[0]
        )
        outside = (local < 0) | (local >= num_rows)
        x = self._lookup(local.masked_fill(outside, 0))
        return self.comm.tp_all_reduce(x.masked_fill(outside[:, None], 0))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """``hidden`` [n, hidden_size] projected on the table: float32 logits [n, vocab_size] on
        tensor-parallel rank 0 (gathered from every rank's rows), None on the others."""
        logits = self.comm.tp_gather_last_dim(linear(hidden, self.weight, None, self.packed_weight))
        if logits is None:
            return None
        if logits.shape[-1] != self.vocab_size:
            logits = logits[:, : self.vocab_size]
        return logits.float()

    def weight_loader(self, param: torch.Tensor, loaded, shard_id: ShardId = None) -> None:
        real = max(0, min(param.shape[0], self.vocab_size - self.vocab_start))
        copy_part(param.data[:real], loaded[self.vocab_start : self.vocab_start + real])
        param.data[real:].zero_()


class ParallelLMHead(VocabParallelEmbedding):
    """The output projection over this rank's vocabulary rows: ``forward`` is ``logits``."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor | None:
        return self.logits(hidden)
