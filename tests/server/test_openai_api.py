"""The OpenAI API through the official client against a live ``kvpilot serve``: the server's greedy
outputs equal the offline engine's, and sampling, n, stop strings, seeds, usage and logprobs behave as
OpenAI's API documents them."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest

from kvpilot import __version__
from kvpilot.engine import SamplingParams

from .conftest import MODEL_NAME

GREEDY = {"temperature": 0.0}
NO_EOS = {"extra_body": {"ignore_eos": True}}


def offline(llm, prompt, **params):
    return llm.generate(prompt, SamplingParams(**params), use_tqdm=False)[0]


def test_models_and_version(server):
    client = server.client()
    assert [m.id for m in client.models.list().data] == [MODEL_NAME]
    card = client.models.retrieve(MODEL_NAME)
    assert (card.id, card.object, card.owned_by) == (MODEL_NAME, "model", "kvpilot")
    with pytest.raises(openai.NotFoundError) as err:
        client.models.retrieve("no-such-model")
    assert err.value.response.json()["error"]["code"] == "model_not_found"
    assert httpx.get(f"{server.url}/version").json() == {"version": __version__}


def test_completion_greedy_matches_offline(server, offline_llm, tokenizer):
    prompt = "def fibonacci(n):\n    "
    ref = offline(offline_llm, prompt, temperature=0.0, max_tokens=24, ignore_eos=True).outputs[0]
    client = server.client()
    resp = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=24, **GREEDY, **NO_EOS)
    choice = resp.choices[0]
    assert choice.text == ref.text
    assert choice.finish_reason == "length"
    assert resp.model == MODEL_NAME and resp.object == "text_completion" and resp.id.startswith("cmpl-")
    assert resp.usage.prompt_tokens == len(tokenizer.encode(prompt))
    assert resp.usage.completion_tokens == 24 == len(ref.token_ids)
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + 24

    # The same prompt as token ids gives the same completion.
    by_ids = client.completions.create(
        model=MODEL_NAME, prompt=tokenizer.encode(prompt), max_tokens=24, **GREEDY, **NO_EOS
    )
    assert by_ids.choices[0].text == ref.text

    chunks = list(
        client.completions.create(
            model=MODEL_NAME,
            prompt=prompt,
            max_tokens=24,
            stream=True,
            stream_options={"include_usage": True},
            **GREEDY,
            **NO_EOS,
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == ref.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == [
        "length"
    ]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 24
    assert all(c.usage is None for c in chunks[:-1])
    assert len({c.id for c in chunks}) == 1


def test_chat_greedy_matches_offline(server, offline_llm):
    messages = [
        {"role": "system", "content": "You answer briefly."},
        {"role": "user", "content": "Name a prime."},
    ]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    ref = offline_llm.chat(messages, params, use_tqdm=False)[0]
    client = server.client()
    resp = client.chat.completions.create(
        model=MODEL_NAME, messages=messages, max_tokens=16, **GREEDY, **NO_EOS
    )
    choice = resp.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content == ref.outputs[0].text
    assert choice.finish_reason == "length"
    assert resp.object == "chat.completion" and resp.id.startswith("chatcmpl-")
    assert resp.usage.prompt_tokens == len(ref.prompt_token_ids)
    assert resp.usage.completion_tokens == 16

    chunks = list(
        client.chat.completions.create(
            model=MODEL_NAME,
            messages=messages,
            max_tokens=16,
            stream=True,
            stream_options={"include_usage": True},
            **GREEDY,
            **NO_EOS,
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ref.outputs[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == [
        "length"
    ]
    assert chunks[-1].usage.prompt_tokens == len(ref.prompt_token_ids)
    assert chunks[-1].usage.completion_tokens == 16

    # Content given as text parts is joined with newlines before templating.
    parts = [
        messages[0],
        {"role": "user", "content": [{"type": "text", "text": "Name"}, {"type": "text", "text": "a prime."}]},
    ]
    joined = [messages[0], {"role": "user", "content": "Name\na prime."}]
    via_parts = client.chat.completions.create(
        model=MODEL_NAME, messages=parts, max_tokens=8, **GREEDY, **NO_EOS
    )
    expected = offline_llm.chat(
        joined, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False
    )[0]
    assert via_parts.choices[0].message.content == expected.outputs[0].text


def test_n2_seeded_sampling_matches_offline_and_streams(server, offline_llm):
    prompt = "import os\nimport sys\n"
    client = server.client()
    kwargs = dict(model=MODEL_NAME, prompt=prompt, n=2, max_tokens=12, temperature=1.0, seed=7, **NO_EOS)
    resp = client.completions.create(**kwargs)
    texts = {c.index: c.text for c in resp.choices}
    assert sorted(texts) == [0, 1]
    assert texts[0] != texts[1]  # siblings draw different samples
    assert resp.usage.completion_tokens == 24
    ref = offline(offline_llm, prompt, n=2, temperature=1.0, seed=7, max_tokens=12, ignore_eos=True)
    assert [o.text for o in ref.outputs] == [texts[0], texts[1]]

    streamed = {0: "", 1: ""}
    finishes = {}
    for chunk in client.completions.create(**kwargs, stream=True):
        for c in chunk.choices:
            streamed[c.index] += c.text
            if c.finish_reason:
                finishes[c.index] = c.finish_reason
    assert streamed == texts
    assert finishes == {0: "length", 1: "length"}

    chat = client.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "hi"}],
        n=2,
        max_tokens=6,
        temperature=1.0,
        seed=3,
        **NO_EOS,
    )
    assert sorted(c.index for c in chat.choices) == [0, 1]
    assert chat.usage.completion_tokens == 12


def test_seed_reproducibility(server):
    client = server.client()

    def sample(seed: int) -> str:
        return (
            client.completions.create(
                model=MODEL_NAME,
                prompt="class Config:",
                max_tokens=16,
                temperature=1.0,
                top_p=0.95,
                seed=seed,
                **NO_EOS,
            )
            .choices[0]
            .text
        )

    first = sample(1234)
    assert sample(1234) == first
    assert sample(4321) != first


def test_stop_strings(server):
    client = server.client()
    prompt = "for i in range(10):\n"
    base = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=40, **GREEDY, **NO_EOS)
    text = base.choices[0].text
    assert len(text) > 20, text
    stop = text[12:15]
    cut = text.index(stop)
    assert cut > 0

    resp = client.completions.create(
        model=MODEL_NAME, prompt=prompt, max_tokens=40, stop=["@@never@@", stop], **GREEDY, **NO_EOS
    )
    choice = resp.choices[0]
    assert choice.text == text[:cut]
    assert choice.finish_reason == "stop"
    assert choice.model_extra["stop_reason"] == stop
    assert resp.usage.completion_tokens < 40

    kept = client.completions.create(
        model=MODEL_NAME,
        prompt=prompt,
        max_tokens=40,
        stop=stop,
        extra_body={"ignore_eos": True, "include_stop_str_in_output": True},
        **GREEDY,
    )
    assert kept.choices[0].text == text[: cut + len(stop)]

    chunks = list(
        client.completions.create(
            model=MODEL_NAME, prompt=prompt, max_tokens=40, stop=[stop], stream=True, **GREEDY, **NO_EOS
        )
    )
    assert "".join(c.choices[0].text for c in chunks) == text[:cut]
    assert chunks[-1].choices[0].finish_reason == "stop"

    chat_base = (
        client.chat.completions.create(
            model=MODEL_NAME, messages=[{"role": "user", "content": "go"}], max_tokens=40, **GREEDY, **NO_EOS
        )
        .choices[0]
        .message.content
    )
    chat_stop = chat_base[10:13]
    chat = client.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "go"}],
        max_tokens=40,
        stop=[chat_stop],
        **GREEDY,
        **NO_EOS,
    )
    assert chat.choices[0].message.content == chat_base[: chat_base.index(chat_stop)]
    assert chat.choices[0].finish_reason == "stop"


def test_completion_logprobs_match_offline(server, offline_llm):
    prompt = "while True:\n"
    ref = offline(offline_llm, prompt, temperature=0.0, max_tokens=6, logprobs=3, ignore_eos=True).outputs[0]
    client = server.client()
    resp = client.completions.create(
        model=MODEL_NAME, prompt=prompt, max_tokens=6, logprobs=3, **GREEDY, **NO_EOS
    )
    lp = resp.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 6
    for i, (tid, entry) in enumerate(zip(ref.token_ids, ref.logprobs, strict=True)):
        assert lp.token_logprobs[i] == pytest.approx(entry[tid], abs=1e-4)
        assert lp.token_logprobs[i] == pytest.approx(max(lp.top_logprobs[i].values()), abs=1e-6)  # greedy
        assert 1 <= len(lp.top_logprobs[i]) <= 4
        assert lp.token_logprobs[i] <= 0.0
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(6)]

    streamed = []
    for chunk in client.completions.create(
        model=MODEL_NAME, prompt=prompt, max_tokens=6, logprobs=3, stream=True, **GREEDY, **NO_EOS
    ):
        if chunk.choices[0].logprobs is not None:
            streamed += chunk.choices[0].logprobs.token_logprobs
    assert streamed == pytest.approx(lp.token_logprobs, abs=1e-6)


def test_chat_logprobs_match_offline(server, offline_llm):
    messages = [{"role": "user", "content": "Count to three."}]
    ref = offline_llm.chat(
        messages, SamplingParams(temperature=0.0, max_tokens=6, logprobs=2, ignore_eos=True), use_tqdm=False
    )[0].outputs[0]
    client = server.client()
    resp = client.chat.completions.create(
        model=MODEL_NAME, messages=messages, max_tokens=6, logprobs=True, top_logprobs=2, **GREEDY, **NO_EOS
    )
    content = resp.choices[0].logprobs.content
    assert len(content) == 6
    for item, tid, entry in zip(content, ref.token_ids, ref.logprobs, strict=True):
        assert item.logprob == pytest.approx(entry[tid], abs=1e-4)
        assert len(item.top_logprobs) == 2
        assert item.top_logprobs[0].logprob == pytest.approx(item.logprob, abs=1e-6)  # greedy: the best token
        assert item.top_logprobs[0].logprob >= item.top_logprobs[1].logprob
        assert item.bytes == list(item.token.encode("utf-8"))

    streamed = []
    for chunk in client.chat.completions.create(
        model=MODEL_NAME,
        messages=messages,
        max_tokens=6,
        logprobs=True,
        top_logprobs=2,
        stream=True,
        **GREEDY,
        **NO_EOS,
    ):
        if chunk.choices and chunk.choices[0].logprobs is not None:
            streamed += [c.logprob for c in chunk.choices[0].logprobs.content]
    assert streamed == pytest.approx([c.logprob for c in content], abs=1e-6)


def test_batched_prompts_and_echo(server, offline_llm, tokenizer):
    prompts = ["# first\n", "# second prompt\n"]
    client = server.client()
    resp = client.completions.create(model=MODEL_NAME, prompt=prompts, max_tokens=5, **GREEDY, **NO_EOS)
    by_index = {c.index: c.text for c in resp.choices}
    refs = [
        offline(offline_llm, p, temperature=0.0, max_tokens=5, ignore_eos=True).outputs[0].text
        for p in prompts
    ]
    assert by_index == {0: refs[0], 1: refs[1]}
    assert resp.usage.prompt_tokens == sum(len(tokenizer.encode(p)) for p in prompts)
    assert resp.usage.completion_tokens == 10

    echoed = client.completions.create(
        model=MODEL_NAME, prompt=prompts[0], max_tokens=5, echo=True, **GREEDY, **NO_EOS
    )
    assert echoed.choices[0].text == prompts[0] + refs[0]


def test_sse_wire_format_and_request_id(server):
    body = {"model": MODEL_NAME, "prompt": "x = ", "max_tokens": 4, "temperature": 0, "stream": True}
    with httpx.stream(
        "POST",
        f"{server.url}/v1/completions",
        json=body,
        timeout=30,
        headers={**server.headers(), "X-Request-Id": "trace-abc-123"},
    ) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        assert response.headers["x-request-id"] == "trace-abc-123"
        lines = [line for line in response.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines)
    assert lines[-1] == "data: [DONE]"
    assert lines.count("data: [DONE]") == 1
    generated = httpx.get(f"{server.url}/health").headers["x-request-id"]
    assert len(generated) == 32 and int(generated, 16) >= 0


def test_concurrent_streams_complete(server, offline_llm):
    num_streams = 16
    prompts = [f"# task {i}: " + "x" * (i % 5) for i in range(num_streams)]

    async def one(client: openai.AsyncOpenAI, prompt: str) -> tuple[str, str | None, int]:
        text, finish, usage = "", None, 0
        stream = await client.completions.create(
            model=MODEL_NAME,
            prompt=prompt,
            max_tokens=8,
            stream=True,
            stream_options={"include_usage": True},
            **GREEDY,
            **NO_EOS,
        )
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].text
                finish = chunk.choices[0].finish_reason or finish
            if chunk.usage:
                usage = chunk.usage.completion_tokens
        return text, finish, usage

    async def run_all():
        async with server.async_client() as client:
            return await asyncio.gather(*(one(client, p) for p in prompts))

    results = asyncio.run(run_all())
    refs = offline_llm.generate(
        prompts, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False
    )
    assert [r[1] for r in results] == ["length"] * num_streams
    assert [r[2] for r in results] == [8] * num_streams
    assert [r[0] for r in results] == [ref.outputs[0].text for ref in refs]
