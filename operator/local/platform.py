"""``kvpilot up -f inferenceservice.yaml --local``: the operator's loop on one machine, no cluster.

The platform is a thin adapter; everything that decides is the operator's own code::

    LocalApi (local.api)        an in-memory API: the operator's KubeClient with a dict for transport
      ▲  Reconciler             the operator's reconciler, unchanged: resolve, build_children, status
      ▲  Autotuner              the remediation loop, unchanged: scrape, window, evaluate(), re-render
      ▼  LocalKubelet           the rendered Deployment -> `kvpilot serve` processes, Pods, rollouts,
         (local.replicas)       crash restarts
    FrontDoor (local.frontdoor) one port for the OpenAI API, least-loaded ready replica

Triggers for a reconcile pass are those of the operator: start-up, a spec edit (the manifest file is
re-read when it changes: the user wins, as with ``kubectl apply``), the Pods or the Deployment's status
changing (kopf's Deployment events), and the Autotuner after an Auto change (``status.effective``).
SIGINT or SIGTERM stop the remediation loop and the front door, then every replica (SIGTERM to its
process group, SIGKILL after the grace period); a second signal shortens the grace period to nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import copy
import logging
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

from kvpilot.operator.api import names
from kvpilot.operator.api.rest import object_path
from kvpilot.operator.api.runtime import RUNTIME_VLLM
from kvpilot.operator.api.settings import resolve
from kvpilot.operator.api.spec import ModelSourceError, parse_model_source
from kvpilot.operator.api.timefmt import format_time
from kvpilot.operator.local.api import LocalApi
from kvpilot.operator.local.frontdoor import STATUS_PATH, FrontDoor
from kvpilot.operator.local.process import ENV_VLLM_PYTHON, RuntimeMissing, find_vllm_python
from kvpilot.operator.local.replicas import LocalKubelet
from kvpilot.operator.options import OperatorOptions
from kvpilot.operator.reconcile.reconciler import Reconciler
from kvpilot.operator.remediation.loop import Autotuner
from kvpilot.operator.remediation.pods import is_ready, metrics_url
from kvpilot.operator.router.hold import ColdStartHold

LOG = logging.getLogger("kvpilot.local")
MANIFEST_POLL_S = 2.0
MAX_EVENTS = 100


class LocalPlatform:
    """One InferenceService served from this machine (see the module docstring).

    ``isvc``: the object as read from the manifest (validated by the caller). ``manifest``: the file to
    watch for spec edits (None: none). ``model_dir``: run the replicas on this directory instead of the
    model source's path. ``port`` 0 picks a free one for the front door.
    """

    def __init__(
        self,
        isvc: dict[str, Any],
        *,
        log_dir: Path,
        manifest: Path | None = None,
        model_dir: str | None = None,
        host: str = "127.0.0.1",
        port: int = 8000,
        scrape_interval: float = 5.0,
        scrape_timeout: float = 3.0,
        record: str | None = None,
        status_interval: float = 10.0,
        gpu: bool | None = None,
        vllm_python: str | None = None,
        logger: Any = LOG,
    ) -> None:
        self.isvc = prepare(isvc)
        self.namespace = self.isvc["metadata"]["namespace"]
        self.name = self.isvc["metadata"]["name"]
        self.isvc_path = object_path(names.API_VERSION, names.KIND, self.namespace, self.name)
        self.manifest = manifest
        self.logger = logger
        self.status_interval = status_interval
        self.api = LocalApi()
        self.kubelet = LocalKubelet(
            self.api,
            self.namespace,
            self.name,
            log_dir,
            model_dir=model_dir,
            gpu=gpu,
            vllm_python=vllm_python,
            logger=logger,
            on_change=self.reconcile,
        )
        # A request that finds no ready replica (scaled to zero, or the only pod restarting) waits at
        # the door, which asks remediation for a replica (wake-requested-at) while it waits.
        hold = ColdStartHold(self.request_replica, logger=logger)
        self.door = FrontDoor(self.endpoints, self.snapshot, host=host, port=port, logger=logger, hold=hold)
        self.reconciler = Reconciler(self.api, self._post_event)
        options = OperatorOptions(
            namespaces=(self.namespace,),
            scrape_interval=scrape_interval,
            scrape_timeout=scrape_timeout,
            record=record,
        )
        self.autotuner = Autotuner(self.api, options, self.reconciler)
        self.events: collections.deque[dict[str, Any]] = collections.deque(maxlen=MAX_EVENTS)
        self._tasks: list[asyncio.Task] = []
        self._manifest_mtime = manifest.stat().st_mtime if manifest else None
        self._last_problems: str | None = None

    async def start(self) -> str:
        """Create the InferenceService, render its children, listen; returns the front door's URL."""
        await self.api.create(self.isvc)
        await self.reconcile(announce=True)
        url = await self.door.start()
        self._tasks = [
            asyncio.create_task(self.kubelet.run(), name="kubelet"),
            asyncio.create_task(self.autotuner.run_forever(self.logger), name="remediation"),
            asyncio.create_task(self._report_forever(), name="report"),
        ]
        if self.manifest is not None:
            self._tasks.append(asyncio.create_task(self._watch_manifest(), name="manifest"))
        return url

    async def close(self) -> None:
        """Stop the loops and the front door, then every replica; nothing is left running."""
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks = []
        await self.door.close()
        await self.autotuner.close()
        await self.kubelet.close()

    async def reconcile(self, announce: bool = False) -> None:
        """One reconcile pass on a fresh read, under the object's lock (``Reconciler.run``)."""
        outcome = await self.reconciler.run(self.namespace, self.name, self.logger, announce=announce)
        if outcome.gone:
            return
        problems = "; ".join(outcome.problems + outcome.conflicts) or None
        if problems and problems != self._last_problems:
            self.logger.error(f"{self.name}: not applied: {problems}")
        self._last_problems = problems

    async def _post_event(self, isvc: dict, type_: str, reason: str, message: str) -> None:
        self.events.append({"time": time.time(), "type": type_, "reason": reason, "message": message})
        if type_ == "Warning":
            self.logger.warning(f"{reason}: {message}")
        else:
            self.logger.debug(f"{reason}: {message}")

    async def request_replica(self) -> None:
        """The front door's wake: stamp ``wake-requested-at`` on the InferenceService (remediation adds
        a replica 0 -> 1 for a stamp newer than its last change; at one replica or more it is ignored)."""
        stamp = format_time(time.time())
        await self.api.merge_patch(
            self.isvc_path, {"metadata": {"annotations": {names.ANNOTATION_WAKE: stamp}}}
        )

    def endpoints(self) -> list[str]:
        """Base URLs of the ready engine pods the Service selects (not terminating)."""
        service = self.api.read(object_path("v1", "Service", self.namespace, self.name))
        if service is None:
            return []
        selector = ",".join(f"{k}={v}" for k, v in sorted(service["spec"]["selector"].items()))
        urls = []
        for pod in self.api.list("pods", self.namespace, selector):
            url = metrics_url(pod)
            if is_ready(pod) and url:
                urls.append(url.removesuffix(names.METRICS_PATH))
        return urls

    def snapshot(self) -> dict[str, Any]:
        """What ``/local/status`` answers: the InferenceService, the replicas, the door, recent events."""
        return {
            "inferenceService": self.api.read(self.isvc_path),
            "replicas": self.kubelet.snapshot(),
            "frontDoor": self.door.snapshot(),
            "events": list(self.events),
        }

    async def _watch_manifest(self) -> None:
        """Apply spec edits of the manifest file (as ``kubectl apply`` would: a new generation)."""
        while True:
            await asyncio.sleep(MANIFEST_POLL_S)
            try:
                mtime = self.manifest.stat().st_mtime
                if mtime == self._manifest_mtime:
                    continue
                self._manifest_mtime = mtime
                edited = prepare(load_isvc(self.manifest), self.namespace)
            except (OSError, yaml.YAMLError, ValueError) as exc:
                self.logger.warning(f"{self.manifest}: not re-read: {exc}")
                continue
            if edited["metadata"]["name"] != self.name:
                self.logger.warning(f"{self.manifest}: names {edited['metadata']['name']}, not {self.name}")
                continue
            live = self.api.read(self.isvc_path)
            if live is None or live.get("spec") == edited.get("spec"):
                continue
            live["spec"] = edited["spec"]
            stored = self.api.put(self.isvc_path, live)
            self.logger.info(f"{self.manifest}: spec changed (generation {stored['metadata']['generation']})")
            await self.reconcile(announce=True)

    async def _report_forever(self) -> None:
        while True:
            await asyncio.sleep(self.status_interval)
            self.logger.info(status_line(self.api.read(self.isvc_path), self.kubelet.snapshot()))


