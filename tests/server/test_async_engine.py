"""AsyncEngine and the app in-process, over a real tiny engine: aborts stop generation and free the
blocks, refused requests leave no trace, slow consumers get merged deltas, and a dead engine loop fails
every waiter and turns /health to 503 instead of hanging."""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
import pytest

from kvpilot.engine.async_engine import AsyncEngine, PromptInput
from kvpilot.engine.config import EngineArgs
from kvpilot.engine.errors import EngineDeadError, InvalidRequestError, QueueFullError
from kvpilot.engine.llm_engine import LLMEngine
from kvpilot.engine.metrics import PrometheusStatLogger
from kvpilot.engine.sampling_params import SamplingParams
from kvpilot.engine.server.app import build_app
from kvpilot.engine.server.serving import ServerState
from kvpilot.engine.stats import StepCallback

NUM_BLOCKS = 64


@pytest.fixture
def engine(tiny_llama) -> LLMEngine:
    return LLMEngine(EngineArgs(model=str(tiny_llama), num_gpu_blocks_override=NUM_BLOCKS, device="cpu"))


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


async def wait_idle(engine: LLMEngine, timeout_s: float = 1.0) -> None:
    deadline = time.monotonic() + timeout_s
    while engine.has_unfinished_requests():
        assert time.monotonic() < deadline, "the engine still has requests"
        await asyncio.sleep(0.002)


def test_abort_frees_blocks_at_once(engine):
    prompt = engine.tokenizer.encode("def handler(event, context):")

    sampled: list[int] = []
    engine.stat_loggers.append(StepCallback(lambda _sched, it: sampled.append(it.num_generation_tokens)))

    async def main():
        ae = AsyncEngine(engine)
        ae.start()
        try:
            gen = ae.generate("r1", prompt, greedy(400), stream=True)
            first = await gen.__anext__()
            assert first.delta_token_ids[0]
            assert engine.block_manager.num_free_blocks < NUM_BLOCKS
            await gen.aclose()  # the consumer leaves: the request is aborted
            # Generous wait (a loaded machine is slow); a request left to run would reach all 400 tokens.
            await wait_idle(engine, timeout_s=60.0)
            assert 1 <= sum(sampled) < 400, sum(sampled)
            assert engine.block_manager.num_free_blocks == NUM_BLOCKS
            assert ae.is_healthy
        finally:
            ae.shutdown()

    asyncio.run(main())


def test_refused_requests_leave_no_trace(engine):
    good = PromptInput("good", engine.tokenizer.encode("x = 1"), greedy(4), time.monotonic())
    bad = PromptInput("bad", [engine.model_config.vocab_size + 7], greedy(4), time.monotonic())

    async def main():
        ae = AsyncEngine(engine)
        ae.start()
        try:
            with pytest.raises(InvalidRequestError, match="prompt token ids"):
                await ae.add([good, bad], stream=False)  # all or none: "good" is withdrawn too
            assert not engine.has_unfinished_requests()
            assert engine.block_manager.num_free_blocks == NUM_BLOCKS
            rs = await ae.add(
                [PromptInput("again", good.prompt_token_ids, greedy(4), time.monotonic())], False
            )
            final = await rs.collect()
            assert len(final["again"].outputs[0].token_ids) == 4
        finally:
            ae.shutdown()

        full = AsyncEngine(engine, max_waiting_requests=0)
        full.start()
        try:
            with pytest.raises(QueueFullError) as err:
                await full.add([PromptInput("q", good.prompt_token_ids, greedy(4), time.monotonic())], False)
            assert err.value.retry_after_s == 1
            assert not engine.has_unfinished_requests()
            # A request that can never run is refused as such, whatever the queue (400 before 503); so
            # is an id given twice in one call.
            with pytest.raises(InvalidRequestError, match="prompt token ids"):
                await full.add([bad], False)
            with pytest.raises(InvalidRequestError, match="duplicate request id 'twice'"):
                twice = PromptInput("twice", good.prompt_token_ids, greedy(4), time.monotonic())
                await full.add([twice, twice], False)
            # ... or a sibling's id of another prompt of the same call.
            with pytest.raises(InvalidRequestError, match="duplicate request id 'p#1'"):
                pair = PromptInput("p", good.prompt_token_ids, SamplingParams(n=2, max_tokens=4), 0.0)
                await full.add([pair, PromptInput("p#1", good.prompt_token_ids, greedy(4), 0.0)], False)
            assert not engine.has_unfinished_requests()
        finally:
            full.shutdown()

    asyncio.run(main())


