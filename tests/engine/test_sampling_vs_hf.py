"""The sampler against references outside the engine.

* The processed distribution (``Sampler.apply_penalties`` then ``Sampler.sampling_probs``, the steps the
  sampler runs) against transformers' own logits processors on the same logits and token histories, at
  ordinary settings. Our documented order (repetition penalty -> temperature -> top-k -> top-p -> min-p) is
  transformers' ``generate`` order, so combinations are compared in that order too. Presence and
  frequency penalties have no transformers processor: they are checked against OpenAI's formula.
* Returned logprobs against transformers' ``log_softmax`` of the model's logits.
* Seeded draws against the distribution they sample, over a few thousand draws.
"""

from __future__ import annotations

import math
import random
from collections import Counter

import pytest
import torch
import transformers
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from kvpilot.engine import LLM, SamplingParams
from kvpilot.engine.sampler import PenaltyCounts, Sampler, SamplingRow

PROBS_ATOL = 1e-6  # float32: both sides compute the same softmax, observed differences ~1e-8
LOGPROBS_ATOL = 1e-4  # float32 through the whole model, as the logits comparison in test_llm_vs_hf
NUM_SIGMAS = 5  # binomial interval for the draw frequencies (the draws are seeded: no flakes)

VOCAB = 1000
NUM_ROWS = 6
HISTORY = 40  # tokens of prompt + output per row; the vocabulary is small enough for repeats


def _logits(seed: int = 0, rows: int = NUM_ROWS, scale: float = 2.0) -> torch.Tensor:
    """[rows, VOCAB] float32 logits with a realistic spread (a few dominant tokens, a long tail).

    Drawn by Python's ``random``, not ``torch.randn``: torch's normal sampler takes a vectorised path
    chosen by the CPU's ISA, and the same inputs on every machine keep a failure reproducible anywhere."""
    rng = random.Random(seed)
    return torch.tensor([[rng.gauss(0.0, scale) for _ in range(VOCAB)] for _ in range(rows)])


def _histories(seed: int = 0) -> torch.Tensor:
    """[NUM_ROWS, HISTORY] token ids, drawn from the first 60 ids so that tokens repeat."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 60, (NUM_ROWS, HISTORY), generator=g)


def _rows(params: list[SamplingParams], histories: torch.Tensor, num_prompt: int = 25) -> list[SamplingRow]:
    """One row per params; each history's first ``num_prompt`` tokens are the prompt, the rest output."""
    return [
        SamplingRow(p, h[:num_prompt].tolist(), h[num_prompt:].tolist(), eos_token_id=None)
        for p, h in zip(params, histories, strict=True)
    ]


