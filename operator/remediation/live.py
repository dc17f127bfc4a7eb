"""Live levers in the running pods: ``POST /admin/config`` to every ready engine pod, each answer checked.

kvpilot's engine changes ``max_num_seqs`` and ``max_num_batched_tokens`` between two steps, without a
restart, and answers with the settings now in force. A pod that refuses (any status but 200), does not
answer, or answers without the value asked for has not applied the change: the remediation loop then
reverts it (``evaluate.revert_update``) and the lever stays frozen until the spec changes.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import json
from collections.abc import Iterable
from typing import Any

import aiohttp

from kvpilot.operator.api import names
from kvpilot.operator.api.rest import ApiError, Kube, object_path
from kvpilot.operator.remediation.pods import Target

MAX_ANSWER_BYTES = 64 * 1024


def admin_url(target: Target) -> str:
    """The pod's ``/admin/config`` (its scrape URL with the path replaced)."""
    return target.url.removesuffix(names.METRICS_PATH) + names.ADMIN_CONFIG_PATH


async def read_api_key(kube: Kube, namespace: str, spec: dict[str, Any]) -> str | None:
    """The engines' API key, from the Secret ``spec.apiKeySecretRef`` names (None: no key set).
    Raises ValueError when the Secret or its key is missing or unreadable."""
    ref = spec.get("apiKeySecretRef")
    if not ref:
        return None
    try:
        secret = await kube.get(object_path("v1", "Secret", namespace, ref["name"]))
    except ApiError as exc:
        raise ValueError(f"cannot read Secret {ref['name']}: {exc}") from None
    if secret is None:
        raise ValueError(f"Secret {ref['name']} (spec.apiKeySecretRef) does not exist")
    data = (secret.get("data") or {}).get(ref["key"])
    if data is None:
        raise ValueError(f"Secret {ref['name']} has no key {ref['key']!r} (spec.apiKeySecretRef)")
    try:
        key = base64.b64decode(data, validate=True).decode("utf-8").strip()
    except (binascii.Error, UnicodeDecodeError):
        raise ValueError(f"Secret {ref['name']} key {ref['key']!r} is not base64 UTF-8 text") from None
    if not key:
        raise ValueError(f"Secret {ref['name']} key {ref['key']!r} is empty")
    return key


class LiveApplier:
    """Posts one update to many pods concurrently over one HTTP session."""

    def __init__(self, timeout_s: float = 3.0) -> None:
        self.timeout_s = timeout_s
        self._session: aiohttp.ClientSession | None = None

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def apply(
        self, targets: Iterable[Target], update: dict[str, Any], api_key: str | None
    ) -> dict[str, str | None]:
        """``update`` posted to each target: pod name -> None (applied and reported), or why not."""
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=self.timeout_s),
                headers={"User-Agent": names.FIELD_MANAGER},
            )
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        targets = list(targets)
        answers = await asyncio.gather(*(self._one(t, update, headers) for t in targets))
        return {t.name: why for t, why in zip(targets, answers, strict=True)}

    async def _one(self, target: Target, update: dict[str, Any], headers: dict[str, str]) -> str | None:
        try:
            async with self._session.post(
                admin_url(target), json=update, headers=headers, allow_redirects=False
            ) as response:
                body = await response.content.read(MAX_ANSWER_BYTES)
                if response.status != 200:
                    return f"refused: HTTP {response.status}{_message(body)}"
        except TimeoutError:
            return f"no answer within {self.timeout_s:g}s"
        except aiohttp.ClientError as exc:
            return f"{type(exc).__name__}: {exc}"[:300]
        try:
            config = json.loads(body)
        except ValueError:
            return "answered 200 without a JSON object"
        if not isinstance(config, dict):
            return "answered 200 without a JSON object"
        wrong = {k: config.get(k) for k, v in update.items() if config.get(k) != v}
        if wrong:
            shown = ", ".join(f"{k}={v!r} (asked {update[k]!r})" for k, v in wrong.items())
            return f"reports {shown}"
        return None


def _message(body: bytes) -> str:
    """``: <message>`` of an OpenAI-style error body, or nothing."""
    try:
        message = json.loads(body)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return ""
    return f": {str(message)[:300]}"