def status_line(isvc: dict[str, Any] | None, replicas: list[dict[str, Any]]) -> str:
    """One line: replicas, what the remediation loop last measured, the effective levers."""
    status = (isvc or {}).get("status") or {}
    effective = status.get("effective") or {}
    ready = sum(1 for r in replicas if r["ready"] and r["current"])
    parts = [f"{status.get('phase', 'Pending')}: {ready}/{effective.get('replicas', '?')} replicas ready"]
    signals = status.get("signals")
    if signals:
        parts.append(
            f"{signals['preemptionsPerSecond']:g} preemptions/s, KV cache {signals['kvCacheUsage']:.0%}, "
            f"{signals['requestsWaiting']:g} waiting per replica"
        )
    else:
        parts.append("no complete metrics window yet")
    levers = ("gpuMemoryUtilization", "maxNumSeqs", "maxNumBatchedTokens", "tensorParallelSize")
    parts.append(" ".join(f"{k}={effective[k]:g}" for k in levers if k in effective))
    return " | ".join(parts)


def prepare(isvc: dict[str, Any], namespace: str = "default") -> dict[str, Any]:
    """A copy of the manifest's object as the API would store it (apiVersion, kind, a namespace)."""
    isvc = copy.deepcopy(isvc)
    isvc.setdefault("apiVersion", names.API_VERSION)
    isvc.setdefault("kind", names.KIND)
    meta = isvc.setdefault("metadata", {})
    meta.setdefault("namespace", namespace)
    for key in ("uid", "resourceVersion", "generation", "creationTimestamp"):
        meta.pop(key, None)
    isvc.pop("status", None)
    return isvc


