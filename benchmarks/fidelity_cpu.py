"""What the machine's CPUs did during one fidelity run, from ``/proc/stat``: the share of their time
the hypervisor gave to other guests (steal) and the share they were busy.

On a virtual machine, steal is time this guest wanted a CPU and did not get it. The plan cannot see
it coming: its step times are fitted on the recording of the settings in force, while another run,
minutes later, may share its cores with a noisy neighbour. On the 2-core box this benchmark runs on,
the engine's slowest TTFTs come with steal several times the run's own (the README has the figures),
so every run keeps its share and the report prints it beside the run's TTFT p99.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

STAT = Path("/proc/stat")
_FIELDS = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")


def cpu_times(stat: Path = STAT) -> dict[str, int] | None:
    """The machine's CPU time so far, in clock ticks by kind (``/proc/stat``'s ``cpu`` line); None
    where there is no such file."""
    try:
        first = stat.read_text().splitlines()[0].split()
    except (OSError, IndexError):
        return None
    if not first or first[0] != "cpu":
        return None
    return dict(zip(_FIELDS, map(int, first[1:9]), strict=False))


def shares(before: dict[str, int] | None, after: dict[str, int] | None) -> dict[str, float]:
    """Steal and busy (neither idle nor waiting on I/O) as shares of all the CPU time between the two
    readings; NaN without both."""
    if before is None or after is None:
        return {"steal": math.nan, "busy": math.nan}
    delta = {k: after.get(k, 0) - before.get(k, 0) for k in _FIELDS}
    total = sum(delta.values())
    if total <= 0:
        return {"steal": math.nan, "busy": math.nan}
    busy = total - delta["idle"] - delta["iowait"] - delta["steal"]
    return {"steal": delta["steal"] / total, "busy": busy / total}


def write(path: Path, before: dict[str, int] | None, after: dict[str, int] | None) -> None:
    path.write_text(json.dumps(shares(before, after)) + "\n")


def read(path: Path) -> dict[str, float]:
    """A run's shares as ``write`` kept them; NaN for a run kept without them."""
    try:
        kept = json.loads(path.read_text())
    except (OSError, ValueError):
        return {"steal": math.nan, "busy": math.nan}
    return {"steal": float(kept.get("steal", math.nan)), "busy": float(kept.get("busy", math.nan))}
