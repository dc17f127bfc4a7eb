"""Paged KV-cache bookkeeping: which physical block holds which tokens of which request (torch-free).

The KV cache is ``num_blocks`` blocks of ``block_size`` token slots. Each request owns a block table:
logical block ``i`` (tokens ``i*block_size .. (i+1)*block_size - 1``) lives in physical block
``block_table[i]``. Blocks are allocated on demand as tokens are scheduled, so only the last block of a
request is ever partly filled. Blocks carry reference counts: the prefix cache lets several requests
point at the same physical block (prompts with a common prefix, the ``n`` sequences of one request, a
beam search's rounds); a request about to write into a shared partly filled block first gets a
private copy (copy-on-write), reported in ``pending_copies``.

Swapping: with a CPU pool (``num_cpu_blocks``), ``swap_out`` moves a request's blocks to CPU blocks and
``swap_in`` brings them back into fresh device blocks. The copies themselves are the runner's job: it
executes one step's pending operations in the order swap-out, copy-on-write, swap-in, before the
forward pass. That order is safe because a block freed by a swap-out can be handed out again in the
same step (to a copy-on-write target, a swap-in or new tokens), and each of those writes after the
swap-out has read it; a request swapped out while its own copy-on-write is still pending has the
copy's source swapped out instead.

Prefix caching: once a block is full, it is identified by the key ``(id of the parent block's key, its
token ids)``. Keys are compared exactly (a dictionary holds the token tuples), so two different prefixes
can never share KV, whatever their hashes; key ids are never reused. A new request reuses the longest run
of cached blocks matching its prompt. Blocks whose reference count drops
to zero stay cached (and count as free) until the allocator evicts them, least recently freed first.

A block is keyed when it is allocated for the tokens that fill it (as vLLM v1 does), not after they are
computed: a request admitted later in the same step reuses it, and its attention reads the KV that the
same forward writes first (each layer writes the step's K/V before it attends). That is how the ``n``
sequences of one request share their prompt's full blocks, each computing only its last partial block.
Such a block is *tentative* until ``end_step``: if its writer is preempted in the same step, the block is
un-keyed as it is freed. The scheduler's order makes that safe: every preemption of a step comes before
its admissions (the only requests that look blocks up), so nobody else holds a tentative block whose
writer is preempted; ``free`` and ``swap_out`` assert it.
"""

from __future__ import annotations

from collections import OrderedDict

from kvpilot.engine.errors import ConfigError
from kvpilot.engine.request import Request