def load_isvc(path: Path) -> dict[str, Any]:
    """The one InferenceService in the YAML file ``path``; ValueError when there is not exactly one."""
    with open(path, encoding="utf-8") as handle:
        documents = [d for d in yaml.safe_load_all(handle) if isinstance(d, dict)]
    found = [d for d in documents if d.get("kind") == names.KIND]
    if len(found) != 1:
        raise ValueError(f"{path} must hold exactly one {names.KIND}, found {len(found)}")
    return found[0]


def local_model_problem(isvc: dict[str, Any], model_dir: str | None) -> str | None:
    """Why the model source cannot run locally without ``--model``, or None."""
    if model_dir:
        return None if Path(model_dir).is_dir() else f"--model {model_dir}: not a directory"
    try:
        source = parse_model_source(isvc["spec"]["model"]["source"])
    except (ModelSourceError, KeyError, TypeError) as exc:
        return str(exc)
    if source.scheme == "pvc":
        return "a pvc:// model source needs a cluster: pass --model DIR (a local Hugging Face directory)"
    if source.scheme == "file" and not Path(source.path).is_dir():
        return f"{source.path} (the model source) is not a directory here: pass --model DIR"
    return None


# --- the command --------------------------------------------------------------------------------


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register ``kvpilot up``."""
    up = subparsers.add_parser(
        "up",
        help="run an InferenceService on this machine (--local), remediation included",
        description="Run the InferenceService in FILE on this machine: each replica is a `kvpilot serve` "
        "process started with the args the operator renders, behind one OpenAI-compatible port; the "
        "operator's remediation loop scrapes them and restarts, adds or removes replicas as it would in a "
        "cluster. Edits to FILE are applied while it runs. Ctrl-C stops everything.",
    )
    up.add_argument("-f", "--filename", required=True, type=Path, metavar="FILE", help="manifest file")
    up.add_argument(
        "--local", action="store_true", help="run on this machine (the only platform `up` has today)"
    )
    up.add_argument(
        "--model", default=None, metavar="DIR", help="model directory to use instead of spec.model.source"
    )
    up.add_argument("--host", default="127.0.0.1", help="front door address (default: %(default)s)")
    up.add_argument(
        "--port", type=int, default=8000, help="front door port; 0 picks a free one (default: %(default)s)"
    )
    up.add_argument("-n", "--namespace", default="default", help="namespace for a manifest that names none")
    up.add_argument(
        "--scrape-interval",
        type=float,
        default=5.0,
        metavar="SECONDS",
        help="read every replica's /metrics and evaluate remediation this often (default: %(default)s)",
    )
    up.add_argument("--scrape-timeout", type=float, default=3.0, metavar="SECONDS", help=argparse.SUPPRESS)
    up.add_argument(
        "--record", default=None, metavar="FILE", help="append every scrape to FILE (for `kvpilot replay`)"
    )
    up.add_argument(
        "--log-dir", type=Path, default=None, metavar="DIR", help="replica logs (default: a new temp dir)"
    )
    up.add_argument(
        "--status-interval",
        type=float,
        default=10.0,
        metavar="SECONDS",
        help="log a status line this often (default: %(default)s)",
    )
    up.add_argument(
        "--vllm-python",
        default=None,
        metavar="PATH",
        help="for spec.runtime vllm: the Python interpreter that has vLLM installed (default: "
        f"${ENV_VLLM_PYTHON}, else this interpreter if it can import vllm)",
    )
    up.add_argument("-v", "--verbose", action="store_true", help="log at debug level")
    up.set_defaults(func=run_up)


def run_up(args: argparse.Namespace) -> int:
    """``kvpilot up -f FILE --local``: 0 after a clean stop, 1 when it cannot start, 2 for bad usage."""
    if not args.local:
        print(
            "error: `kvpilot up` runs on this machine only: pass --local. For a cluster: "
            "helm install kvpilot charts/kvpilot, then kubectl apply -f FILE.",
            file=sys.stderr,
        )
        return 2
    try:
        isvc = prepare(load_isvc(args.filename), args.namespace)
    except (OSError, yaml.YAMLError, ValueError) as exc:
        print(f"error: cannot read {args.filename}: {exc}", file=sys.stderr)
        return 1
    settings = resolve(isvc)
    problems = list(settings.problems)
    problem = local_model_problem(isvc, args.model)
    vllm_python = None
    if not problems and settings.spec.get("runtime") == RUNTIME_VLLM:
        try:
            vllm_python = find_vllm_python(args.vllm_python)
        except RuntimeMissing as exc:
            problems.append(str(exc))
    for line in problems + ([problem] if problem else []):
        print(f"error: {line}", file=sys.stderr)
    if problems or problem:
        return 1
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)-7s %(message)s",
        datefmt="%H:%M:%S",
        stream=sys.stderr,
    )
    logging.getLogger("aiohttp").setLevel(logging.WARNING)
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="kvpilot-up-"))
    platform = LocalPlatform(
        isvc,
        log_dir=log_dir,
        manifest=args.filename,
        model_dir=args.model,
        host=args.host,
        port=args.port,
        scrape_interval=args.scrape_interval,
        scrape_timeout=args.scrape_timeout,
        record=args.record,
        status_interval=args.status_interval,
        vllm_python=vllm_python,
    )
    return asyncio.run(_serve(platform, log_dir))


async def _serve(platform: LocalPlatform, log_dir: Path) -> int:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()

    def on_signal(signum: int) -> None:
        if stop.is_set():
            platform.kubelet.grace_max_s = 0.0  # a second Ctrl-C: do not wait for the engines
        LOG.info(f"{signal.Signals(signum).name}: stopping")
        stop.set()

    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, on_signal, signum)
    try:
        try:
            url = await platform.start()
        except OSError as exc:
            LOG.error(f"cannot start the front door on {platform.door.host}:{platform.door.port}: {exc}")
            return 1
        mode = resolve(platform.isvc).remediation.mode
        LOG.info(
            f"kvpilot up: {names.KIND} {platform.namespace}/{platform.name} (remediation {mode}); "
            f"OpenAI API on {url}/v1, status on {url}{STATUS_PATH}; replica logs in {log_dir}; "
            "Ctrl-C stops everything"
        )
        await stop.wait()
        return 0
    finally:
        await platform.close()
        LOG.info("stopped: every replica has exited")
