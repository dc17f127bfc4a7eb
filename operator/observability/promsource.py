"""Prometheus as the metrics source (``--metrics-source prometheus``): the signals remediation reads,
taken by PromQL from the team's Prometheus instead of scraping every pod.

``PrometheusSource.scrape(targets)`` answers like :class:`~kvpilot.operator.remediation.scrape.Scraper`:
one :class:`~kvpilot.operator.remediation.scrape.Result` per pod, in order, never an exception. Per
namespace it sends one instant query for the metrics the policy reads, selected by the pod labels
Prometheus Operator puts on a ServiceMonitor's targets (``namespace``, ``pod``)::

    {__name__=~"vllm:num_preemptions_total|vllm:kv_cache_usage_perc|...", namespace="NS", pod=~"a|b"}

A pod's answer is its samples, timed by their own timestamp (when Prometheus scraped the pod), so the
window and the policy see exactly what a direct scrape would have shown then. A sample that did not
move since the last tick is not newer, and the pod's series ages into "metrics stale"; a pod with no
series (Prometheus' scrape failed: its staleness markers remove them) is a failed scrape. The policy
and its window are unchanged.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Callable, Iterable
from typing import Any
from urllib.parse import urlsplit

import aiohttp

from kvpilot.engine import metrics_names as m
from kvpilot.operator.api import names
from kvpilot.operator.remediation.metrics import (
    LATENCY_HISTOGRAMS,
    PREEMPTIONS_CREATED,
    PROCESS_START,
    REQUEST_TOKEN_SUMS,
    REQUESTS_FINISHED,
    REQUIRED,
)
from kvpilot.operator.remediation.pods import Target
from kvpilot.operator.remediation.scrape import Result

# Everything parse_scrape reads: the required series (and the aliases older engines export under), the
# info metrics, and what tells a restart.
METRIC_NAMES = tuple(
    sorted(
        {
            *REQUIRED,
            *(alias for alias, current in m.DEPRECATED_ALIASES.items() if current in REQUIRED),
            m.CACHE_CONFIG_INFO,
            m.MODEL_CONFIG_INFO,
            m.MODEL_CONFIG_INFO_ALIAS,
            PROCESS_START,
            PREEMPTIONS_CREATED,
            # The optional series: the request-token sums the live relief sizes with, and the latency
            # histograms of the demand rule that sees queues (every bucket, the sum and the count).
            *REQUEST_TOKEN_SUMS,
            REQUESTS_FINISHED,
            *(f"{h}_{part}" for h in LATENCY_HISTOGRAMS for part in ("bucket", "sum", "count")),
        }
    )
)
# A query names at most this many pods (a long regex is a long URL).
PODS_PER_QUERY = 50


class PrometheusUrlError(ValueError):
    """A ``--prometheus-url`` that is not an http(s) URL."""


def check_url(url: str) -> str:
    """``url`` without a trailing slash; raises PrometheusUrlError unless it is http(s)://host[...]."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise PrometheusUrlError(f"not an http(s) URL of a Prometheus server: {url!r}")
    return url.rstrip("/")


def _quote(value: str) -> str:
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def selector(namespace: str, pods: Iterable[str]) -> str:
    """The PromQL selector of the policy's metrics of ``pods`` in ``namespace``."""
    names_re = "|".join(re.escape(n) for n in METRIC_NAMES)
    pods_re = "|".join(re.escape(p) for p in pods)
    return f"{{__name__=~{_quote(names_re)}, namespace={_quote(namespace)}, pod=~{_quote(pods_re)}}}"


class PrometheusSource:
    """Reads the engine pods' metrics from the Prometheus HTTP API at ``url`` (see the module)."""

    def __init__(
        self,
        url: str,
        timeout_s: float = 3.0,
        clock: Callable[[], float] = time.time,
        headers: dict[str, str] | None = None,
    ) -> None:
        self.url = check_url(url)
        self.timeout_s = timeout_s
        self.clock = clock
        self.headers = dict(headers or {})
        self._session: aiohttp.ClientSession | None = None

    async def close(self) -> None:
        """Close the HTTP session."""
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def scrape(self, targets: Iterable[Target]) -> list[Result]:
        """The latest samples of every target, as Results in the order of ``targets``."""
        targets = list(targets)
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=self.timeout_s),
                headers={"User-Agent": names.FIELD_MANAGER, **self.headers},
            )
        batches: list[tuple[str, list[Target]]] = []
        by_namespace: dict[str, list[Target]] = {}
        for target in targets:
            by_namespace.setdefault(target.namespace, []).append(target)
        for namespace, members in by_namespace.items():
            for start in range(0, len(members), PODS_PER_QUERY):
                batches.append((namespace, members[start : start + PODS_PER_QUERY]))
        answers = await asyncio.gather(*(self._batch(ns, members) for ns, members in batches))
        results = {r.target.key: r for answer in answers for r in answer}
        return [results[t.key] for t in targets]

    async def _batch(self, namespace: str, members: list[Target]) -> list[Result]:
        query = selector(namespace, [t.name for t in members])
        try:
            async with self._session.get(f"{self.url}/api/v1/query", params={"query": query}) as response:
                if response.status != 200:
                    return self._all_failed(
                        members, f"Prometheus answered HTTP {response.status}", "http_status"
                    )
                body = await response.json(content_type=None)
        except TimeoutError:
            return self._all_failed(
                members, f"Prometheus gave no answer within {self.timeout_s:g}s", "timeout"
            )
        except aiohttp.ClientError as exc:
            return self._all_failed(members, f"Prometheus: {type(exc).__name__}: {exc}"[:300], "connection")
        except ValueError as exc:  # not JSON
            return self._all_failed(members, f"Prometheus answered no JSON: {exc}"[:300], "body")
        try:
            series = _vector(body)
        except ValueError as exc:
            return self._all_failed(members, str(exc)[:300], "body")
        samples: dict[str, list[dict[str, Any]]] = {t.name: [] for t in members}
        times: dict[str, float] = {}
        for labels, at, value in series:
            pod = labels.get("pod")
            if pod not in samples:
                continue
            name = labels.pop("__name__")
            samples[pod].append({"name": name, "labels": labels, "value": value})
            times[pod] = max(times.get(pod, at), at)
        out = []
        for target in members:
            if not samples[target.name]:
                why = f"no series in Prometheus for pod {target.namespace}/{target.name}"
                out.append(Result(target, self.clock(), error=why, kind="connection"))
            else:
                out.append(Result(target, times[target.name], text=samples[target.name]))
        return out

    def _all_failed(self, members: list[Target], error: str, kind: str) -> list[Result]:
        now = self.clock()
        return [Result(t, now, error=error, kind=kind) for t in members]


def _vector(body: Any) -> list[tuple[dict[str, str], float, float]]:
    """(labels, timestamp, value) of an instant-vector answer; raises ValueError for anything else."""
    if not isinstance(body, dict) or body.get("status") != "success":
        error = body.get("error") if isinstance(body, dict) else None
        raise ValueError(f"Prometheus query failed: {error or body!r}")
    data = body.get("data") or {}
    if data.get("resultType") != "vector":
        raise ValueError(f"Prometheus answered a {data.get('resultType')!r}, not a vector")
    out = []
    for item in data.get("result") or []:
        try:
            at, raw = item["value"]
            out.append((dict(item["metric"]), float(at), float(raw)))
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"a malformed sample in Prometheus' answer: {item!r}") from exc
    return out
