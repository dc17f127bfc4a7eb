"""``GET``/``POST /admin/config``: run-time settings of a live ``kvpilot serve``, validated as at start-up,
applied whole or not at all between two steps, behind the API key, shown in ``/metrics``; lowering
``max_num_seqs`` under load preempts down to the new bound and loses no request and no KV block."""

from __future__ import annotations

import concurrent.futures
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvpilot.engine import metrics_names as names

from .conftest import MODEL_NAME, ServerProcess

KEY = "admin-key-0123456789"
MAX_SEQS = 8


@pytest.fixture(scope="module")
def admin_server(server_model, tmp_path_factory):
    logs = tmp_path_factory.mktemp("admin-server-logs")
    flags = ["--num-gpu-blocks-override", "256", "--max-model-len", "512", "--max-num-seqs", str(MAX_SEQS)]
    flags += ["--max-num-batched-tokens", "512", "--no-enable-prefix-caching", "--seed", "0"]
    proc = ServerProcess(server_model, logs / "admin.log", flags, api_key=KEY)
    try:
        yield proc.wait_ready()
    finally:
        proc.stop()


def auth() -> dict[str, str]:
    return {"Authorization": f"Bearer {KEY}"}


def samples(url: str) -> dict[str, list]:
    out: dict[str, list] = {}
    for family in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=10).text):
        for sample in family.samples:
            out.setdefault(sample.name, []).append(sample)
    return out


def value(url: str, name: str) -> float:
    return sum(s.value for s in samples(url).get(name, []))


def post(url: str, body, headers=None) -> httpx.Response:
    headers = auth() if headers is None else headers
    return httpx.post(url + "/admin/config", json=body, headers=headers, timeout=30)


def test_the_api_key_guards_both_verbs(admin_server) -> None:
    url = admin_server.url
    assert httpx.get(url + "/admin/config", timeout=10).status_code == 401
    assert post(url, {"max_num_seqs": 1}, headers={}).status_code == 401
    assert post(url, {"max_num_seqs": 1}, headers={"Authorization": "Bearer wrong"}).status_code == 401
    answer = httpx.get(url + "/admin/config", headers=auth(), timeout=10)
    assert answer.status_code == 200
    assert answer.json() == {
        "max_num_seqs": MAX_SEQS,
        "max_num_batched_tokens": 512,
        "max_waiting_requests": None,
        "preemption_mode": "recompute",
    }


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"max_num_seqs": 0}, "max_num_seqs must be a positive integer, got 0"),
        ({"max_num_seqs": "4"}, "max_num_seqs must be a positive integer, got '4'"),
        ({"max_num_seqs": True}, "max_num_seqs must be a positive integer, got True"),
        ({"max_num_seqs": MAX_SEQS + 1}, "above its start-up value 8"),
        ({"max_num_batched_tokens": 1024}, "above its start-up value 512"),
        ({"preemption_mode": "swap"}, "needs the CPU swap pool"),
        ({"preemption_mode": "drop"}, "preemption_mode must be one of recompute, swap"),
        ({"max_waiting_requests": -1}, "max_waiting_requests must be an integer >= 0 or null"),
        ({"block_size": 32}, "block_size cannot change at run time"),
        ({"max_num_seqz": 4}, "unknown setting 'max_num_seqz'"),
        # Atomic: the valid key of a body with an invalid one is not applied either.
        (
            {"max_num_seqs": 2, "max_num_batched_tokens": 0},
            "max_num_batched_tokens must be a positive integer",
        ),
    ],
)
def test_an_invalid_update_is_a_400_and_changes_nothing(admin_server, body, message) -> None:
    url = admin_server.url
    before = httpx.get(url + "/admin/config", headers=auth(), timeout=10).json()
    answer = post(url, body)
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["type"] == "invalid_request_error" and message in error["message"], error
    assert httpx.get(url + "/admin/config", headers=auth(), timeout=10).json() == before


def test_a_body_that_is_not_an_object_is_a_400(admin_server) -> None:
    answer = post(admin_server.url, [["max_num_seqs", 2]])
    assert answer.status_code == 400 and answer.json()["error"]["type"] == "invalid_request_error"


def test_a_change_is_in_force_at_once_and_every_scrape_shows_it(admin_server) -> None:
    url = admin_server.url
    try:
        answer = post(url, {"max_num_seqs": 3, "max_waiting_requests": 50})
        assert answer.status_code == 200, answer.text
        assert answer.json() == {
            "max_num_seqs": 3,
            "max_num_batched_tokens": 512,
            "max_waiting_requests": 50,
            "preemption_mode": "recompute",
        }
        assert httpx.get(url + "/admin/config", headers=auth(), timeout=10).json() == answer.json()
        (info,) = samples(url)["kvpilot_config_info"]  # one label set: the old one is gone
        assert info.labels == {
            "max_num_seqs": "3",
            "max_num_batched_tokens": "512",
            "max_waiting_requests": "50",
            "preemption_mode": "recompute",
        }
    finally:
        assert post(url, {"max_num_seqs": MAX_SEQS, "max_waiting_requests": None}).status_code == 200
    (info,) = samples(url)["kvpilot_config_info"]
    assert (info.labels["max_num_seqs"], info.labels["max_waiting_requests"]) == (str(MAX_SEQS), "None")


