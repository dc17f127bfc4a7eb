"""The per-step attention metadata every kernel backend reads."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class AttentionMetadata:
    """Describes one flattened batch of ``num_tokens`` query tokens from ``num_reqs`` requests.

    Request ``i`` contributes query tokens ``query_start_loc[i] : query_start_loc[i+1]`` (a prefill
    chunk, or one token while decoding); they sit at the last positions of its ``seq_lens[i]`` tokens,
    all of whose K/V are in the cache (the new ones written by ``write_kv_cache`` first) in the blocks
    ``block_tables[i, : ceil(seq_lens[i] / block_size)]``.

    Requests ``0 .. num_decodes - 1`` have exactly one query token (decodes come first).

    Tensors (on the model's device):
      slot_mapping:    [num_tokens] int64, cache slot (block * block_size + offset) of each new token;
                       negative = padding, not written
      query_start_loc: [num_reqs + 1] int32
      seq_lens:        [num_reqs] int32, tokens in the cache after this step (context + query)
      block_tables:    [num_reqs, max_num_blocks] int32, padded with 0
    """

    slot_mapping: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    max_query_len: int
    max_seq_len: int
    num_decodes: int
    # Host copies of query_start_loc / seq_lens (CPU paths loop over prefill requests without syncing).
    query_start_loc_host: list[int]
    seq_lens_host: list[int]
    # Per-step tensors a backend derives once and reuses in every layer (e.g. masks); backend-private.
    derived: dict[str, Any] = field(default_factory=dict)

    @property
    def num_reqs(self) -> int:
        return len(self.seq_lens_host)

    @property
    def num_tokens(self) -> int:
        return self.query_start_loc_host[-1]
