"""Transformers as the reference for the engine's greedy tokens: a loader and a cached greedy decode."""

from __future__ import annotations

import random

import torch
import transformers


class HFGreedy:
    """Greedy continuations by ``transformers.generate`` on one checkpoint, each prompt decoded alone
    (batch of one, no padding), cached per (prompt, max_new_tokens)."""

    def __init__(self, model_dir) -> None:
        self.model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        self._cache: dict[tuple[tuple[int, ...], int], list[int]] = {}

    def __call__(self, prompt: list[int], max_new_tokens: int) -> list[int]:
        key = (tuple(prompt), max_new_tokens)
        if key not in self._cache:
            with torch.no_grad():
                out = self.model.generate(
                    torch.tensor([prompt]),
                    attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                    max_new_tokens=max_new_tokens,
                    do_sample=False,
                )
            self._cache[key] = out[0, len(prompt) :].tolist()
        return self._cache[key]


def shared_prefix_workload(vocab: int, block_size: int, seed: int = 0):
    """Prompts and per-request ``max_tokens``: a group that extends one 3-block prefix (the first of
    them alone computes and caches it), then unrelated prompts of 4..40 tokens."""
    rng = random.Random(seed)
    prefix = [rng.randrange(5, vocab) for _ in range(3 * block_size)]
    group = [prefix + [rng.randrange(5, vocab) for _ in range(n)] for n in (5, 1, 9, 3)]
    others = [[rng.randrange(5, vocab) for _ in range(rng.randint(4, 40))] for _ in range(10)]
    max_tokens = [8 + i % 13 for i in range(len(group) + len(others))]
    return group, others, max_tokens


class BlockMoves:
    """Counts the block copies the scheduler orders (swap-outs, swap-ins) by wrapping its ``schedule``."""

    def __init__(self, engine) -> None:
        self.swapped_out = 0
        self.swapped_in = 0
        scheduler = engine.scheduler
        schedule = scheduler.schedule

        def counting_schedule():
            out = schedule()
            self.swapped_out += len(out.blocks_to_swap_out)
            self.swapped_in += len(out.blocks_to_swap_in)
            return out

        scheduler.schedule = counting_schedule


def generate_in_two_waves(llm, group, others, max_tokens):
    """Greedy tokens: ``group[0]`` alone (so its prefix is cached), then everything else in one batch.
    Returns the prompts in order, their tokens, and the cached-token count of each."""
    from kvpilot.engine import SamplingParams

    prompts = group + others
    params = [SamplingParams(temperature=0.0, max_tokens=m) for m in max_tokens]
    first = llm.generate([{"prompt_token_ids": group[0]}], params[:1], use_tqdm=False)
    rest = llm.generate([{"prompt_token_ids": p} for p in prompts[1:]], params[1:], use_tqdm=False)
    outs = first + rest
    return prompts, [o.outputs[0].token_ids for o in outs], [o.num_cached_tokens for o in outs]
