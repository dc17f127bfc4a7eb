"""kvpilot's ``/metrics`` against a recorded vLLM 0.32 scrape: same names mean the same type and labels.

A dashboard written for ``vllm serve`` must read kvpilot unchanged: for every ``vllm:`` metric both
export, the type and the label names agree. vLLM's series kvpilot does not export are listed in
``NOT_EXPORTED`` with the reason, so a new vLLM series fails here until it is exported or listed.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvpilot.engine import metrics_names as names
from kvpilot.engine.errors import EngineDeadError, InvalidRequestError, QueueFullError
from kvpilot.engine.server.errors import from_exception, refusal_reason
from kvpilot.engine.stats import FinishedRequestStats

from .conftest import MODEL_NAME
from .test_errors import post_oversized

SCRAPES = Path(__file__).resolve().parents[1] / "operator" / "fixtures" / "vllm-0.32-cpu-storm.jsonl.gz"

NOT_EXPORTED = {
    "vllm:estimated_flops_per_gpu": "no model-FLOPs accounting",
    "vllm:estimated_read_bytes_per_gpu": "no model-FLOPs accounting",
    "vllm:estimated_write_bytes_per_gpu": "no model-FLOPs accounting",
    "vllm:engine_sleep_state": "no sleep mode",
    "vllm:external_prefix_cache_queries": "no external (connector) KV cache",
    "vllm:external_prefix_cache_hits": "no external (connector) KV cache",
    "vllm:mm_cache_queries": "no multi-modal inputs",
    "vllm:mm_cache_hits": "no multi-modal inputs",
    "vllm:prompt_tokens_by_source": "no external (connector) KV cache",
    "vllm:prompt_tokens_cached_by_source": "no external (connector) KV cache",
    "vllm:admission_rejections": "kvpilot's queue bound is its own (--max-waiting-requests)",
    "vllm:request_max_num_generation_tokens": "not counted yet",
    "vllm:request_prefill_kv_computed_tokens": "not counted yet",
}
# Same name, same type, but the configuration labels are the engine's own (kvpilot has no Mamba,
# offloading or hash settings); only ``engine`` is compared.
OWN_LABELS = {"vllm:cache_config_info": {"engine"}}


def _families(text: str) -> dict[str, tuple[str, frozenset[str]]]:
    """``vllm:`` metric name -> (type, label names); ``_created`` gauges (disabled here) dropped."""
    out = {}
    for family in text_string_to_metric_families(text):
        if not family.name.startswith("vllm:") or family.name.endswith("_created"):
            continue
        labels = frozenset(k for s in family.samples for k in s.labels if k != "le")
        out[family.name] = (family.type, labels)
    return out


def _vllm_families() -> dict[str, tuple[str, frozenset[str]]]:
    with gzip.open(SCRAPES, "rt") as f:
        scrapes = [json.loads(line) for line in f]
    return _families(next(s["metrics"] for s in reversed(scrapes) if s.get("metrics")))


def test_every_shared_vllm_series_has_vllms_type_and_labels(server) -> None:
    client = server.client()
    for max_tokens in (3, 5):
        client.completions.create(model=MODEL_NAME, prompt="compare", max_tokens=max_tokens)
    ours = _families(server.metrics().text)
    theirs = _vllm_families()
    mismatched = {}
    for name, (kind, labels) in theirs.items():
        if name in NOT_EXPORTED:
            assert name not in ours, f"{name} is exported now: drop it from NOT_EXPORTED"
            continue
        assert name in ours, f"vLLM exports {name}; export it or list it in NOT_EXPORTED with the reason"
        our_kind, our_labels = ours[name]
        if name in OWN_LABELS:
            labels, our_labels = labels & OWN_LABELS[name], our_labels & OWN_LABELS[name]
        if (our_kind, our_labels) != (kind, labels):
            mismatched[name] = {"vllm": (kind, sorted(labels)), "kvpilot": (our_kind, sorted(our_labels))}
    assert not mismatched, json.dumps(mismatched, indent=1)
    # Every per-engine series carries engine="0", as vLLM's do.
    assert {s.labels.get("engine") for s in server.metrics().samples if s.name.startswith("vllm:")} == {"0"}


def _refused(server, reason: str) -> float:
    return server.metrics().value(names.REQUESTS_REFUSED_TOTAL, reason=reason)


def test_refused_requests_are_counted_by_reason(server) -> None:
    before = {reason: _refused(server, reason) for reason in names.REFUSED_REASONS}
    bad = server.post("/v1/completions", json={"model": MODEL_NAME, "prompt": "x", "max_tokens": -1})
    assert bad.status_code == 400
    bad = server.post("/v1/completions", json={"model": MODEL_NAME, "prompt": "x", "stop": ["s"] * 1000})
    assert bad.status_code == 400
    assert post_oversized(server).startswith(b"HTTP/1.1 413")
    server.client().completions.create(model=MODEL_NAME, prompt="fine", max_tokens=2)  # not a refusal
    after = {reason: _refused(server, reason) for reason in names.REFUSED_REASONS}
    assert {r: after[r] - before[r] for r in after} == {
        names.REFUSED_QUEUE_FULL: 0,
        names.REFUSED_INVALID: 2,
        names.REFUSED_TOO_LARGE: 1,
    }


def test_refusal_reasons_follow_the_http_answer() -> None:
    assert refusal_reason(from_exception(QueueFullError(4, 4, 1))) == names.REFUSED_QUEUE_FULL
    assert refusal_reason(from_exception(InvalidRequestError("bad"))) == names.REFUSED_INVALID
    # A dead engine or a bug is the server's failure, not a refused request.
    assert refusal_reason(from_exception(EngineDeadError("down"))) is None
    assert refusal_reason(from_exception(RuntimeError("bug"))) is None


def _finished(**changes) -> FinishedRequestStats:
    values = dict(
        finish_reason="length",
        num_prompt_tokens=4,
        num_generation_tokens=5,
        arrival_time=100.0,
        scheduled_time=100.5,
        first_token_time=101.0,
        finished_time=103.0,
        num_preemptions=0,
    )
    values.update(changes)
    return FinishedRequestStats(**values)


def _sample(logger, name: str, **labels) -> float:
    labels = {"engine": "0", "model_name": "m", **labels}
    text = generate_latest(logger.registry).decode()
    found = [
        s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name == name and s.labels == labels
    ]
    assert len(found) == 1, (name, labels, found)
    return found[0]


def test_per_request_preemptions_and_time_per_output_token_are_observed_per_finished_sequence() -> None:
    from tests.server.test_metrics_unit import make_logger, sched, step

    logger = make_logger()
    finished = [
        _finished(num_preemptions=2),  # 4 tokens after the first in 2 s: 0.5 s each
        _finished(num_preemptions=0, num_generation_tokens=1, finished_time=101.0),  # single token: 0
        _finished(num_preemptions=7, num_generation_tokens=3),  # 2 tokens in 2 s: 1 s each
    ]
    logger.record(sched(), step(finished=finished))
    preempt = names.REQUEST_NUM_PREEMPTIONS
    assert _sample(logger, preempt + "_count") == 3
    assert _sample(logger, preempt + "_sum") == 9
    # Cumulative buckets: 0 <= 1, 2 <= 2, 7 <= 10 (vLLM's buckets).
    buckets = [_sample(logger, preempt + "_bucket", le=le) for le in ("1.0", "2.0", "5.0", "10.0")]
    assert buckets == [1, 2, 2, 3]
    tpot = names.REQUEST_TIME_PER_OUTPUT_TOKEN_SECONDS
    assert _sample(logger, tpot + "_count") == 3
    assert _sample(logger, tpot + "_sum") == 1.5
    assert _sample(logger, tpot + "_bucket", le="0.5") == 2


def test_request_params_waiting_reasons_cached_tokens_and_errors() -> None:
    from tests.server.test_metrics_unit import make_logger, sched, step

    logger = make_logger()
    finished = [_finished(n=1, max_tokens=5), _finished(n=4, max_tokens=None), _finished(n=4, max_tokens=300)]
    logger.record(sched(num_waiting=3), step(finished=finished, num_cached_prompt_tokens=32))
    n = names.REQUEST_PARAMS_N
    assert (_sample(logger, n + "_count"), _sample(logger, n + "_sum")) == (3, 9)
    assert [_sample(logger, n + "_bucket", le=le) for le in ("1.0", "2.0", "5.0")] == [1, 1, 3]
    # A request that set no max_tokens is not observed (vLLM's rule); buckets 1-2-5 up to max_model_len.
    max_tokens = names.REQUEST_PARAMS_MAX_TOKENS
    assert (_sample(logger, max_tokens + "_count"), _sample(logger, max_tokens + "_sum")) == (2, 305)
    assert [_sample(logger, max_tokens + "_bucket", le=le) for le in ("5.0", "200.0", "500.0")] == [1, 1, 2]
    waiting = names.NUM_REQUESTS_WAITING_BY_REASON
    assert _sample(logger, waiting, reason="capacity") == 3
    assert _sample(logger, waiting, reason="deferred") == 0
    assert _sample(logger, names.PROMPT_TOKENS_CACHED_TOTAL) == 32
    logger.record(sched(num_waiting=0), step(num_cached_prompt_tokens=16))
    assert _sample(logger, waiting, reason="capacity") == 0
    assert _sample(logger, names.PROMPT_TOKENS_CACHED_TOTAL) == 48
    success = names.REQUEST_SUCCESS_TOTAL
    assert _sample(logger, success, finished_reason="error") == 0
    logger.record_errored(3)
    assert _sample(logger, success, finished_reason="error") == 3
    assert _sample(logger, success, finished_reason="abort") == 0


def test_prompt_tokens_cached_counts_the_prefix_cache_once_per_sequence(server) -> None:
    """The same long prompt twice: the second is served from the prefix cache, and the counter grows by
    what the hit counter grew (one lookup each, nothing preempted)."""
    client = server.client()
    prompt = "a shared system prompt that spans several KV blocks " * 6
    client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=2)
    before = server.metrics()
    client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=2)
    after = server.metrics()
    cached = after.value(names.PROMPT_TOKENS_CACHED_TOTAL) - before.value(names.PROMPT_TOKENS_CACHED_TOTAL)
    hits = after.value(names.PREFIX_CACHE_HITS_TOTAL) - before.value(names.PREFIX_CACHE_HITS_TOTAL)
    assert cached > 0
    assert cached == hits
