"""Timestamps as the operator writes and reads them: RFC 3339 in UTC, and unix seconds.

Kubernetes writes second precision (``2025-01-02T03:04:05Z``, :func:`rfc3339`); remediation history
and signals carry milliseconds (:func:`format_time`). :func:`parse_time` reads both.
"""

from __future__ import annotations

import datetime


def rfc3339(now: datetime.datetime) -> str:
    """``2025-01-02T03:04:05Z`` (what Kubernetes writes in timestamps)."""
    return now.astimezone(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_time(value: str | float | int) -> float:
    """An RFC 3339 timestamp (or unix seconds) as unix seconds."""
    if isinstance(value, int | float):
        return float(value)
    return datetime.datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()


def format_time(value: float) -> str:
    """Unix seconds as RFC 3339 with milliseconds (``2025-01-02T03:04:05.123Z``)."""
    moment = datetime.datetime.fromtimestamp(value, datetime.UTC)
    return moment.strftime("%Y-%m-%dT%H:%M:%S.") + f"{moment.microsecond // 1000:03d}Z"
