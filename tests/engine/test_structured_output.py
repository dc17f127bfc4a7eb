"""Structured outputs and logit_bias in the engine.

* The sampler: ``logit_bias`` moves the choice but not the logprobs (those of the raw logits); a
  mask confines a row to its allowed tokens and leaves the other rows alone; a batch with neither
  takes the one-argmax fast path.
* The grammar compiler: errors at admission with the library's message, a bounded cache.
* The matchers, on the tiny random model: each mask against a brute-force reference (a token is allowed
  iff the text so far plus the token's text can still become one of the choices), outputs that parse
  and validate against their schema, ``n > 1`` siblings with their own matchers, recompute preemption
  (a tiny pool: the outputs equal those of a pool that never preempts), no matcher left after finished
  and aborted requests, unconstrained requests token for token unchanged beside constrained ones.
"""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

from kvpilot.engine import LLM, SamplingParams
from kvpilot.engine.errors import InvalidRequestError, SamplingParamsError
from kvpilot.engine.runner_state import CachedRequestState
from kvpilot.engine.sampler import Sampler, SamplingRow
from kvpilot.engine.sampling_params import StructuredOutputsParams
from kvpilot.engine.structured_output import GrammarCompiler, StructuredOutputs, TokenMasks

VOCAB = 300

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "color": {"enum": ["red", "green", "blue"]},
    },
    "required": ["name", "age", "color"],
    "additionalProperties": False,
}
EMAIL = r"[a-z]{1,6}@[a-z]{1,6}\.(com|org)"


def _logits(seed: int, rows: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, VOCAB, generator=g) * 3


def _row(params: SamplingParams, eos: int | None = None, output: list[int] | None = None) -> SamplingRow:
    return SamplingRow(params, [1, 2, 3], output or [], eos_token_id=eos)


