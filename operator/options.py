"""How the operator runs (``kvpilot operator`` flags; the local platform sets its own).

One dataclass for the reconciler, the remediation loop and the kopf handlers, so a flag is declared
once and reaches every part that reads it.
"""

from __future__ import annotations

import dataclasses

from kvpilot.operator.api.platform import DEFAULT_PLATFORM, Platform


@dataclasses.dataclass(frozen=True)
class OperatorOptions:
    """``namespaces`` / ``clusterwide``: the scope served. ``resync_interval``: seconds between passes
    over every InferenceService. ``watch_timeout``: kopf's watch request timeout. ``service_monitors``:
    whether ServiceMonitors may be managed (RBAC). ``scrape_interval`` / ``scrape_timeout``: the
    remediation loop's period and per-pod timeout, in seconds. ``record``: a file to append every scrape
    to (``kvpilot replay`` reads it). ``platform``: the default engine image and the allowlists every
    InferenceService is resolved with."""

    namespaces: tuple[str, ...] = ()
    clusterwide: bool = False
    resync_interval: float = 300.0
    watch_timeout: float = 300.0
    service_monitors: bool = False
    scrape_interval: float = 15.0
    scrape_timeout: float = 3.0
    record: str | None = None
    platform: Platform = DEFAULT_PLATFORM

    @property
    def scopes(self) -> list[str | None]:
        """The namespaces to list in (None: every namespace)."""
        return [None] if self.clusterwide else list(self.namespaces)
