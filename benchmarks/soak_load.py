"""The soak's load: one client process of mixed, partly hostile requests over loopback.

Each request is drawn from a seeded mix: completions and chat, streamed and whole, ``n`` 1..4, random
``max_tokens``, ``stop`` and ``logprobs``, batched prompts; some clients leave early (a streamed reply
after a few chunks, a whole one after a short timeout); a slice is hostile (too many or too long stop
strings, too many stop token ids, prompts x n over the limit, tens of thousands of unknown fields,
malformed bodies, a prompt past the context, out-of-range values, an unknown model). Every request ends
in exactly one outcome (:data:`OUTCOMES`); a client returns its counts, a few examples of each
outcome that is a failure, and the sequences (prompts x ``n``) of its completed and its left requests,
which the soak checks against the server's own count of finished sequences. A stream the client left
after it had seen every choice's ``finish_reason`` counts as left too (the client did not read to
``[DONE]``), but the server had finished it: its sequences are also counted apart (``left_finished``).
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

import httpx

# completed: a 200 answered in full; refused: 429/503 with Retry-After; rejected: the 4xx a hostile
# request must get; aborted: the client left on purpose. The rest are failures.
OUTCOMES = ("completed", "refused", "rejected", "aborted", "server_error", "unexpected", "failed")
FAILURES = ("server_error", "unexpected", "failed")
WORDS = "the of a model cache block token stream queue sequence batch prefix engine kernel page".split()
MAX_EXAMPLES = 5


@dataclass(frozen=True)
class LoadConfig:
    """What one client process sends: ``concurrency`` requests in flight until ``duration_s`` is up."""

    base_url: str
    model: str
    duration_s: float
    concurrency: int
    seed: int
    max_model_len: int
    hostile_share: float = 0.12
    disconnect_share: float = 0.18


def _prompt(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 40)))


def _sampling(rng: random.Random) -> dict[str, Any]:
    body: dict[str, Any] = {"n": rng.randint(1, 4), "max_tokens": rng.randint(1, 96)}
    body["temperature"] = rng.choice([0.0, 0.7, 1.0])
    if rng.random() < 0.5:
        body["ignore_eos"] = True
    if rng.random() < 0.4:
        body["stop"] = [rng.choice(WORDS) for _ in range(rng.randint(1, 4))]
    if rng.random() < 0.3:
        body["seed"] = rng.randrange(1 << 30)
    return body


def valid_request(rng: random.Random, model: str) -> tuple[str, dict[str, Any]]:
    """A well-formed request (path, body) that fits the context."""
    body = {"model": model, **_sampling(rng), "stream": rng.random() < 0.5}
    if rng.random() < 0.4:
        body["messages"] = [{"role": "user", "content": _prompt(rng)}]
        if rng.random() < 0.3:
            body["logprobs"], body["top_logprobs"] = True, rng.randint(0, 5)
        return "/v1/chat/completions", body
    body["prompt"] = _prompt(rng) if rng.random() < 0.8 else [_prompt(rng) for _ in range(rng.randint(2, 3))]
    if rng.random() < 0.3:
        body["logprobs"] = rng.randint(0, 5)
    return "/v1/completions", body


def hostile_request(rng: random.Random, model: str, max_model_len: int) -> tuple[str, bytes, set[int]]:
    """An abusive request: (path, raw body, the statuses a healthy server answers it with)."""
    base = {"model": model, "prompt": "hello", "max_tokens": 4}
    cases = [
        ({**base, "stop": [f"s{i}" for i in range(rng.randint(65, 2000))]}, {400}),
        ({**base, "stop": ["x" * rng.randint(257, 20_000)]}, {400}),
        ({**base, "stop_token_ids": [1] * rng.randint(257, 5000)}, {400}),
        ({**base, "prompt": ["p"] * 2048, "n": rng.randint(1, 128)}, {400}),
        ({**base, **{f"junk_{i}": i for i in range(rng.randint(1000, 20_000))}}, {200, 503}),
        ({**base, "prompt": [5] * (max_model_len + rng.randint(1, 100))}, {400}),
        ({**base, "n": rng.randint(129, 10**6)}, {400}),
        ({**base, "temperature": -1.0}, {400}),
        ({**base, "model": "not-this-model"}, {404}),
        (b'{"prompt": "x", "max_tokens": ', {400}),
        (b'{"prompt": "\xff\xfe"}', {400}),
    ]
    body, expected = rng.choice(cases)
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    return "/v1/completions", raw, expected


class Client:
    """One process's requests; counts outcomes and keeps a few examples of failures."""

    def __init__(self, cfg: LoadConfig) -> None:
        self.cfg = cfg
        self.rng = random.Random(cfg.seed)
        self.counts: Counter[str] = Counter()
        self.seqs: Counter[str] = Counter()  # completed, left, left_finished
        self.examples: dict[str, list[str]] = {}

    def _record(self, outcome: str, detail: str = "") -> None:
        self.counts[outcome] += 1
        if outcome in FAILURES and len(self.examples.setdefault(outcome, [])) < MAX_EXAMPLES:
            self.examples[outcome].append(detail[:300])

    def _answered(self, response: httpx.Response, text: str, expected: set[int] | None, seqs: int) -> None:
        status = response.status_code
        if expected is not None and status in expected and status != 200:
            self._record("rejected" if status < 500 else "refused")
        elif status in (429, 503) and response.headers.get("retry-after"):
            self._record("refused")
        elif status >= 500:
            self._record("server_error", f"{status} {text}")
        elif status != 200 or (expected is not None and status not in expected):
            self._record("unexpected", f"{status} {text}")
        else:
            self._record("completed")
            self.seqs["completed"] += seqs

    def _left(self, seqs: int, finished: bool = False) -> None:
        self._record("aborted")
        self.seqs["left"] += seqs
        if finished:
            self.seqs["left_finished"] += seqs

    async def one(self, http: httpx.AsyncClient) -> None:
        rng, cfg = self.rng, self.cfg
        if rng.random() < cfg.hostile_share:
            path, raw, expected = hostile_request(rng, cfg.model, cfg.max_model_len)
            response = await http.post(path, content=raw, headers={"content-type": "application/json"})
            self._answered(response, response.text, expected, seqs=1)  # the one accepted case: n 1
            return
        path, body = valid_request(rng, cfg.model)
        seqs = (len(body["prompt"]) if isinstance(body.get("prompt"), list) else 1) * body["n"]
        leave = rng.random() < cfg.disconnect_share
        if body["stream"]:
            await self._stream(http, path, body, seqs, rng.randint(0, 6) if leave else None)
        elif leave:
            try:
                response = await asyncio.wait_for(http.post(path, json=body), rng.uniform(0.01, 0.5))
            except TimeoutError:
                self._left(seqs)
                return
            self._answered(response, response.text, None, seqs)
        else:
            response = await http.post(path, json=body)
            self._answered(response, response.text, None, seqs)
            if response.status_code == 200:
                choices = response.json()["choices"]
                prompts = len(body["prompt"]) if isinstance(body.get("prompt"), list) else 1
                if len(choices) != prompts * body["n"]:
                    self.counts["completed"] -= 1
                    self.seqs["completed"] -= seqs
                    self._record("unexpected", f"{len(choices)} choices for {prompts} x {body['n']}")

    async def _stream(
        self, http: httpx.AsyncClient, path: str, body: dict, seqs: int, leave_after: int | None
    ) -> None:
        async with http.stream("POST", path, json=body) as response:
            if response.status_code != 200:
                await response.aread()
                self._answered(response, response.text, None, seqs)
                return
            events = 0
            finished: set[int] = set()  # the choices whose finish_reason this client has seen
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    self._record("completed")
                    self.seqs["completed"] += seqs
                    return
                if '"error"' in line[:20]:
                    self._record("server_error", line)
                    return
                events += 1
                try:
                    choices = json.loads(line[len("data: ") :]).get("choices") or []
                except json.JSONDecodeError:
                    choices = []
                finished.update(c["index"] for c in choices if c.get("finish_reason"))
                if leave_after is not None and events >= leave_after:
                    self._left(seqs, finished=len(finished) == seqs)
                    return  # leaving the block closes the connection: the server must abort
        self._record("failed", "the stream ended without [DONE]")

    async def run(self) -> dict[str, Any]:
        limits = httpx.Limits(max_connections=self.cfg.concurrency + 2)
        timeout = httpx.Timeout(120.0, connect=10.0)
        deadline = time.monotonic() + self.cfg.duration_s
        async with httpx.AsyncClient(base_url=self.cfg.base_url, limits=limits, timeout=timeout) as http:

            async def worker() -> None:
                while time.monotonic() < deadline:
                    try:
                        await self.one(http)
                    except httpx.HTTPError as exc:
                        self._record("failed", f"{type(exc).__name__}: {exc}")

            await asyncio.gather(*(worker() for _ in range(self.cfg.concurrency)))
        return {"counts": dict(self.counts), "examples": self.examples, "seqs": dict(self.seqs)}


def client_main(cfg: LoadConfig) -> dict[str, Any]:
    """Entry point of a client process: run the load, return the counts."""
    return asyncio.run(Client(cfg).run())
