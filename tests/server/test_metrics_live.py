"""``/metrics`` of a live server, parsed with prometheus-client's text parser: counters move by exactly
what known traffic implies; preemptions under a tiny KV pool, in both preemption modes; aborts on client
disconnect free the KV blocks; a full waiting queue answers 503 with Retry-After."""

from __future__ import annotations

import json
import socket
import threading
import urllib.parse
import uuid

import httpx
import openai
import pytest

from kvpilot.engine import metrics_names as names

from .conftest import MODEL_NAME

NO_EOS = {"extra_body": {"ignore_eos": True}}
# How long an abort may take to show, generous for a loaded machine: the abort is proven by the
# counters (finished_reason="abort", fewer tokens than asked for), not by how fast it happened.
ABORT_WAIT_S = 30.0


def delta(before, after, name: str, **labels) -> float:
    return after.value(name, **labels) - before.value(name, **labels)


def test_every_metric_name_is_exported_with_config_labels(server, server_model):
    metrics = server.metrics()
    exported = {names.base_name(s.name) for s in metrics.samples}
    assert set(names.ALL_METRICS) <= exported
    assert set(names.EXPORTED_ALIASES) <= exported
    assert {f.name: f.type for f in metrics.families.values()}[names.KV_CACHE_USAGE_PERC] == "gauge"

    cache = metrics.labels(names.CACHE_CONFIG_INFO)
    assert cache["block_size"] == "16"
    assert cache["num_gpu_blocks"] == "512"
    assert cache["num_cpu_blocks"] == "0"
    assert cache["gpu_memory_utilization"] == "0.9"
    assert cache["enable_prefix_caching"] == "True"
    assert cache["preemption_mode"] == "recompute"
    assert "model_name" not in cache
    model = metrics.labels(names.MODEL_CONFIG_INFO)
    assert (model["num_attention_heads"], model["num_key_value_heads"]) == ("4", "2")
    assert (model["tensor_parallel_size"], model["pipeline_parallel_size"]) == ("1", "1")
    assert model["max_model_len"] == "2048"
    # The shape the operator's parallel-size rule reads, as the checkpoint states it.
    checkpoint = json.loads((server_model / "config.json").read_text())
    assert model["intermediate_size"] == str(checkpoint["intermediate_size"]) != "None"
    assert model["num_hidden_layers"] == str(checkpoint["num_hidden_layers"])
    for reason in names.FINISHED_REASONS:
        metrics.value(names.REQUEST_SUCCESS_TOTAL, finished_reason=reason)  # present from start-up


