"""AsyncEngine and the app in-process, over a real tiny engine: aborts free blocks at once, refused
requests leave no trace, slow consumers get merged deltas, and a dead engine loop fails every waiter
and turns /health to 503 instead of hanging."""

from __future__ import annotations

import asyncio
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

    async def main():
        ae = AsyncEngine(engine)
        ae.start()
        try:
            gen = ae.generate("r1", prompt, greedy(400), stream=True)
            first = await gen.__anext__()
            assert first.delta_token_ids[0]
            assert engine.block_manager.num_free_blocks < NUM_BLOCKS
            t0 = time.monotonic()
            await gen.aclose()  # the consumer leaves: the request is aborted
            await wait_idle(engine)
            assert time.monotonic() - t0 < 1.0
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
    state = ServerState(
        engine=AsyncEngine(engine),
        tokenizer=engine.tokenizer,
        served_model_names=["tiny"],
        model_dir=engine.model_dir,
        max_model_len=engine.max_model_len,
        vocab_size=engine.model_config.vocab_size,
        metrics=PrometheusStatLogger.from_engine(engine, "tiny"),
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
                assert (await client.get("/metrics")).status_code == 200  # still scrapeable

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