def _bitmask(allowed: list[set[int]], vocab: int = VOCAB) -> torch.Tensor:
    words = torch.zeros(len(allowed), (vocab + 31) // 32, dtype=torch.int64)
    for r, tokens in enumerate(allowed):
        for t in tokens:
            words[r, t // 32] |= 1 << (t % 32)
    # int32 two's complement, as the library stores it
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


# ------------------------------------------------------------------------------------------ parameters
def test_params_validation():
    with pytest.raises(SamplingParamsError, match="exactly one"):
        StructuredOutputsParams()
    with pytest.raises(SamplingParamsError, match="exactly one"):
        StructuredOutputsParams(json={"type": "object"}, regex="a+")
    with pytest.raises(SamplingParamsError, match="at least one"):
        StructuredOutputsParams(choice=[])
    assert StructuredOutputsParams(choice=["a", "b"]).choice == ("a", "b")
    # The schema's key order is kept: properties are generated in the declared order.
    assert StructuredOutputsParams(json={"b": 1, "a": 2}).spec == '{"b":1,"a":2}'
    with pytest.raises(SamplingParamsError, match="structured_outputs must be"):
        SamplingParams(structured_outputs={"json": {}})
    for bias, msg in [
        ({1: 100.5}, r"\[-100, 100\]"),
        ({1: -101}, r"\[-100, 100\]"),
        ({1: float("nan")}, r"\[-100, 100\]"),
        ({"1": 1.0}, "token ids"),
        ({-1: 1.0}, "token ids"),
        ({i: 1.0 for i in range(301)}, "at most 300"),
    ]:
        with pytest.raises(SamplingParamsError, match=msg):
            SamplingParams(logit_bias=bias)
    assert SamplingParams(logit_bias={i: -100 for i in range(300)}).logit_bias[299] == -100
    assert SamplingParams(logit_bias={}).logit_bias is None


# ------------------------------------------------------------------------------------------ sampler
def test_logit_bias_moves_the_choice_not_the_logprobs():
    logits = _logits(0, 3)
    sampler = Sampler(0, torch.device("cpu"))
    plain = [SamplingParams(temperature=0.0, logprobs=5) for _ in range(3)]
    base = sampler(logits.clone(), [_row(p) for p in plain])
    forced = [int(logits[i].argmin()) for i in range(3)]  # the least likely token of each row
    biased_params = [
        SamplingParams(temperature=0.0, logprobs=5, logit_bias={forced[0]: 100}),
        SamplingParams(temperature=0.0, logprobs=5, logit_bias={base.token_ids[1]: -100}),
        SamplingParams(temperature=0.0, logprobs=5),
    ]
    biased = sampler(logits.clone(), [_row(p) for p in biased_params])
    raw = torch.log_softmax(logits, dim=-1)
    assert biased.token_ids[0] == forced[0] != base.token_ids[0]
    assert biased.token_ids[1] != base.token_ids[1]
    assert biased.token_ids[2] == base.token_ids[2]
    for i in range(3):
        # Every logprob returned (the sampled token's and the top 5) is of the raw distribution.
        entry = biased.logprobs[i]
        assert next(iter(entry)) == biased.token_ids[i]
        assert entry == pytest.approx({t: float(raw[i, t]) for t in entry}, abs=1e-6)
        assert set(raw[i].topk(5).indices.tolist()) <= set(entry)


def test_logit_bias_under_sampling_forces_the_token():
    logits = _logits(1, 4)
    sampler = Sampler(0, torch.device("cpu"))
    params = [SamplingParams(temperature=1.0, seed=s, logit_bias={7: 100}) for s in range(4)]
    assert sampler(logits, [_row(p) for p in params]).token_ids == [7, 7, 7, 7]


def test_masks_confine_constrained_rows_only():
    logits = _logits(2, 4)
    sampler = Sampler(0, torch.device("cpu"))
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.0, seed=3),
        SamplingParams(temperature=1.0, seed=4),
        SamplingParams(temperature=0.0, logprobs=3),
    ]
    allowed = [{5, 200, 299}, {31, 32, 63, 64}]
    masks = TokenMasks(rows=[1, 3], bitmask=_bitmask(allowed))
    unmasked = sampler(logits.clone(), [_row(p) for p in params])
    masked = sampler(logits.clone(), [_row(p) for p in params], masks)
    assert masked.token_ids[1] in allowed[0]
    assert masked.token_ids[3] == max(allowed[1], key=lambda t: float(logits[3, t]))
    assert masked.token_ids[0] == unmasked.token_ids[0] and masked.token_ids[2] == unmasked.token_ids[2]
    raw = torch.log_softmax(logits, dim=-1)
    assert masked.logprobs[3][masked.token_ids[3]] == pytest.approx(float(raw[3, masked.token_ids[3]]))
    # Many draws of the masked sampling row never leave its allowed set.
    for seed in range(200):
        row = [_row(SamplingParams(temperature=2.0, seed=seed))]
        out = sampler(logits[1:2].clone(), row, TokenMasks([0], _bitmask([allowed[0]])))
        assert out.token_ids[0] in allowed[0]


def test_a_finished_grammar_ends_despite_min_tokens():
    logits = _logits(3, 1)
    eos = 9
    sampler = Sampler(0, torch.device("cpu"))
    params = SamplingParams(
        temperature=1.0, seed=0, min_tokens=5, structured_outputs=StructuredOutputsParams(regex="a")
    )
    out = sampler(logits, [_row(params, eos=eos)], TokenMasks([0], _bitmask([{eos}])))
    assert out.token_ids == [eos]


def test_a_plain_greedy_batch_takes_the_fast_path(monkeypatch):
    logits = _logits(4, 3)
    sampler = Sampler(0, torch.device("cpu"))

    def no_slow_path(*args, **kwargs):
        raise AssertionError("the fast path was not taken")

    monkeypatch.setattr(Sampler, "_sample", no_slow_path)
    monkeypatch.setattr(Sampler, "apply_masks", no_slow_path)
    monkeypatch.setattr(Sampler, "_apply_logit_bias", no_slow_path)
    out = sampler(logits, [_row(SamplingParams(temperature=0.0)) for _ in range(3)])
    assert out.token_ids == logits.argmax(dim=-1).tolist()
    with pytest.raises(AssertionError, match="fast path"):
        sampler(logits, [_row(SamplingParams(temperature=0.0, logit_bias={1: 1.0}))] * 3)


# ------------------------------------------------------------------------------------------ compiler
@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tokenizer_dir)