def test_counters_move_by_exactly_the_traffic(server):
    client = server.client()
    tag = uuid.uuid4().hex[:6]
    before = server.metrics()
    usages = []
    for i, max_tokens in enumerate((5, 7, 9)):
        resp = client.completions.create(
            model=MODEL_NAME, prompt=f"probe {tag} {i}", max_tokens=max_tokens, temperature=0.0, **NO_EOS
        )
        assert resp.choices[0].finish_reason == "length"
        usages.append(resp.usage)
    # The same prompt twice: once to learn its text (finishes by length), once stopped by a string in it.
    unstopped = client.completions.create(
        model=MODEL_NAME, prompt=f"stop {tag}", max_tokens=20, temperature=0.0, **NO_EOS
    )
    usages.append(unstopped.usage)
    stop = unstopped.choices[0].text[8:11]
    stopped = client.completions.create(
        model=MODEL_NAME, prompt=f"stop {tag}", max_tokens=20, temperature=0.0, stop=[stop], **NO_EOS
    )
    assert stopped.choices[0].finish_reason == "stop"
    usages.append(stopped.usage)
    after = server.metrics()

    num_prompt = sum(u.prompt_tokens for u in usages)
    num_generated = sum(u.completion_tokens for u in usages)
    num_requests = len(usages)
    assert delta(before, after, names.PROMPT_TOKENS_TOTAL) == num_prompt
    assert delta(before, after, names.GENERATION_TOKENS_TOTAL) == num_generated
    assert delta(before, after, names.REQUEST_SUCCESS_TOTAL, finished_reason="length") == 4
    assert delta(before, after, names.REQUEST_SUCCESS_TOTAL, finished_reason="stop") == 1
    assert delta(before, after, names.REQUEST_SUCCESS_TOTAL, finished_reason="abort") == 0
    assert delta(before, after, names.NUM_PREEMPTIONS_TOTAL) == 0
    assert delta(before, after, names.TIME_TO_FIRST_TOKEN_SECONDS + "_count") == num_requests
    assert delta(before, after, names.E2E_REQUEST_LATENCY_SECONDS + "_count") == num_requests
    assert delta(before, after, names.REQUEST_QUEUE_TIME_SECONDS + "_count") == num_requests
    assert delta(before, after, names.INTER_TOKEN_LATENCY_SECONDS + "_count") == num_generated - num_requests
    assert delta(before, after, names.REQUEST_PROMPT_TOKENS + "_sum") == num_prompt
    assert delta(before, after, names.REQUEST_GENERATION_TOKENS + "_sum") == num_generated
    # Prompts are shorter than a block, so nothing comes from the prefix cache: every prompt token and
    # every fed-back generated token (all but each request's last) goes through the model once.
    assert delta(before, after, names.PREFIX_CACHE_QUERIES_TOTAL) == num_prompt
    assert delta(before, after, names.PREFIX_CACHE_HITS_TOTAL) == 0
    assert (
        delta(before, after, names.ITERATION_TOKENS_TOTAL + "_sum")
        == num_prompt + num_generated - num_requests
    )
    assert after.value(names.E2E_REQUEST_LATENCY_SECONDS + "_sum") > before.value(
        names.E2E_REQUEST_LATENCY_SECONDS + "_sum"
    )
    for gauge in (names.NUM_REQUESTS_RUNNING, names.NUM_REQUESTS_WAITING, names.KV_CACHE_USAGE_PERC):
        assert after.value(gauge) == 0


def squeeze(pool_server):
    """Four prompts greedily one at a time, then all four in one request on an 8-block pool (each grows to
    3 blocks, so they must take turns). Returns the metrics before, between and after the two phases."""
    client = pool_server.client()
    prompts = [f"# job {i}\n" for i in range(4)]
    before = pool_server.metrics()
    alone = [
        client.completions.create(model=MODEL_NAME, prompt=p, max_tokens=40, temperature=0.0, **NO_EOS)
        .choices[0]
        .text
        for p in prompts
    ]
    middle = pool_server.metrics()
    assert delta(before, middle, names.NUM_PREEMPTIONS_TOTAL) == 0

    # One request with four prompts: they are admitted together and must take turns.
    resp = client.completions.create(
        model=MODEL_NAME, prompt=prompts, max_tokens=40, temperature=0.0, **NO_EOS
    )
    after = pool_server.metrics()
    assert [c.text for c in sorted(resp.choices, key=lambda c: c.index)] == alone
    assert resp.usage.completion_tokens == 160
    assert delta(middle, after, names.NUM_PREEMPTIONS_TOTAL) >= 1
    assert delta(middle, after, names.GENERATION_TOKENS_TOTAL) == 160  # preempted or not, never re-sampled
    assert delta(middle, after, names.REQUEST_SUCCESS_TOTAL, finished_reason="length") == 4
    assert after.value(names.KV_CACHE_USAGE_PERC) == 0.0
    assert after.value(names.NUM_REQUESTS_WAITING) == 0
    return before, middle, after


def test_preemption_under_a_tiny_pool_keeps_outputs_exact(pool_server):
    """8 blocks x 16 tokens; four sequences that each grow to 3 blocks cannot all run at once."""
    squeeze(pool_server)


def test_swap_preemption_shows_in_metrics_and_recomputes_nothing(swap_server):
    """The pool server's four-way squeeze under ``--preemption-mode swap``: the preemptions are counted,
    the swapped sequences come back with their KV (the batch computes exactly the tokens the four
    requests computed alone: nothing re-prefilled), outputs are exact and the CPU pool drains."""
    cache = swap_server.metrics().labels(names.CACHE_CONFIG_INFO)
    assert cache["preemption_mode"] == "swap" and int(cache["num_cpu_blocks"]) >= 8
    before, middle, after = squeeze(swap_server)
    computed = names.ITERATION_TOKENS_TOTAL + "_sum"
    assert delta(middle, after, computed) == delta(before, middle, computed)
    for gauge in (names.NUM_REQUESTS_SWAPPED, names.CPU_CACHE_USAGE_PERC):
        assert after.value(gauge) == 0.0, gauge