class BlockManager:
    """Allocates KV blocks to requests; all methods are O(blocks touched)."""

    def __init__(
        self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False, num_cpu_blocks: int = 0
    ) -> None:
        if num_blocks <= 0:
            raise ConfigError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        # Cache key of each block while it holds a cached full block: (parent key id, token ids).
        self.block_keys: list[tuple | None] = [None] * num_blocks
        # Free blocks without a cached hash: reused first (a stack, hot blocks first).
        self._free_plain: list[int] = list(range(num_blocks - 1, -1, -1))
        # Free blocks still holding a cached prefix, in eviction order (least recently freed first).
        self._free_cached: OrderedDict[int, None] = OrderedDict()
        self._cached: dict[tuple, tuple[int, int]] = {}  # key -> (physical block, key id)
        # Partly filled blocks left by freed requests: (parent key id, the tokens it holds) -> block, and
        # each block's partial keys (see ``_register_partial``).
        self._partial: dict[tuple, int] = {}
        self._partial_of: dict[int, list[tuple]] = {}
        self._next_key_id = 0
        self.block_tables: dict[str, list[int]] = {}
        self._key_chain: dict[str, list[int]] = {}  # key ids of a request's full blocks, in order
        # Blocks a request keyed this step, for tokens the step has not computed yet (see the module doc).
        self._tentative: dict[str, list[int]] = {}
        self.pending_copies: list[tuple[int, int]] = []  # (src, dst) copy-on-write pairs for this step
        # CPU pool for swapped-out requests.
        self.num_cpu_blocks = num_cpu_blocks
        self._free_cpu: list[int] = list(range(num_cpu_blocks - 1, -1, -1))
        self.cpu_tables: dict[str, list[int]] = {}
        self.pending_swap_out: list[tuple[int, int]] = []  # (device block, cpu block)
        self.pending_swap_in: list[tuple[int, int]] = []  # (cpu block, device block)
        # CPU blocks read by this step's swap-ins: reusable once the step's operations are taken.
        self._cpu_released: list[int] = []
        # Counters read by the metrics: prompt tokens looked up in / found in the prefix cache.
        self.prefix_queries = 0
        self.prefix_hits = 0

    # ------------------------------------------------------------------ queries
    @property
    def num_free_blocks(self) -> int:
        """Blocks no request holds (cached-but-free blocks included)."""
        return len(self._free_plain) + len(self._free_cached)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by live requests (cached-but-free blocks count as free)."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    @property
    def num_free_cpu_blocks(self) -> int:
        """CPU blocks neither holding a swapped-out block nor read by this step's swap-ins."""
        return len(self._free_cpu)

    @property
    def cpu_usage(self) -> float:
        """Fraction of the CPU swap pool holding swapped-out blocks (0 without a pool)."""
        if not self.num_cpu_blocks:
            return 0.0
        return 1.0 - (len(self._free_cpu) + len(self._cpu_released)) / self.num_cpu_blocks

    def get_block_table(self, req_id: str) -> list[int]:
        """The device blocks of ``req_id``, in token order: the live list itself, or [] when it has none."""
        return self.block_tables.get(req_id, [])

    def has_block_table(self, req_id: str) -> bool:
        """Whether ``req_id`` holds a device block table (possibly still empty), i.e. was allocated since
        it was last freed or swapped out."""
        return req_id in self.block_tables

    def num_blocks_needed(self, num_tokens: int) -> int:
        """Blocks that hold ``num_tokens`` tokens (ceil)."""
        return -(-num_tokens // self.block_size)

    # ------------------------------------------------------------------ allocation
    def _pop_free(self) -> int:
        if self._free_plain:
            block = self._free_plain.pop()
        else:
            block, _ = self._free_cached.popitem(last=False)
            key = self.block_keys[block]
            if key is not None and self._cached.get(key, (None,))[0] == block:
                del self._cached[key]
            self.block_keys[block] = None
            for partial in self._partial_of.pop(block, ()):
                if self._partial.get(partial) == block:
                    del self._partial[partial]
        self.ref_counts[block] = 1
        return block

    def _touch(self, block: int) -> None:
        """Take one more reference on ``block`` (reviving it from the free cache if needed)."""
        if self.ref_counts[block] == 0:
            del self._free_cached[block]
        self.ref_counts[block] += 1

    def _release(self, block: int) -> None:
        self.ref_counts[block] -= 1
        assert self.ref_counts[block] >= 0, f"block {block} released below zero"
        if self.ref_counts[block] == 0:
            if self.block_keys[block] is not None or block in self._partial_of:
                self._free_cached[block] = None
            else:
                self._free_plain.append(block)

    def allocate_prefix(self, req: Request) -> int:
        """On admission: reuse cached blocks for the longest cached prefix of ``req``'s tokens.

        Full blocks first, then the longest partly filled block a freed request left that continues
        them (a beam search's next round finds its previous round's last block so, and computes one
        token). Returns the number of tokens whose KV is already cached (always leaving at least one
        token to compute so the request gets logits; 0 when prefix caching is off): the caller's
        ``req.num_computed_tokens`` and ``req.num_cached_tokens`` from now on. A request that goes on to
        write into a partly filled block another request holds copies it first (``allocate_slots``).
        """
        assert req.req_id not in self.block_tables, f"{req.req_id} already has blocks"
        self.block_tables[req.req_id] = []
        self._key_chain[req.req_id] = []
        if not self.enable_prefix_caching:
            return 0
        bs = self.block_size
        max_blocks = (req.num_tokens - 1) // bs
        table = self.block_tables[req.req_id]
        chain = self._key_chain[req.req_id]
        parent = None
        for i in range(max_blocks):
            hit = self._cached.get((parent, tuple(req.token_slice(i * bs, (i + 1) * bs))))
            if hit is None:
                break
            block, parent = hit
            self._touch(block)
            table.append(block)
            chain.append(parent)
        num_cached = len(table) * bs
        if self._partial:
            for m in range(min(bs - 1, req.num_tokens - 1 - num_cached), 0, -1):
                block = self._partial.get((parent, tuple(req.token_slice(num_cached, num_cached + m))))
                if block is not None:
                    self._touch(block)
                    table.append(block)
                    num_cached += m
                    break
        self.prefix_queries += req.num_tokens
        self.prefix_hits += num_cached
        return num_cached

    def allocate_slots(self, req: Request, num_new_tokens: int) -> bool:
        """Make room for ``num_new_tokens`` more tokens of ``req`` (KV written this step).

        All-or-nothing: returns False and changes nothing when the free pool is too small. Called for
        every scheduled request on every step, so the common case (a decode token that lands in the
        request's own last block) is kept to a few lookups.
        """
        req_id = req.req_id
        table = self.block_tables.get(req_id)
        if table is None:
            table = self.block_tables[req_id] = []
            self._key_chain.setdefault(req_id, [])
        bs = self.block_size
        computed = req.num_computed_tokens
        end = computed + num_new_tokens
        last, offset = divmod(computed, bs)
        # Copy on write: the next write lands in a partly filled block shared with another request.
        cow = offset != 0 and last < len(table) and self.ref_counts[table[last]] > 1
        needed = -(-end // bs) - len(table)
        if (needed if needed > 0 else 0) + cow > len(self._free_plain) + len(self._free_cached):
            return False
        if cow:
            src = table[last]
            dst = self._pop_free()
            self.pending_copies.append((src, dst))
            self._release(src)
            table[last] = dst
        elif offset and self._partial_of:
            # A block found by a partial key is written in place from this slot on (nobody else holds
            # it): what its other keys say of those slots no longer holds.
            self._truncate_partial(table[last], offset)
        for _ in range(needed):
            table.append(self._pop_free())
        # Only a write that fills a block past the request's keyed ones has anything to key.
        if self.enable_prefix_caching and end // bs > len(self._key_chain[req_id]):
            keyed = self._register_keys(req, end)
            if keyed:
                self._tentative.setdefault(req_id, []).extend(keyed)
        return True

    def _register_partial(self, req: Request, table: list[int]) -> None:
        """``req`` is freed: key its last, partly filled block by the tokens it computed there, so that
        a request continuing those tokens finds it (``allocate_prefix``)."""
        bs = self.block_size
        i, m = divmod(req.num_computed_tokens, bs)
        chain = self._key_chain.get(req.req_id)
        if not m or i >= len(table) or chain is None or len(chain) < i:
            return
        block = table[i]
        if any(dst == block for _, dst in self.pending_copies):
            return  # its copy on write has not run, and will not now that the request goes: it holds nothing
        key = (chain[i - 1] if i else None, tuple(req.token_slice(i * bs, i * bs + m)))
        if self._partial.get(key) != block:
            self._partial[key] = block
            self._partial_of.setdefault(block, []).append(key)

    def _truncate_partial(self, block: int, num_slots: int) -> None:
        """``block`` is written in place from slot ``num_slots`` on: drop its keys that cover those slots
        (its full key, if a request filled it since, and its longer partial keys; the shorter ones
        still hold)."""
        keys = self._partial_of.get(block)
        if not keys:
            return
        full = self.block_keys[block]
        if full is not None:
            if self._cached.get(full, (None,))[0] == block:
                del self._cached[full]
            self.block_keys[block] = None
        kept = []
        for key in keys:
            if len(key[1]) <= num_slots:
                kept.append(key)
            elif self._partial.get(key) == block:
                del self._partial[key]
        if kept:
            self._partial_of[block] = kept
        else:
            del self._partial_of[block]

    def end_step(self) -> None:
        """The step's allocations are final (its forward will compute them): no block is tentative."""
        self._tentative.clear()

    def _drop_tentative(self, req: Request) -> None:
        """Un-key the blocks ``req`` keyed this step: it is freed before computing them."""
        for block in self._tentative.pop(req.req_id, ()):
            assert self.ref_counts[block] == 1, (
                f"block {block} is freed before {req.req_id} computed it, but another request shares it"
            )
            key = self.block_keys[block]
            if key is not None and self._cached.get(key, (None,))[0] == block:
                del self._cached[key]
            self.block_keys[block] = None

    def undo_allocate_prefix(self, req: Request) -> None:
        """Free what ``allocate_prefix`` gave ``req`` when it is not admitted after all, and withdraw its
        lookup from the prefix-cache counters: the lookup is retried, and counted, at its next admission.
        Leaves ``req``'s own counters to the caller."""
        self.free(req)
        if self.enable_prefix_caching:
            self.prefix_queries -= req.num_tokens
            self.prefix_hits -= req.num_cached_tokens

    def cache_full_blocks(self, req: Request) -> None:
        """Register the cache keys of ``req``'s blocks whose KV is computed (after a swap-in)."""
        if self.enable_prefix_caching:
            self._register_keys(req, req.num_computed_tokens)

    def _register_keys(self, req: Request, num_tokens: int) -> list[int]:
        """Key ``req``'s blocks that the first ``num_tokens`` tokens fill; returns the blocks keyed."""
        chain = self._key_chain[req.req_id]
        table = self.block_tables[req.req_id]
        bs = self.block_size
        num_full = min(num_tokens // bs, len(table))
        parent = chain[-1] if chain else None
        keyed = []
        for i in range(len(chain), num_full):
            key = (parent, tuple(req.token_slice(i * bs, (i + 1) * bs)))
            hit = self._cached.get(key)
            if hit is not None:
                parent = hit[1]
            else:
                parent = self._next_key_id
                self._next_key_id += 1
                block = table[i]
                if self.block_keys[block] is None:
                    self.block_keys[block] = key
                    self._cached[key] = (block, parent)
                    keyed.append(block)
            chain.append(parent)
        return keyed

    # ------------------------------------------------------------------ swapping
    def can_swap_out(self, req: Request) -> bool:
        """Whether the free CPU pool holds every device block of ``req``."""
        return len(self.block_tables.get(req.req_id, ())) <= len(self._free_cpu)

    def swap_out(self, req: Request) -> None:
        """Move every block of ``req`` to the CPU pool (caller checked ``can_swap_out``)."""
        self._drop_tentative(req)
        table = self.block_tables.pop(req.req_id)
        self._key_chain.pop(req.req_id, None)
        # A block whose copy-on-write copy has not run yet holds nothing: swap out the copy's source.
        pending_src = {dst: src for src, dst in self.pending_copies}
        cpu_table = []
        for block in table:
            cpu = self._free_cpu.pop()
            self.pending_swap_out.append((pending_src.get(block, block), cpu))
            cpu_table.append(cpu)
        self.cpu_tables[req.req_id] = cpu_table
        for block in reversed(table):
            self._release(block)
        self.pending_copies = [(s, d) for s, d in self.pending_copies if self.ref_counts[d] > 0]

    def can_swap_in(self, req: Request, num_new_tokens: int) -> bool:
        """Whether ``req``'s swapped blocks plus room for ``num_new_tokens`` fit the free pool."""
        cpu_table = self.cpu_tables[req.req_id]
        needed = max(len(cpu_table), self.num_blocks_needed(req.num_computed_tokens + num_new_tokens))
        return needed <= self.num_free_blocks

    def swap_in(self, req: Request) -> None:
        """Bring ``req``'s blocks back from the CPU pool into free device blocks."""
        cpu_table = self.cpu_tables.pop(req.req_id)
        table = []
        for cpu in cpu_table:
            block = self._pop_free()
            self.pending_swap_in.append((cpu, block))
            table.append(block)
        self._cpu_released.extend(cpu_table)
        self.block_tables[req.req_id] = table
        self._key_chain[req.req_id] = []
        self.cache_full_blocks(req)

    def take_pending_swaps(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """This step's (swap-out, swap-in) pairs; CPU blocks read by the swap-ins become free again."""
        out, self.pending_swap_out = self.pending_swap_out, []
        into, self.pending_swap_in = self.pending_swap_in, []
        self._free_cpu.extend(self._cpu_released)
        self._cpu_released = []
        return out, into

    def free(self, req: Request) -> None:
        """Release every block of ``req`` (finish, abort or recompute preemption). Idempotent."""
        cpu_table = self.cpu_tables.pop(req.req_id, None)
        if cpu_table is not None:
            self._free_cpu.extend(cpu_table)
        self._drop_tentative(req)
        table = self.block_tables.pop(req.req_id, None)
        if table is not None and self.enable_prefix_caching:
            self._register_partial(req, table)
        self._key_chain.pop(req.req_id, None)
        if table is None:
            return
        # Tail blocks first, so that they are evicted before the shared prefix blocks.
        for block in reversed(table):
            self._release(block)
        # A copy-on-write target freed in the same step must not be copied into any more: the block
        # may be handed out again this step, even as the target of another copy.
        if self.pending_copies:
            self.pending_copies = [(s, d) for s, d in self.pending_copies if self.ref_counts[d] > 0]

    def take_pending_copies(self) -> list[tuple[int, int]]:
        """This step's copy-on-write (src, dst) pairs, to run after the swap-outs and before the swap-ins."""
        copies, self.pending_copies = self.pending_copies, []
        return copies