def test_compile_errors_name_the_constraint(tokenizer):
    compiler = GrammarCompiler(tokenizer, len(tokenizer), tokenizer.eos_token_id)
    cases = [
        (StructuredOutputsParams(json={"type": "frobnicate"}), r"structured_outputs\.json .*frobnicate"),
        (StructuredOutputsParams(json="{not json"), r"structured_outputs\.json .*JSON"),
        (StructuredOutputsParams(regex="(ab"), r"structured_outputs\.regex .*parenthesis"),
        (StructuredOutputsParams(grammar="root ::= nothing"), r"structured_outputs\.grammar .*nothing"),
    ]
    for so, msg in cases:
        with pytest.raises(InvalidRequestError, match=msg) as info:
            compiler.compile(so)
        assert info.value.param == "structured_outputs"
        assert "/project/" not in str(info.value)  # the library's source location is stripped
    assert len(compiler) == 0
    no_eos = GrammarCompiler(tokenizer, len(tokenizer), None)
    with pytest.raises(InvalidRequestError, match="end-of-sequence"):
        no_eos.compile(StructuredOutputsParams(regex="a"))


def test_grammar_cache_is_a_bounded_lru(tokenizer):
    compiler = GrammarCompiler(tokenizer, len(tokenizer), tokenizer.eos_token_id, cache_size=2)
    a, b, c = (StructuredOutputsParams(regex=r) for r in ("a+", "b+", "c+"))
    first = compiler.compile(a)
    assert compiler.compile(StructuredOutputsParams(regex="a+")) is first
    compiler.compile(b)
    compiler.compile(a)  # a is now the most recent
    compiler.compile(c)  # evicts b
    assert len(compiler) == 2 and compiler.num_compiled == 3
    compiler.compile(a)
    assert compiler.num_compiled == 3
    compiler.compile(b)
    assert compiler.num_compiled == 4
    # Schemas are keyed by their JSON text, whitespace aside.
    compiler.compile(StructuredOutputsParams(json={"type": "object", "required": []}))
    compiler.compile(StructuredOutputsParams(json='{"type":"object","required":[]}'))
    assert compiler.num_compiled == 5


