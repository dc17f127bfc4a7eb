"""How the operator runs (``kvpilot operator`` flags; the local platform sets its own).

One dataclass for the reconciler, the remediation loop and the kopf handlers, so a flag is declared
once and reaches every part that reads it.
"""

from __future__ import annotations

import dataclasses

from kvpilot.operator.api.platform import DEFAULT_PLATFORM, Platform

METRICS_SOURCE_PODS, METRICS_SOURCE_PROMETHEUS = "pods", "prometheus"
METRICS_SOURCES = (METRICS_SOURCE_PODS, METRICS_SOURCE_PROMETHEUS)


@dataclasses.dataclass(frozen=True)
class OperatorOptions:
    """``namespaces`` / ``clusterwide``: the scope served. ``resync_interval``: seconds between passes
    over every InferenceService. ``watch_timeout``: kopf's watch request timeout. ``service_monitors``:
    whether ServiceMonitors may be managed (RBAC). ``scrape_interval`` / ``scrape_timeout``: the
    remediation loop's period and per-pod timeout, in seconds. ``record``: a file to append every scrape
    to (``kvpilot replay`` reads it). ``platform``: the default engine image and the allowlists every
    InferenceService is resolved with. ``metrics_port`` / ``metrics_address``: where the operator serves
    its own ``/metrics`` (None: not served). ``metrics_source``: ``pods`` (scrape each engine pod) or
    ``prometheus`` (the same series by PromQL from ``prometheus_url``)."""

    namespaces: tuple[str, ...] = ()
    clusterwide: bool = False
    resync_interval: float = 300.0
    watch_timeout: int = 300
    service_monitors: bool = False
    scrape_interval: float = 15.0
    scrape_timeout: float = 3.0
    record: str | None = None
    platform: Platform = DEFAULT_PLATFORM
    metrics_port: int | None = None
    metrics_address: str = "0.0.0.0"
    metrics_source: str = "pods"
    prometheus_url: str | None = None

    def __post_init__(self) -> None:
        if self.metrics_source not in METRICS_SOURCES:
            raise ValueError(f"metrics_source must be one of {METRICS_SOURCES}, got {self.metrics_source!r}")
        if self.metrics_source == METRICS_SOURCE_PROMETHEUS and not self.prometheus_url:
            raise ValueError("metrics_source prometheus needs prometheus_url")

    @property
    def scopes(self) -> list[str | None]:
        """The namespaces to list in (None: every namespace)."""
        return [None] if self.clusterwide else list(self.namespaces)