def test_lowering_max_num_seqs_under_load_preempts_to_the_bound_and_loses_nothing(admin_server) -> None:
    url = admin_server.url
    tokens = 480  # long enough that none ends around the change (8 x 31 blocks fit the 256)

    def complete(i: int) -> int:
        body = {"model": MODEL_NAME, "prompt": f"job {i}", "max_tokens": tokens, "ignore_eos": True}
        answer = httpx.post(url + "/v1/completions", json=body, headers=auth(), timeout=300)
        assert answer.status_code == 200, answer.text
        return answer.json()["usage"]["completion_tokens"]

    preempted_before = value(url, "vllm:num_preemptions_total")
    with concurrent.futures.ThreadPoolExecutor(MAX_SEQS) as pool:
        futures = [pool.submit(complete, i) for i in range(MAX_SEQS)]
        deadline = time.monotonic() + 120
        while value(url, "vllm:num_requests_running") < MAX_SEQS - 1:
            assert time.monotonic() < deadline, "the load never filled the batch"
            assert not any(f.done() for f in futures), "requests finished before the change: too short"
            time.sleep(0.05)
        try:
            assert post(url, {"max_num_seqs": 2}).status_code == 200
            # Within a step the running set is down to the bound; the rest wait (recompute) meanwhile.
            deadline = time.monotonic() + 30
            while value(url, "vllm:num_requests_running") > 2:
                assert time.monotonic() < deadline, "running never came down to the new bound"
                time.sleep(0.02)
            # Each request running at the change beyond the bound went back to waiting (at least
            # MAX_SEQS - 1 ran; any that had ended meanwhile needed no preemption).
            ended = sum(f.done() for f in futures)
            assert value(url, "vllm:num_preemptions_total") >= preempted_before + MAX_SEQS - 1 - 2 - ended
            # It stays at the bound while the others wait.
            for _ in range(10):
                assert value(url, "vllm:num_requests_running") <= 2
                time.sleep(0.02)
        finally:
            assert post(url, {"max_num_seqs": MAX_SEQS}).status_code == 200
        assert [f.result() for f in futures] == [tokens] * MAX_SEQS  # every request, whole
    # Every block back in the pool once the requests are done.
    assert value(url, "vllm:kv_cache_usage_perc") == 0.0
    assert value(url, "vllm:num_requests_running") == value(url, "vllm:num_requests_waiting") == 0


def test_every_scrape_is_timed_and_shows_from_the_next_one(admin_server) -> None:
    """``kvpilot_engine_metrics_render_seconds`` counts each /metrics answer: a scrape shows those
    before it, so two scrapes in a row differ by one answer, which took some time."""
    count, total = (
        f"{names.ENGINE_METRICS_RENDER_SECONDS}_count",
        f"{names.ENGINE_METRICS_RENDER_SECONDS}_sum",
    )
    first = samples(admin_server.url)
    second = samples(admin_server.url)
    assert sum(s.value for s in second[count]) == sum(s.value for s in first[count]) + 1
    took = sum(s.value for s in second[total]) - sum(s.value for s in first[total])
    assert took > 0.0
    assert {s.labels["model_name"] for s in second[count]} == {s.labels["model_name"] for s in first[count]}


def test_each_request_the_server_had_to_itself_is_timed_up_to_its_hand_off(admin_server) -> None:
    """``kvpilot_engine_request_intake_seconds`` counts one intake per generation call taken in alone
    (completions and chat alike); a call refused before its hand-off to the engine counts none."""
    count, total = (
        f"{names.ENGINE_REQUEST_INTAKE_SECONDS}_count",
        f"{names.ENGINE_REQUEST_INTAKE_SECONDS}_sum",
    )
    url = admin_server.url
    before = (value(url, count), value(url, total))
    body = {"model": MODEL_NAME, "prompt": "hello there", "max_tokens": 2}
    assert httpx.post(url + "/v1/completions", json=body, headers=auth(), timeout=30).status_code == 200
    chat = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    assert httpx.post(url + "/v1/chat/completions", json=chat, headers=auth(), timeout=30).status_code == 200
    refused = {"model": MODEL_NAME, "prompt": "hello", "max_tokens": -1}
    assert httpx.post(url + "/v1/completions", json=refused, headers=auth(), timeout=30).status_code == 400
    after = (value(url, count), value(url, total))
    assert after[0] == before[0] + 2
    assert after[1] > before[1]