def test_swapped_sequences_show_in_metrics_while_they_wait(swap_server):
    """Twelve sequences, four at a time, that each grow to 7 of the 8 blocks: the latest arrivals keep
    being swapped out to the CPU pool. Scrapes taken while the request runs see the swapped gauges up
    and the preemption counter risen; once it is done every swapped block has come back (the CPU pool
    is empty) and nothing was lost."""
    client = swap_server.client()
    prompts = [f"# swap {i}\n" for i in range(12)]
    before = swap_server.metrics()
    result: dict = {}

    def run() -> None:
        try:
            result["resp"] = client.completions.create(
                model=MODEL_NAME, prompt=prompts, max_tokens=100, temperature=0.0, **NO_EOS
            )
        except BaseException as exc:  # surfaced below, in the test's thread
            result["error"] = exc

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    seen = []  # (requests swapped, CPU pool usage, preemptions so far) per scrape while it runs
    while worker.is_alive():
        now = swap_server.metrics()
        seen.append(
            (
                now.value(names.NUM_REQUESTS_SWAPPED),
                now.value(names.CPU_CACHE_USAGE_PERC),
                delta(before, now, names.NUM_PREEMPTIONS_TOTAL),
            )
        )
        worker.join(timeout=0.01)
    assert "error" not in result, result.get("error")
    after = swap_server.metrics()
    assert result["resp"].usage.completion_tokens == 1200
    swapped = [s for s in seen if s[0] >= 1]
    assert swapped, f"no scrape in {len(seen)} saw a swapped request"
    assert all(cpu > 0 and preemptions >= 1 for _, cpu, preemptions in swapped), swapped
    assert delta(before, after, names.NUM_PREEMPTIONS_TOTAL) >= max(s[0] for s in seen)
    assert delta(before, after, names.REQUEST_SUCCESS_TOTAL, finished_reason="length") == 12
    for gauge in (names.NUM_REQUESTS_SWAPPED, names.CPU_CACHE_USAGE_PERC, names.KV_CACHE_USAGE_PERC):
        assert after.value(gauge) == 0.0, gauge


def test_stream_disconnect_aborts_and_frees_blocks(server):
    client = server.client()
    before = server.metrics()
    stream = client.completions.create(
        model=MODEL_NAME,
        prompt="def long_function():\n",
        max_tokens=1900,
        temperature=0.0,
        stream=True,
        **NO_EOS,
    )
    chunks = iter(stream)
    next(chunks), next(chunks)
    running = server.metrics()
    assert running.value(names.NUM_REQUESTS_RUNNING) == 1
    assert running.value(names.KV_CACHE_USAGE_PERC) > 0
    stream.close()
    server.wait_metric(names.NUM_REQUESTS_RUNNING, lambda v: v == 0, timeout_s=ABORT_WAIT_S)
    server.wait_metric(names.KV_CACHE_USAGE_PERC, lambda v: v == 0.0, timeout_s=ABORT_WAIT_S)
    after = server.metrics()
    assert delta(before, after, names.REQUEST_SUCCESS_TOTAL, finished_reason="abort") == 1
    assert delta(before, after, names.REQUEST_SUCCESS_TOTAL, finished_reason="length") == 0
    assert delta(before, after, names.GENERATION_TOKENS_TOTAL) < 1900