def test_slow_consumer_gets_merged_deltas(engine):
    prompt = engine.tokenizer.encode("import json\n")

    async def main():
        ae = AsyncEngine(engine)
        ae.start()
        try:
            rs = await ae.add([PromptInput("slow", prompt, greedy(30), time.monotonic())], stream=True)
            await wait_idle(engine, timeout_s=30.0)  # everything generated before the first read
            batches = [outs async for outs in rs]
        finally:
            ae.shutdown()
        assert len(batches) == 1  # 30 steps' outputs merged into one
        (out,) = batches[0]
        assert out.finished
        assert out.delta_token_ids[0] == out.outputs[0].token_ids and len(out.delta_token_ids[0]) == 30
        assert out.delta_text[0] == out.outputs[0].text

    asyncio.run(main())


def failing_server(engine: LLMEngine, monkeypatch, num_good_steps: int, message: str):
    """(ServerState, app) over ``engine``, whose step raises ``RuntimeError(message)`` after
    ``num_good_steps`` steps."""
    real_step = engine.step
    calls = []

    def failing_step():
        calls.append(1)
        if len(calls) > num_good_steps:
            raise RuntimeError(message)
        return real_step()

    monkeypatch.setattr(engine, "step", failing_step)
    metrics = PrometheusStatLogger.from_engine(engine, "tiny")
    monkeypatch.setattr(engine, "stat_loggers", [metrics])  # as launch.py attaches it
    state = ServerState(
        engine=AsyncEngine(engine),
        tokenizer=engine.tokenizer,
        served_model_names=["tiny"],
        model_dir=engine.model_dir,
        max_model_len=engine.max_model_len,
        metrics=metrics,
    )
    return state, build_app(state)


def test_dead_engine_loop_fails_waiters_and_health(engine, monkeypatch):
    state, app = failing_server(
        engine, monkeypatch, 3, "CUDA error: an illegal memory access was encountered"
    )

    async def main():
        state.engine.start()  # ASGITransport runs no lifespan
        try:
            async with httpx.AsyncClient(
                transport=httpx.ASGITransport(app=app), base_url="http://t"
            ) as client:
                assert (await client.get("/health")).status_code == 200
                body = {"model": "tiny", "prompt": "hello", "max_tokens": 50, "ignore_eos": True}
                response = await asyncio.wait_for(client.post("/v1/completions", json=body), timeout=30)
                assert response.status_code == 503
                assert response.json()["error"]["code"] == "engine_dead"
                assert "illegal memory access" in response.json()["error"]["message"]

                health = await asyncio.wait_for(client.get("/health"), timeout=5)
                assert health.status_code == 503
                assert "illegal memory access" in health.json()["error"]["message"]
                again = await asyncio.wait_for(client.post("/v1/completions", json=body), timeout=5)
                assert again.status_code == 503
                scrape = await client.get("/metrics")
                assert scrape.status_code == 200  # still scrapeable
                # The one sequence in flight when the loop died ended with an error.
                error = 'vllm:request_success_total{engine="0",finished_reason="error",model_name="tiny"}'
                assert f"{error} 1.0" in scrape.text

            with pytest.raises(EngineDeadError):
                await state.engine.add([PromptInput("late", [5, 6], greedy(2), time.monotonic())], False)
        finally:
            state.engine.shutdown()

    asyncio.run(main())
    assert not state.engine.is_healthy


def test_dead_engine_ends_open_streams_with_an_error_event(engine, monkeypatch):
    state, app = failing_server(engine, monkeypatch, 5, "boom")

    async def main():
        state.engine.start()
        try:
            async with httpx.AsyncClient(
                transport=httpx.ASGITransport(app=app), base_url="http://t"
            ) as client:
                body = {
                    "model": "tiny",
                    "messages": [{"role": "user", "content": "hi"}],
                    "max_tokens": 50,
                    "ignore_eos": True,
                    "stream": True,
                }
                response = await asyncio.wait_for(client.post("/v1/chat/completions", json=body), timeout=30)
        finally:
            state.engine.shutdown()
        return response

    response = asyncio.run(main())
    events = [line for line in response.text.splitlines() if line]
    assert events[-1] == "data: [DONE]"
    assert '"code":"engine_dead"' in events[-2] and "boom" in events[-2]


