"""Prefix affinity without a tokenizer: the prompt as one canonical string, cut into blocks of
``block_chars`` characters and hashed as a chain, so that block ``i``'s hash stands for the whole
prefix up to it (as the engine's prefix cache hashes token blocks). :class:`PrefixIndex` remembers
which replicas served each block hash, in a bounded LRU map; a new request's longest matching prefix
per replica is then one lookup per block.

Pure: no I/O and no clock. About 4 characters make a token, so the 64-character default block is
close to one 16-token KV block of the engine.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any

COMPLETIONS_PATH = "/v1/completions"
CHAT_COMPLETIONS_PATH = "/v1/chat/completions"


@dataclasses.dataclass(frozen=True)
class PrefixConfig:
    """``block_chars``: characters per hashed block (only full blocks count, as only full KV blocks are
    cached). ``max_blocks``: blocks hashed per request at most (the work per request is bounded).
    ``capacity``: block hashes the index keeps (the memory bound: about 200 bytes each).
    ``replicas_per_block``: replicas remembered per block hash, most recent last.
    ``chars_per_token``: how the door turns a prompt's characters into the tokens it costs until it
    has learned the replicas' own ratio (English text under a BPE vocabulary: about 4)."""

    block_chars: int = 64
    max_blocks: int = 128
    capacity: int = 32768
    replicas_per_block: int = 4
    chars_per_token: float = 4.0

    def __post_init__(self) -> None:
        for name in ("block_chars", "max_blocks", "capacity", "replicas_per_block"):
            if getattr(self, name) < 1:
                raise ValueError(f"PrefixConfig.{name} must be at least 1, not {getattr(self, name)}")
        if not self.chars_per_token > 0:
            raise ValueError(f"PrefixConfig.chars_per_token must be positive, not {self.chars_per_token}")


def _content_text(content: Any) -> str:
    """A chat message's content as text: a string as is, a list of parts joined (text parts by their
    text, any other part by its JSON)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if isinstance(part, dict) and isinstance(part.get("text"), str):
                parts.append(part["text"])
            else:
                parts.append(json.dumps(part, sort_keys=True))
        return "".join(parts)
    return "" if content is None else json.dumps(content, sort_keys=True)


def request_object(body: bytes) -> dict[str, Any] | None:
    """A request body as its JSON object, or None when it is not one."""
    try:
        request = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return None
    return request if isinstance(request, dict) else None


def prompt_text(path: str, body: bytes | dict[str, Any] | None) -> str | None:
    """The canonical prompt of an OpenAI request (its body, or the body's :func:`request_object`), or
    None when it has none the prefix cache would see (another path, a body that is not a JSON object,
    no prompt).

    Chat: the model, the tools (a chat template renders them before the messages), then each message
    as ``role`` and content, separated by control characters no text holds. Completions: the model
    then the prompt (a string; token ids as decimal text; of a batch, the first prompt).
    """
    if path not in (COMPLETIONS_PATH, CHAT_COMPLETIONS_PATH):
        return None
    request = request_object(body) if isinstance(body, bytes | bytearray) else body
    if request is None:
        return None
    head = f"{request.get('model', '')}\x1e"
    if path == CHAT_COMPLETIONS_PATH:
        messages = request.get("messages")
        if not isinstance(messages, list) or not messages:
            return None
        tools = request.get("tools")
        if tools:
            head += json.dumps(tools, sort_keys=True) + "\x1e"
        rendered = [
            f"{m.get('role', '')}\x1f{_content_text(m.get('content'))}\x1e" if isinstance(m, dict) else ""
            for m in messages
        ]
        return head + "".join(rendered)
    prompt = request.get("prompt")
    if isinstance(prompt, list) and prompt and not all(isinstance(t, int) for t in prompt):
        prompt = prompt[0]  # a batch: its first prompt
    if isinstance(prompt, str):
        return head + prompt
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return head + ",".join(map(str, prompt)) + ","
    return None


def block_hashes(text: str, config: PrefixConfig = PrefixConfig()) -> list[int]:
    """The chained hashes of ``text``'s full blocks (at most ``config.max_blocks``): hash ``i`` covers
    blocks ``0..i``, so two texts share hash ``i`` only when they share that whole prefix."""
    size = config.block_chars
    count = min(len(text) // size, config.max_blocks)
    hashes = []
    previous = b""
    for i in range(count):
        digest = hashlib.blake2b(previous + text[i * size : (i + 1) * size].encode(), digest_size=8)
        previous = digest.digest()
        hashes.append(int.from_bytes(previous, "big"))
    return hashes


class PrefixIndex:
    """Block hash -> the replicas that served a prompt with that prefix (most recent last), in an LRU
    map of at most ``config.capacity`` hashes. Not thread-safe: one event loop owns it."""

    def __init__(self, config: PrefixConfig = PrefixConfig()) -> None:
        self.config = config
        self._blocks: OrderedDict[int, tuple[str, ...]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._blocks)

    def matches(self, hashes: Sequence[int]) -> Mapping[str, int]:
        """Per replica, the number of leading blocks of ``hashes`` it served (replicas with none are
        absent). Chained hashes make the longest hit the whole matched prefix."""
        found: dict[str, int] = {}
        for i, block in enumerate(hashes):
            for url in self._blocks.get(block, ()):
                found[url] = i + 1
        return found

    def record(self, hashes: Sequence[int], url: str) -> None:
        """``url`` now holds the prefix of ``hashes``: remember it, evicting the least recently used
        hashes beyond the capacity."""
        keep = self.config.replicas_per_block
        for block in hashes:
            held = self._blocks.pop(block, ())
            self._blocks[block] = (*(u for u in held if u != url), url)[-keep:]
        while len(self._blocks) > self.config.capacity:
            self._blocks.popitem(last=False)

    def forget(self, urls: set[str]) -> None:
        """Drop ``urls`` from every block (replicas that left); blocks left with none are removed."""
        for block in list(self._blocks):
            held = tuple(u for u in self._blocks[block] if u not in urls)
            if held:
                self._blocks[block] = held
            else:
                del self._blocks[block]