def _ours(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """The engine's normalised sampling distribution per row."""
    x = logits.clone()
    Sampler.apply_penalties(x, rows)
    probs = Sampler.sampling_probs(x, [r.params for r in rows])
    return probs / probs.sum(dim=-1, keepdim=True)


def _hf(logits: torch.Tensor, histories: torch.Tensor, processors: list) -> torch.Tensor:
    """transformers' distribution: its processors in the given order, then a softmax."""
    scores = logits.clone()
    for proc in processors:
        scores = proc(histories, scores)
    return torch.softmax(scores, dim=-1)


def _assert_same_distribution(ours: torch.Tensor, ref: torch.Tensor) -> None:
    kept_ours, kept_ref = ours > 0, ref > 0
    for i in range(ours.shape[0]):
        diff = (kept_ours[i] ^ kept_ref[i]).nonzero().flatten().tolist()
        assert not diff, f"row {i}: tokens kept by one side only: {diff[:10]}"
    torch.testing.assert_close(ours, ref, atol=PROBS_ATOL, rtol=0)


# Each case: our params, and transformers' processors in its own ``generate`` order.
CASES = {
    "temperature 0.7": (dict(temperature=0.7), [TemperatureLogitsWarper(0.7)]),
    "top_k 50": (dict(temperature=1.0, top_k=50), [TopKLogitsWarper(50)]),
    "top_p 0.9": (dict(temperature=1.0, top_p=0.9), [TopPLogitsWarper(0.9)]),
    "top_p 0.5": (dict(temperature=1.0, top_p=0.5), [TopPLogitsWarper(0.5)]),
    "min_p 0.05": (dict(temperature=1.0, min_p=0.05), [MinPLogitsWarper(0.05)]),
    "repetition 1.1": (dict(repetition_penalty=1.1), [RepetitionPenaltyLogitsProcessor(1.1)]),
    "repetition 1.3": (dict(repetition_penalty=1.3), [RepetitionPenaltyLogitsProcessor(1.3)]),
    "temperature 1.3, top_k 50, top_p 0.9": (
        dict(temperature=1.3, top_k=50, top_p=0.9),
        [TemperatureLogitsWarper(1.3), TopKLogitsWarper(50), TopPLogitsWarper(0.9)],
    ),
    "all: repetition 1.2, temperature 0.8, top_k 50, top_p 0.9, min_p 0.05": (
        dict(temperature=0.8, top_k=50, top_p=0.9, min_p=0.05, repetition_penalty=1.2),
        [
            RepetitionPenaltyLogitsProcessor(1.2),
            TemperatureLogitsWarper(0.8),
            TopKLogitsWarper(50),
            TopPLogitsWarper(0.9),
            MinPLogitsWarper(0.05),
        ],
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_processed_distribution_matches_transformers(case):
    kwargs, processors = CASES[case]
    logits, histories = _logits(), _histories()
    ours = _ours(logits, _rows([SamplingParams(**kwargs)] * NUM_ROWS, histories))
    ref = _hf(logits, histories, processors)
    _assert_same_distribution(ours, ref)
    # The filters really filter at these settings (a mask that keeps everything proves nothing).
    if "top" in case or "min_p" in case:
        kept = (ours > 0).sum(dim=-1)
        assert bool((kept > 1).all()) and bool((kept < VOCAB // 2).all()), kept.tolist()


def test_a_batch_of_different_settings_matches_each_row_alone():
    """The vectorised batch applies each row's own settings: every row equals transformers on that row."""
    logits, histories = _logits(seed=1), _histories(seed=1)
    names = list(CASES)[: NUM_ROWS - 1] + [list(CASES)[-1]]
    rows = _rows([SamplingParams(**CASES[n][0]) for n in names], histories)
    ours = _ours(logits, rows)
    for i, name in enumerate(names):
        ref = _hf(logits[i : i + 1], histories[i : i + 1], CASES[name][1])
        _assert_same_distribution(ours[i : i + 1], ref)


def test_a_row_without_top_p_keeps_every_token_beside_a_row_with_it():
    """A batch where one row filters by top-p and the others do not (top_p 1): those keep all the
    vocabulary, exactly softmax(logits). With a widely spread row, a float32 running sum of the
    descending probabilities reaches 1.0 before the last tokens (about 60 % of these rows on every ISA
    tried), so a filter that cuts where "the mass before a token reaches top_p" with top_p = 1 drops the
    tail of exactly these rows."""
    rows = 32
    logits = _logits(seed=5, rows=rows, scale=3.0)
    params = [SamplingParams(temperature=1.0, top_p=0.9)] + [SamplingParams(temperature=1.0)] * (rows - 1)
    ours = _ours(logits, _rows(params, _histories(seed=5).repeat(rows // NUM_ROWS + 1, 1)[:rows]))
    assert int((ours[1:] > 0).sum()) == (rows - 1) * VOCAB
    torch.testing.assert_close(ours[1:], torch.softmax(logits[1:], dim=-1), atol=PROBS_ATOL, rtol=0)
    ref = _hf(logits[:1], _histories(seed=5)[:1], [TopPLogitsWarper(0.9)])
    _assert_same_distribution(ours[:1], ref)
    assert 1 < int((ours[0] > 0).sum()) < VOCAB // 2


def test_repetition_penalty_logits_equal_transformers():
    logits, histories = _logits(seed=2), _histories(seed=2)
    for penalty in (1.1, 1.3, 0.8):
        ours = logits.clone()
        rows = _rows([SamplingParams(repetition_penalty=penalty)] * NUM_ROWS, histories)
        Sampler.apply_penalties(ours, rows)
        ref = RepetitionPenaltyLogitsProcessor(penalty)(histories, logits.clone())
        torch.testing.assert_close(ours, ref, atol=0, rtol=0)
        assert not torch.equal(ours, logits)


@pytest.mark.parametrize(("presence", "frequency"), [(0.5, 0.0), (0.0, 0.3), (0.6, 0.4), (-0.5, 1.5)])
def test_presence_and_frequency_penalties_follow_openai_formula(presence, frequency):
    """OpenAI: ``mu[j] - c[j] * a_frequency - (c[j] > 0) * a_presence``, ``c`` counting output tokens only."""
    logits, histories = _logits(seed=3), _histories(seed=3)
    params = SamplingParams(presence_penalty=presence, frequency_penalty=frequency, repetition_penalty=1.2)
    rows = _rows([params] * NUM_ROWS, histories)
    ours = logits.clone()
    Sampler.apply_penalties(ours, rows)
    repetition_only = RepetitionPenaltyLogitsProcessor(1.2)(histories, logits.clone())  # applied first
    ref = repetition_only.clone()
    for i, row in enumerate(rows):
        for token, count in Counter(row.output_token_ids).items():
            ref[i, token] -= count * frequency + presence
    torch.testing.assert_close(ours, ref, atol=1e-6, rtol=0)
    # Prompt-only tokens are untouched by presence/frequency (only the repetition penalty hits them).
    prompt_only = set(rows[0].prompt_token_ids) - set(rows[0].output_token_ids)
    assert prompt_only
    for token in prompt_only:
        assert ours[0, token] == repetition_only[0, token]


# ---------------------------------------------------------------------------------------------- logprobs


def test_penalty_counts_kept_across_steps_equal_counts_built_each_step():
    """The runner's counts, updated one output token at a step, give the same penalised logits, bit for
    bit, as counts built from the whole sequence at every step (what transformers' processors see)."""
    params = SamplingParams(
        temperature=1.0, repetition_penalty=1.3, presence_penalty=0.4, frequency_penalty=0.2
    )
    history = _histories(seed=3)[0].tolist()
    prompt, outputs = history[:25], []
    kept = PenaltyCounts(VOCAB, torch.device("cpu"), prompt)
    for step, token in enumerate(history[25:]):
        logits = _logits(seed=step, rows=1)
        fresh, cached = logits.clone(), logits.clone()
        Sampler.apply_penalties(fresh, [SamplingRow(params, prompt, outputs, None)])
        Sampler.apply_penalties(cached, [SamplingRow(params, prompt, outputs, None, penalties=kept)])
        assert torch.equal(fresh, cached), f"step {step}"
        assert kept.num_counted == len(outputs)
        outputs.append(token)
    assert int(kept.counts.sum()) == len(outputs) - 1  # the last token was appended after the last step


@pytest.fixture(scope="module")
def hf_llama(tiny_llama):
    return transformers.AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()


def test_logprobs_equal_transformers_log_softmax(tiny_llama, hf_llama):
    """Sampled-token and top-k logprobs are transformers' ``log_softmax`` of the raw logits at each position
    (the penalties and filters shape the draw, not the reported logprobs)."""
    llm = LLM(str(tiny_llama), block_size=8, num_gpu_blocks_override=128)
    rng = random.Random(11)
    prompt = [rng.randrange(5, len(llm.get_tokenizer())) for _ in range(37)]
    k = 5
    params = SamplingParams(
        temperature=1.0, top_k=50, top_p=0.95, repetition_penalty=1.1, seed=99, max_tokens=16, logprobs=k
    )
    out = llm.generate({"prompt_token_ids": prompt}, params)[0].outputs[0]
    tokens = out.token_ids
    assert len(tokens) == len(out.logprobs) == 16
    with torch.no_grad():
        logits = hf_llama(torch.tensor([prompt + tokens])).logits[0].float()
    ref = torch.log_softmax(logits[len(prompt) - 1 : len(prompt) + len(tokens) - 1], dim=-1)
    num_not_top1 = 0
    for j, (tok, entry) in enumerate(zip(tokens, out.logprobs, strict=True)):
        assert next(iter(entry)) == tok, f"step {j}: the sampled token comes first"
        assert entry[tok] == pytest.approx(ref[j, tok].item(), abs=LOGPROBS_ATOL), f"step {j}"
        top_values, top_ids = ref[j].topk(k)
        assert set(entry) == set(top_ids.tolist()) | {tok}, f"step {j}"
        for t, v in zip(top_ids.tolist(), top_values.tolist(), strict=True):
            assert entry[t] == pytest.approx(v, abs=LOGPROBS_ATOL), f"step {j}, token {t}"
        num_not_top1 += tok != top_ids[0].item()
    # Sampling really picked tokens other than the argmax, so their logprobs were checked too.
    assert num_not_top1 > 0
    assert out.cumulative_logprob == pytest.approx(
        sum(ref[j, t].item() for j, t in enumerate(tokens)), abs=LOGPROBS_ATOL * len(tokens)
    )


# ------------------------------------------------------------------------------------- draw statistics

FIXED_PROBS = [0.4, 0.3, 0.15, 0.1, 0.05]
NUM_DRAWS = 4000


def _frequencies(params: list[SamplingParams]) -> list[float]:
    """Draw once per params from FIXED_PROBS through ``Sampler``; the frequency of each token."""
    logits = torch.tensor(FIXED_PROBS).log().expand(len(params), -1).contiguous()
    rows = [SamplingRow(p, [1], [], eos_token_id=None) for p in params]
    counts = Counter(Sampler(seed=0, device=torch.device("cpu"))(logits, rows).token_ids)
    return [counts[t] / len(params) for t in range(len(FIXED_PROBS))]


def _expected(kept: list[int]) -> list[float]:
    mass = sum(FIXED_PROBS[t] for t in kept)
    return [FIXED_PROBS[t] / mass if t in kept else 0.0 for t in range(len(FIXED_PROBS))]


@pytest.mark.parametrize(
    ("filters", "kept"),
    [
        ({}, [0, 1, 2, 3, 4]),
        ({"top_k": 2}, [0, 1]),
        ({"top_p": 0.8}, [0, 1, 2]),  # .4 + .3 < .8: the crossing token (.15) is kept, .1 and .05 are not
        ({"min_p": 0.2}, [0, 1, 2, 3]),  # below .2 * .4 = .08: only .05
        ({"temperature": 0.5, "top_k": 3}, [0, 1, 2]),
    ],
)
@pytest.mark.parametrize("seeded", [True, False])
def test_draw_frequencies_within_binomial_interval(filters, kept, seeded):
    """Across NUM_DRAWS draws (one seed each, or the engine's generator), each token's frequency is within
    NUM_SIGMAS binomial standard deviations of its probability; filtered-out tokens never appear."""
    temperature = filters.get("temperature", 1.0)
    base = {k: v for k, v in filters.items() if k != "temperature"}
    params = [
        SamplingParams(temperature=temperature, seed=s if seeded else None, **base) for s in range(NUM_DRAWS)
    ]
    freqs = _frequencies(params)
    expected = _expected(kept)
    if temperature != 1.0:
        scaled = [FIXED_PROBS[t] ** (1 / temperature) if t in kept else 0.0 for t in range(len(FIXED_PROBS))]
        expected = [s / sum(scaled) for s in scaled]
    for t, (f, p) in enumerate(zip(freqs, expected, strict=True)):
        if p == 0.0:
            assert f == 0.0, f"token {t} was filtered out but drawn"
            continue
        bound = NUM_SIGMAS * math.sqrt(p * (1 - p) / NUM_DRAWS)
        assert abs(f - p) <= bound, f"token {t}: frequency {f:.4f}, probability {p:.4f}, bound {bound:.4f}"


def test_draws_are_reproducible_per_seed_and_output_index():
    """The same (seed, output index) draws the same token; over output indices the draws still follow the
    distribution (a few hundred indices of one seed)."""
    n = 400
    logits = torch.tensor(FIXED_PROBS).log().expand(n, -1).contiguous()
    rows = [SamplingRow(SamplingParams(temperature=1.0, seed=7), [1], [2] * i, None) for i in range(n)]
    first = Sampler(seed=0, device=torch.device("cpu"))(logits, rows).token_ids
    again = Sampler(seed=123, device=torch.device("cpu"))(logits, rows).token_ids
    assert first == again  # the engine generator's seed does not matter to a seeded request
    counts = Counter(first)
    for t, p in enumerate(FIXED_PROBS):
        assert abs(counts[t] / n - p) <= NUM_SIGMAS * math.sqrt(p * (1 - p) / n), (t, counts[t])