def test_non_streaming_client_timeout_aborts(server):
    """A client that gives up on a non-streaming request (its timeout, a closed connection) aborts it.
    The connection is closed once the request is seen running, not after a guessed delay: a request
    that had not reached the engine yet would abort in the queue, not while it runs."""
    before = server.metrics()
    body = json.dumps(
        {
            "model": MODEL_NAME,
            "messages": [{"role": "user", "content": "write a novel"}],
            "max_tokens": 1900,
            "ignore_eos": True,
        }
    ).encode()
    address = urllib.parse.urlsplit(server.url)
    headers = "".join(f"{k}: {v}\r\n" for k, v in server.headers().items())
    with socket.create_connection((address.hostname, address.port)) as sock:
        sock.sendall(
            f"POST /v1/chat/completions HTTP/1.1\r\nHost: {address.netloc}\r\n{headers}"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        server.wait_metric(names.NUM_REQUESTS_RUNNING, lambda v: v == 1, timeout_s=ABORT_WAIT_S)
    # The client is gone (the socket closed) while its request runs.
    server.wait_metric(names.NUM_REQUESTS_RUNNING, lambda v: v == 0, timeout_s=ABORT_WAIT_S)
    server.wait_metric(names.KV_CACHE_USAGE_PERC, lambda v: v == 0.0, timeout_s=ABORT_WAIT_S)
    after = server.metrics()
    assert delta(before, after, names.REQUEST_SUCCESS_TOTAL, finished_reason="abort") == 1
    assert delta(before, after, names.REQUEST_SUCCESS_TOTAL, finished_reason="length") == 0


def test_full_waiting_queue_answers_503_with_retry_after(queue_server):
    """One sequence may run and one may wait; the next request is refused until the queue drains."""
    client = queue_server.client()
    before = queue_server.metrics()
    running = client.completions.create(
        model=MODEL_NAME, prompt="first", max_tokens=1900, temperature=0.0, stream=True, **NO_EOS
    )
    next(iter(running))
    waiting = client.completions.create(
        model=MODEL_NAME, prompt="second", max_tokens=1900, temperature=0.0, stream=True, **NO_EOS
    )
    queue_server.wait_metric(names.NUM_REQUESTS_WAITING, lambda v: v == 1, timeout_s=5.0)

    with pytest.raises(openai.InternalServerError) as err:
        client.completions.create(model=MODEL_NAME, prompt="third", max_tokens=4)
    assert err.value.status_code == 503
    assert err.value.response.headers["retry-after"] == "1"
    error = err.value.response.json()["error"]
    assert error["code"] == "server_overloaded" and error["type"] == "server_error"
    assert "waiting queue is full (1 waiting, limit 1)" in error["message"]
    assert queue_server.metrics().value(names.NUM_REQUESTS_WAITING) == 1

    # Leaving while still queued aborts too (nothing had been streamed yet).
    waiting.close()
    queue_server.wait_metric(names.NUM_REQUESTS_WAITING, lambda v: v == 0, timeout_s=ABORT_WAIT_S)
    running.close()
    queue_server.wait_metric(names.NUM_REQUESTS_RUNNING, lambda v: v == 0, timeout_s=ABORT_WAIT_S)
    queue_server.wait_metric(names.KV_CACHE_USAGE_PERC, lambda v: v == 0.0, timeout_s=ABORT_WAIT_S)
    after = queue_server.metrics()
    assert delta(before, after, names.REQUEST_SUCCESS_TOTAL, finished_reason="abort") == 2

    # With the queue empty, requests are admitted again.
    resp = client.completions.create(model=MODEL_NAME, prompt="fourth", max_tokens=3, **NO_EOS)
    assert resp.usage.completion_tokens == 3


def test_health_and_metrics_answer_while_the_engine_is_busy(server):
    """A long generation must not block the operational endpoints (the loop runs on its own thread):
    they answer while the generation is still streaming, not after it."""
    client = server.client()
    before_length = server.metrics().value(names.REQUEST_SUCCESS_TOTAL, finished_reason="length")
    stream = client.completions.create(
        model=MODEL_NAME, prompt="busy", max_tokens=1900, temperature=0.0, stream=True, **NO_EOS
    )
    chunks = iter(stream)
    try:
        assert next(chunks).choices[0].finish_reason is None
        # Answers that waited for the generation's end would see it finished (running 0, counted).
        for _ in range(5):
            assert httpx.get(f"{server.url}/health", timeout=30).status_code == 200
            busy = server.metrics()
            assert busy.value(names.NUM_REQUESTS_RUNNING) == 1
            assert busy.value(names.REQUEST_SUCCESS_TOTAL, finished_reason="length") == before_length
    finally:
        stream.close()
    server.wait_metric(names.NUM_REQUESTS_RUNNING, lambda v: v == 0, timeout_s=ABORT_WAIT_S)