def test_admission_counts_sequences_not_calls(engine):
    prompt = engine.tokenizer.encode("x = 1")

    def inputs(num_prompts: int, n: int) -> list[PromptInput]:
        params = SamplingParams(temperature=1.0, seed=1, n=n, max_tokens=3, ignore_eos=True)
        return [PromptInput(f"p{i}-{n}", prompt, params, time.monotonic()) for i in range(num_prompts)]

    async def main():
        ae = AsyncEngine(engine, max_waiting_requests=8)
        ae.start()
        try:
            # 2 prompts x n=5 = 10 sequences do not fit a queue of 8, even an empty one: refused whole.
            with pytest.raises(QueueFullError) as refused:
                await ae.add(inputs(2, 5), stream=False)
            assert "(0 waiting + 10 requested, limit 8)" in str(refused.value)
            assert refused.value.num_new == 10
            assert not engine.has_unfinished_requests() and engine.stats().num_waiting == 0
            rs = await ae.add(inputs(1, 8), stream=False)  # exactly 8 fit
            final = await rs.collect()
            assert [len(c.token_ids) for c in final["p0-8"].outputs] == [3] * 8
        finally:
            ae.shutdown()

    asyncio.run(main())


def test_loop_dying_midway_through_a_batch_fails_every_pending_add(engine, monkeypatch):
    """The engine raises while applying a batch of queued commands: the adds after the failure point
    (never applied) and the streams of those before it all fail with EngineDeadError at once."""
    prompt = engine.tokenizer.encode("def f(x):")
    gate = threading.Event()
    real_step = engine.step

    def gated_step():
        gate.wait()  # holds the engine thread inside a step while the batch queues up
        return real_step()

    def failing_abort(request_ids):
        raise RuntimeError("boom in the middle of a batch")

    monkeypatch.setattr(engine, "step", gated_step)

    async def main():
        ae = AsyncEngine(engine)
        ae.start()
        try:
            first = await ae.add([PromptInput("first", prompt, greedy(50), time.monotonic())], stream=True)
            adds = [
                asyncio.create_task(ae.add([PromptInput(rid, prompt, greedy(5), time.monotonic())], True))
                for rid in ("b", "c", "d")
            ]
            await asyncio.sleep(0)  # each task submits its add
            ae.abort("no-such-request")  # lands between the adds
            adds.append(asyncio.create_task(ae.add([PromptInput("e", prompt, greedy(5), 0.0)], True)))
            await asyncio.sleep(0)
            kinds = [type(c).__name__ for c in ae._commands]
            assert kinds == ["AddRequests"] * 3 + ["AbortRequests", "AddRequests"]
            monkeypatch.setattr(engine, "abort_request", failing_abort)
            gate.set()
            results = await asyncio.wait_for(asyncio.gather(*adds, return_exceptions=True), timeout=10)
            # b, c, d were added before the failure: their streams fail; e never was: its add fails.
            assert isinstance(results[3], EngineDeadError) and "boom" in str(results[3])
            for rs in [first, *results[:3]]:
                with pytest.raises(EngineDeadError, match="boom"):
                    await asyncio.wait_for(rs.collect(), timeout=10)
            assert not ae.is_healthy
        finally:
            ae.shutdown()

    asyncio.run(main())


def test_streamed_outputs_carry_only_the_delta(engine):
    """Each streamed output holds the new tokens, logprobs and text only (its size does not grow with
    the length so far); together they are exactly the non-streamed output."""
    prompt = engine.tokenizer.encode("class Config:")
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, logprobs=2)
    engine.add_request("whole", prompt, params)
    finals = []
    while engine.has_unfinished_requests():
        finals += engine.step()
    (whole,) = finals  # one output, at the end
    engine.add_request("streamed", prompt, params, stream=True)
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    assert len(outs) == 40 and outs[-1].finished and not any(o.finished for o in outs[:-1])
    for out in outs:
        (comp,) = out.outputs
        assert len(comp.token_ids) == 1 and len(comp.logprobs) == 1
        assert comp.token_ids is out.delta_token_ids[0] and comp.text == out.delta_text[0]
    expected = whole.outputs[0]
    assert [t for o in outs for t in o.outputs[0].token_ids] == expected.token_ids
    assert [e for o in outs for e in o.outputs[0].logprobs] == expected.logprobs
    assert "".join(o.outputs[0].text for o in outs) == expected.text
    assert outs[-1].outputs[0].cumulative_logprob == pytest.approx(expected.cumulative_logprob)
    assert expected.cumulative_logprob == pytest.approx(
        sum(next(iter(e.values())) for e in expected.logprobs)
    )
