"""The engine settings that change at run time, between two steps, without a restart (torch-free).

``max_num_seqs`` and ``max_num_batched_tokens`` (the scheduler's bounds), ``max_waiting_requests``
(the server's admission bound) and ``preemption_mode`` need no reallocation: the KV pool, the CPU swap
pool and the buffers the engine sized at start-up stay as they are. So the two scheduler bounds may
go down and back up to their start-up values, never above them (the activation memory and the KV pool
were sized for those), and ``swap`` needs the CPU pool that ``swap_space`` reserved at start-up.

:func:`apply_update` validates a whole update (``POST /admin/config``'s body) against the values in
force exactly as ``EngineArgs`` validates them at start-up, plus those bounds, and returns the new
values; nothing is applied unless every key passes.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from kvpilot.engine.config import EngineArgs, engine_arg_fields
from kvpilot.engine.errors import ConfigError

# The keys an update may carry, in this order in every answer.
LIVE_KEYS = ("max_num_seqs", "max_num_batched_tokens", "max_waiting_requests", "preemption_mode")


@dataclass(frozen=True)
class LiveLimits:
    """What an update must stay within: the start-up values of the two scheduler bounds (the
    ceilings), ``max_model_len`` and chunked prefill (a step must hold a whole prompt without it), and
    the CPU pool's size (swap needs one)."""

    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    enable_chunked_prefill: bool
    num_cpu_blocks: int


@dataclass(frozen=True)
class LiveConfig:
    """The run-time settings in force. ``max_waiting_requests`` None: no admission bound."""

    max_num_seqs: int
    max_num_batched_tokens: int
    max_waiting_requests: int | None
    preemption_mode: str

    def as_dict(self) -> dict[str, Any]:
        return {key: getattr(self, key) for key in LIVE_KEYS}


def apply_update(current: LiveConfig, update: Any, limits: LiveLimits) -> LiveConfig:
    """``current`` with ``update`` (a JSON object of snake_case names) applied; raises ConfigError
    naming the first offending key and why. An empty object changes nothing."""
    if not isinstance(update, dict):
        raise ConfigError("the body must be a JSON object of engine argument names and values")
    engine_args = {f.name for f in engine_arg_fields()}
    for key in update:
        if key in LIVE_KEYS:
            continue
        if key in engine_args:
            raise ConfigError(
                f"{key} cannot change at run time (it sizes memory or the model): restart with it"
            )
        live = ", ".join(LIVE_KEYS)
        raise ConfigError(f"unknown setting {key!r}; the settings that change at run time are {live}")
    values = {**current.as_dict(), **update}
    waiting = values["max_waiting_requests"]
    if waiting is not None and (isinstance(waiting, bool) or not isinstance(waiting, int) or waiting < 0):
        raise ConfigError(f"max_waiting_requests must be an integer >= 0 or null, got {waiting!r}")
    # The start-up validation of the engine arguments, on the values that would be in force.
    EngineArgs(
        max_num_seqs=values["max_num_seqs"],
        max_num_batched_tokens=values["max_num_batched_tokens"],
        preemption_mode=values["preemption_mode"],
    )
    for key in ("max_num_seqs", "max_num_batched_tokens"):
        ceiling = getattr(limits, key)
        if values[key] > ceiling:
            raise ConfigError(
                f"{key} {values[key]} is above its start-up value {ceiling}, which sized the engine's "
                "memory: restart with a larger one"
            )
    if not limits.enable_chunked_prefill and values["max_num_batched_tokens"] < limits.max_model_len:
        raise ConfigError(
            f"without chunked prefill max_num_batched_tokens ({values['max_num_batched_tokens']}) must be "
            f">= max_model_len ({limits.max_model_len})"
        )
    if values["preemption_mode"] == "swap" and limits.num_cpu_blocks == 0:
        raise ConfigError(
            "preemption_mode swap needs the CPU swap pool, which this engine has none of: restart with "
            "--preemption-mode swap (and --swap-space)"
        )
    return dataclasses.replace(current, **{key: values[key] for key in LIVE_KEYS})