def _byte_tokens(tokenizer) -> dict[int, int]:
    """Byte value -> the byte-level BPE token that is that one byte (GPT-2's byte-to-character map)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    return {b: tokenizer.convert_tokens_to_ids(c) for b, c in chars.items()}


@pytest.mark.parametrize("max_length", [None, 12])
def test_json_strings_refuse_what_json_refuses(tokenizer, max_length):
    """Inside a string (bounded or not): raw control characters and the 3-byte forms of UTF-16
    surrogates (ED A0..BF xx) are masked out, while other multi-byte characters stay allowed."""
    import xgrammar as xgr

    string = {"type": "string"} if max_length is None else {"type": "string", "maxLength": max_length}
    schema = {"type": "object", "properties": {"s": string}, "required": ["s"]}
    compiler = GrammarCompiler(tokenizer, len(tokenizer), tokenizer.eos_token_id)
    byte = _byte_tokens(tokenizer)

    def allowed_after(prefix_bytes: list[int]) -> set[int]:
        matcher = xgr.GrammarMatcher(compiler.compile(StructuredOutputsParams(json=schema)))
        for t in tokenizer.encode('{"s": "', add_special_tokens=False) + [byte[b] for b in prefix_bytes]:
            assert matcher.accept_token(t)
        bitmask = xgr.allocate_token_bitmask(1, len(tokenizer))
        matcher.fill_next_token_bitmask(bitmask)
        return set(torch.nonzero(_unpack(bitmask, len(tokenizer))[0]).flatten().tolist())

    start = allowed_after([])
    assert byte[0x01] not in start and byte[0x1F] not in start and byte[ord("\t")] not in start
    assert byte[ord("a")] in start and byte[0xED] in start and byte[0xE4] in start
    assert byte[0x9F] in allowed_after([0xED]) and byte[0xBD] not in allowed_after([0xED])  # U+D7xx / U+DFxx
    assert byte[0xB8] in allowed_after([0xE4])


def _state(req_id: str, params: SamplingParams, eos: int, output: list[int]) -> CachedRequestState:
    return CachedRequestState(req_id, [1, 2], output, params, eos, [0])


def test_each_mask_matches_a_brute_force_reference(tokenizer):
    """For ``choice``, the allowed tokens are known without the library: a token is allowed iff the
    bytes so far plus its bytes are a prefix of some choice; EOS iff the text is one of them."""
    choices = ["yes", "no", "nothing", "not sure"]
    vocab = len(tokenizer)
    eos = tokenizer.eos_token_id
    so = StructuredOutputsParams(choice=choices)
    outputs = StructuredOutputs(GrammarCompiler(tokenizer, vocab, eos))
    params = SamplingParams(structured_outputs=so)
    special = set(tokenizer.all_special_ids)
    pieces = {
        t: tokenizer.convert_tokens_to_string([tokenizer.convert_ids_to_tokens(t)]).encode()
        for t in range(vocab)
        if t not in special
    }
    choice_bytes = [c.encode() for c in choices]
    for target in ("not sure", "no", "yes"):
        state = _state(f"r-{target}", params, eos, [])
        text = b""
        while True:
            masks = outputs.start([state]).result()
            allowed = set(torch.nonzero(_unpack(masks.bitmask, vocab)[0]).flatten().tolist())
            expected = {
                t for t, p in pieces.items() if p and any(c.startswith(text + p) for c in choice_bytes)
            }
            if text in choice_bytes:
                expected.add(eos)
            assert allowed == expected, (target, text)
            if text == target.encode():
                break
            # Advance by the longest allowed piece that stays on the way to ``target``.
            token = max(
                (t for t in allowed if t != eos and target.encode().startswith(text + pieces[t])),
                key=lambda t: len(pieces[t]),
            )
            state.output_token_ids.append(token)
            text += pieces[token]
    assert outputs.num_matchers == 3
    outputs.release(["r-no", "r-yes", "unknown"])
    assert outputs.num_matchers == 1
    outputs.shutdown()


def _unpack(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    from kvpilot.engine.structured_output import unpack_bitmask

    return unpack_bitmask(bitmask, vocab, torch.device("cpu"))


def test_a_new_state_replays_its_output_tokens(tokenizer):
    """A state sent again (after a preemption) with the same output tokens gets a new matcher that has
    accepted them all: the same mask as the matcher that followed them one by one."""
    eos = tokenizer.eos_token_id
    outputs = StructuredOutputs(GrammarCompiler(tokenizer, len(tokenizer), eos))
    params = SamplingParams(structured_outputs=StructuredOutputsParams(json=PERSON))
    prefix = tokenizer.encode('{"name": "Al", "age": 4', add_special_tokens=False)
    state = _state("r", params, eos, [])
    for token in prefix:
        outputs.start([state]).result()
        state.output_token_ids.append(token)
    followed = outputs.start([state]).result().bitmask.clone()
    again = _state("r", params, eos, list(prefix))  # what the runner holds after a preemption
    replayed = outputs.start([again]).result().bitmask
    fresh = outputs.start([_state("s", params, eos, [])]).result().bitmask
    assert torch.equal(followed, replayed)
    assert not torch.equal(replayed, fresh)
    assert outputs.num_matchers == 2


# ------------------------------------------------------------------------------------------ engine
@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(str(tiny_llama), block_size=8, num_gpu_blocks_override=512, max_model_len=256)


def _flush(llm: LLM) -> None:
    """One more step, so that the runner hears of the requests the last step finished."""
    llm.llm_engine.step()


def test_schema_outputs_parse_and_validate(llm):
    so = StructuredOutputsParams(json=PERSON)
    params = SamplingParams(n=16, temperature=1.0, seed=7, max_tokens=120, structured_outputs=so)
    out = llm.generate("Describe a person:", params, use_tqdm=False)[0]
    texts = [c.text for c in out.outputs]
    for c in out.outputs:
        assert c.finish_reason == "stop", c.text
        jsonschema.validate(json.loads(c.text), PERSON)
        assert list(json.loads(c.text)) == list(PERSON["properties"]), "in the schema's order"
    assert len(set(texts)) > 1, "siblings sample differently"


def test_regex_and_choice_and_siblings_own_matchers(llm):
    engine = llm.llm_engine
    runner_so = engine.runner.structured_output
    params = SamplingParams(
        n=4, temperature=1.0, seed=1, max_tokens=40, structured_outputs=StructuredOutputsParams(regex=EMAIL)
    )
    engine.add_request("email", "Write an email address:", params)
    seen = 0
    final = None
    while engine.has_unfinished_requests():
        seen = max(seen, runner_so.num_matchers)
        for o in engine.step():
            final = o
    assert seen == 4, "each sibling has its own matcher"
    assert all(re.fullmatch(EMAIL, c.text) for c in final.outputs), [c.text for c in final.outputs]
    assert len({c.text for c in final.outputs}) > 1
    choice = StructuredOutputsParams(choice=["alpha", "beta", "gamma delta"])
    out = llm.generate(
        "Pick:", SamplingParams(n=8, seed=2, max_tokens=20, structured_outputs=choice), use_tqdm=False
    )[0]
    assert {c.text for c in out.outputs} <= {"alpha", "beta", "gamma delta"}
    assert all(c.finish_reason == "stop" for c in out.outputs)


def test_ignore_eos_after_the_grammar_ends_emits_only_eos(llm):
    eos = llm.llm_engine.eos_token_id
    so = StructuredOutputsParams(choice=["ok"])
    out = llm.generate(
        "Say ok:",
        SamplingParams(temperature=1.0, seed=0, max_tokens=8, ignore_eos=True, structured_outputs=so),
        use_tqdm=False,
    )[0].outputs[0]
    assert out.text == "ok" and out.finish_reason == "length"
    first_eos = out.token_ids.index(eos)
    assert set(out.token_ids[first_eos:]) == {eos}


def test_admission_errors_queue_nothing(llm):
    engine = llm.llm_engine
    vocab = engine.model_config.vocab_size
    with pytest.raises(InvalidRequestError, match="logit_bias") as info:
        engine.add_request("bad-bias", "x", SamplingParams(logit_bias={vocab: 1.0}))
    assert info.value.param == "logit_bias"
    with pytest.raises(InvalidRequestError, match="structured_outputs.regex") as info:
        engine.add_request(
            "bad-regex", "x", SamplingParams(structured_outputs=StructuredOutputsParams(regex="["))
        )
    assert info.value.param == "structured_outputs"
    assert not engine.has_unfinished_requests()
    _flush(llm)
    assert engine.runner.structured_output.num_matchers == 0


def test_logit_bias_forces_tokens_and_keeps_logprobs(llm):
    prompt = {"prompt_token_ids": [5, 17, 99, 250]}
    base = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=1, logprobs=20), use_tqdm=False)
    first = base[0].outputs[0].logprobs[0]
    target = min(first, key=first.get)  # the 20th most likely token
    assert target != base[0].outputs[0].token_ids[0]
    biased = llm.generate(
        prompt,
        SamplingParams(temperature=0.0, max_tokens=4, logprobs=20, logit_bias={target: 100}, ignore_eos=True),
        use_tqdm=False,
    )[0].outputs[0]
    assert biased.token_ids == [target] * 4
    assert biased.logprobs[0] == pytest.approx(first)


def test_unconstrained_requests_are_unchanged_beside_constrained_ones(tiny_llama):
    llm = LLM(str(tiny_llama), block_size=8, num_gpu_blocks_override=512, max_model_len=256)
    runner_so = llm.llm_engine.runner.structured_output
    plain = [SamplingParams(temperature=1.0, seed=100 + i, max_tokens=24, ignore_eos=True) for i in range(6)]
    prompts = [{"prompt_token_ids": [10 + i, 20 + i, 30]} for i in range(6)]
    alone = llm.generate(prompts, plain, use_tqdm=False)
    # A batch without constraints allocated nothing and started no worker thread.
    assert runner_so.timings.num_steps == 0 and runner_so._pool is None
    so = StructuredOutputsParams(json=PERSON)
    mixed_params = plain + [
        SamplingParams(temperature=1.0, seed=i, max_tokens=60, structured_outputs=so) for i in range(6)
    ]
    mixed = llm.generate(prompts + prompts, mixed_params, use_tqdm=False)
    assert runner_so.timings.num_steps > 0
    for a, b in zip(alone, mixed[:6], strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
    for m in mixed[6:]:
        jsonschema.validate(json.loads(m.outputs[0].text), PERSON)


def test_recompute_preemption_keeps_matchers_in_step(tiny_llama):
    """A pool of 16 blocks of 8 for 12 constrained sequences: constant recompute preemption. Seeded
    samples do not depend on the batch, so the outputs must equal those of a pool that never preempts."""
    so = StructuredOutputsParams(json=PERSON)
    params = [
        SamplingParams(temperature=1.0, seed=i, max_tokens=80, structured_outputs=so) for i in range(12)
    ]
    prompts = [{"prompt_token_ids": [5 + i] * (10 + i)} for i in range(12)]
    roomy = LLM(str(tiny_llama), block_size=8, num_gpu_blocks_override=1024, max_model_len=128)
    expected = [o.outputs[0].token_ids for o in roomy.generate(prompts, params, use_tqdm=False)]
    assert roomy.llm_engine.stats().num_preemptions_total == 0
    tight = LLM(
        str(tiny_llama),
        block_size=8,
        num_gpu_blocks_override=16,
        max_model_len=128,
        max_num_batched_tokens=64,
        preemption_mode="recompute",
    )
    outs = tight.generate(prompts, params, use_tqdm=False)
    assert tight.llm_engine.stats().num_preemptions_total > 0
    assert [o.outputs[0].token_ids for o in outs] == expected
    for o in outs:
        jsonschema.validate(json.loads(o.outputs[0].text), PERSON)
    _flush(tight)
    assert tight.llm_engine.runner.structured_output.num_matchers == 0


def test_finished_and_aborted_requests_release_their_matchers(llm):
    engine = llm.llm_engine
    runner_so = engine.runner.structured_output
    _flush(llm)
    assert runner_so.num_matchers == 0
    so = StructuredOutputsParams(json=PERSON)
    for i in range(4):
        engine.add_request(f"keep-{i}", "x", SamplingParams(seed=i, max_tokens=100, structured_outputs=so))
        engine.add_request(
            f"drop-{i}",
            "y",
            SamplingParams(n=2, seed=i, max_tokens=100, ignore_eos=True, structured_outputs=so),
        )
    for _ in range(3):
        engine.step()
    assert runner_so.num_matchers == 12
    engine.abort_request([f"drop-{i}" for i in range(4)])
    engine.step()
    assert runner_so.num_matchers == 4
    while engine.has_unfinished_requests():
        engine.step()
    _flush(llm)
    assert runner_so.num_matchers == 0
    assert len(engine.runner.requests) == 0


def test_parallel_engines(tiny_llama, llm):
    """Tensor parallel: rank 0 samples in the engine's process, and constrained outputs equal one
    process's. Pipeline parallel: the last stage samples in a worker, so constraints are refused at
    admission, while logit_bias (which travels with the sampling params) still applies."""
    so = StructuredOutputsParams(json=PERSON)
    params = SamplingParams(n=4, temperature=1.0, seed=9, max_tokens=80, structured_outputs=so)
    prompt = {"prompt_token_ids": [7, 8, 9, 10]}
    expected = [c.token_ids for c in llm.generate(prompt, params, use_tqdm=False)[0].outputs]
    kwargs = dict(block_size=8, num_gpu_blocks_override=512, max_model_len=256)
    with LLM(str(tiny_llama), tensor_parallel_size=2, **kwargs) as tp:
        assert [c.token_ids for c in tp.generate(prompt, params, use_tqdm=False)[0].outputs] == expected
    with LLM(str(tiny_llama), pipeline_parallel_size=2, **kwargs) as pp:
        with pytest.raises(InvalidRequestError, match="pipeline parallelism") as info:
            pp.generate(prompt, params, use_tqdm=False)
        assert info.value.param == "structured_outputs"
        biased = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, logit_bias={42: 100})
        assert pp.generate(prompt, biased, use_tqdm=False)[0].outputs[0].token_ids == [42, 42, 42]


def test_finished_rows_allow_only_eos_beside_live_ones(tokenizer):
    """In one step: a row whose grammar has terminated (it accepted EOS: ``ignore_eos``) allows only EOS,
    and the live row after it gets its own mask, the one it gets alone."""
    eos = tokenizer.eos_token_id
    vocab = len(tokenizer)
    outputs = StructuredOutputs(GrammarCompiler(tokenizer, vocab, eos))
    params = SamplingParams(structured_outputs=StructuredOutputsParams(choice=["ok", "fine"]))
    done = _state("done", params, eos, tokenizer.encode("ok", add_special_tokens=False) + [eos])
    alone = outputs.start([_state("alone", params, eos, [])]).result().bitmask
    both = outputs.start([done, _state("live", params, eos, [])]).result().bitmask
    assert torch.nonzero(_unpack(both, vocab)[0]).flatten().tolist() == [eos]
    assert torch.equal(both[1], alone[0])
    assert eos not in torch.nonzero(_unpack(alone, vocab)[0]).flatten().tolist()
