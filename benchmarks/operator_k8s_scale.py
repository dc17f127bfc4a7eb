"""The operator at scale on the real control plane: N InferenceServices (200 by default) with their
pods on kwok's simulated nodes, one ``kvpilot operator`` process.

The control plane is the cluster tests' (tests/k8s/cluster.py: etcd, kube-apiserver,
kube-controller-manager, kube-scheduler and kwok; ``make k8s-tools`` builds it). Every engine pod
gets a kwok address 127.1.x.y, and this script serves a vLLM-sized ``/metrics`` (~25 KiB, latency
histograms included) on each of them at the engine port, so every remediation tick scrapes, parses
and judges N real HTTP answers. Remediation runs in mode Recommend (nothing is changed).

Measured, printed and written as JSON (``benchmarks/results/operator_k8s_scale.json``):

- ``create_to_ready_s``: from one ``kubectl apply`` of N InferenceServices until every one is
  phase Ready (the operator's children created, kube-controller-manager's ReplicaSets and pods, kwok
  making them Ready, the operator's status following);
- the reconcile and tick time distributions, from the operator's own histograms
  (``kvpilot_operator_reconcile_duration_seconds``, ``kvpilot_operator_tick_duration_seconds``);
- the operator's resident memory: started, converged, and after the steady ticks;
- the operator's API requests per tick in the steady state, by verb (from the API server's audit
  log): a settled fleet should cost reads, not writes;
- ``rollout_s``: a spec change to all N until every one has rolled out again.

    python benchmarks/operator_k8s_scale.py              # 200 InferenceServices
    python benchmarks/operator_k8s_scale.py --services 50
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

try:
    from tests.k8s.cluster import OPERATOR_TOKEN, OPERATOR_USER, Cluster
except ImportError:  # run as a script: put the repository root on the path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tests.k8s.cluster import OPERATOR_TOKEN, OPERATOR_USER, Cluster

from kvpilot.operator.api import names
from tests.k8s.test_control_plane import isvc as cluster_test_isvc
from tests.operator.conftest import OperatorProcess, wait_for
from tests.operator.test_operator_kmock import free_port
from tests.operator.test_operator_scale import vllm_sized_engine

RESULTS = Path(__file__).resolve().parent / "results"
NS = "scale"
SCRAPE_INTERVAL_S = 10.0
WINDOW_S = 30.0


def isvc(name: str, max_num_seqs: int) -> dict[str, Any]:
    """The cluster tests' InferenceService, in this namespace, remediation in mode Recommend."""
    body = cluster_test_isvc(name)
    body["metadata"]["namespace"] = NS
    body["spec"]["engine"]["maxNumSeqs"] = max_num_seqs
    body["spec"]["remediation"] = {"mode": "Recommend", "window": f"{WINDOW_S:g}s"}
    return body


class PodEndpoints:
    """One vLLM-sized exposition served on ``<pod IP>:8000`` for every pod IP added (an event loop
    in a thread of its own)."""

    def __init__(self) -> None:
        self.body = vllm_sized_engine().text().encode()
        self.requests = 0
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.ips: set[str] = set()
        self.runner = self._call(self._runner())

    def _call(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=60)

    async def _runner(self) -> web.AppRunner:
        async def metrics(_: web.Request) -> web.Response:
            self.requests += 1
            return web.Response(body=self.body, content_type="text/plain")

        app = web.Application()
        app.router.add_get(names.METRICS_PATH, metrics)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        return runner

    def add(self, ip: str) -> None:
        if ip not in self.ips:
            self._call(web.TCPSite(self.runner, ip, names.HTTP_PORT).start())
            self.ips.add(ip)

    def close(self) -> None:
        self._call(self.runner.cleanup())
        self.loop.call_soon_threadsafe(self.loop.stop)


def histogram(text: str, name: str) -> dict[str, Any]:
    """count, mean and the bucket bounds holding the median and the 99th percentile of one histogram
    (its label sets summed)."""
    buckets: dict[float, float] = collections.defaultdict(float)
    total = count = 0.0
    for family in text_string_to_metric_families(text):
        if family.name != name:
            continue
        for sample in family.samples:
            if sample.name == name + "_bucket":
                buckets[float(sample.labels["le"])] += sample.value
            elif sample.name == name + "_sum":
                total += sample.value
            elif sample.name == name + "_count":
                count += sample.value

    def quantile(q: float) -> float | None:
        return next((b for b in sorted(buckets) if count and buckets[b] >= q * count), None)

    return {
        "count": int(count),
        "mean_s": round(total / count, 4) if count else None,
        "p50_le_s": quantile(0.5),
        "p99_le_s": quantile(0.99),
    }


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return round(int(line.split()[1]) / 1024, 1)
    return 0.0


def phases(cluster: Cluster, generation: int) -> collections.Counter:
    items = json.loads(cluster.kubectl("get", "inferenceservices", "-n", NS, "-o", "json").stdout)["items"]
    out: collections.Counter = collections.Counter()
    for item in items:
        status = item.get("status") or {}
        done = status.get("phase") == "Ready" and status.get("observedGeneration") == generation
        out["Ready" if done else status.get("phase") or "none"] += 1
    return out


def reporting(cluster: Cluster) -> int:
    """InferenceServices whose status says their one pod reports a full window."""
    items = json.loads(cluster.kubectl("get", "inferenceservices", "-n", NS, "-o", "json").stdout)["items"]
    return sum(1 for i in items if ((i.get("status") or {}).get("signals") or {}).get("podsReporting") == 1)


def serve_pod_ips(cluster: Cluster, endpoints: PodEndpoints) -> int:
    pods = json.loads(cluster.kubectl("get", "pods", "-n", NS, "-o", "json").stdout)["items"]
    for pod in pods:
        ip = (pod.get("status") or {}).get("podIP")
        if ip:
            endpoints.add(ip)
    return len(pods)


def converge(cluster: Cluster, endpoints: PodEndpoints, services: int, generation: int) -> float:
    """Seconds until every InferenceService is Ready on ``generation`` (new pod IPs served meanwhile)."""
    began = time.monotonic()
    while True:
        serve_pod_ips(cluster, endpoints)
        counts = phases(cluster, generation)
        if counts["Ready"] == services:
            return time.monotonic() - began
        if time.monotonic() - began > 900:
            raise SystemExit(f"generation {generation} not Ready after 900 s: {dict(counts)}")
        time.sleep(1)


def run(services: int, steady_ticks: int, root: Path) -> dict[str, Any]:
    with Cluster(root, nodes=True) as cluster:
        cluster.install_crd(NS)
        cluster.provide_volume(NS)
        endpoints = PodEndpoints()
        port = free_port()
        operator = OperatorProcess(
            cluster.identity(OPERATOR_TOKEN),
            root,
            [NS],
            ["--scrape-interval", str(SCRAPE_INTERVAL_S), "--liveness", "", "--metrics-port", str(port),
             "--metrics-address", "127.0.0.1"],
        )  # fmt: skip
        metrics_url = f"http://127.0.0.1:{port}/metrics"

        def operator_metrics() -> str:
            with urllib.request.urlopen(metrics_url, timeout=30) as response:  # noqa: S310 - loopback
                return response.read().decode()

        try:
            wait_for(lambda: _answers(metrics_url), 60, "the operator's metrics")
            rss_start = rss_mib(operator.proc.pid)
            listing = {
                "apiVersion": "v1",
                "kind": "List",
                "items": [isvc(f"svc-{i:03d}", 8) for i in range(services)],
            }
            cluster.kubectl("apply", "-f", "-", input=json.dumps(listing))
            create_to_ready = converge(cluster, endpoints, services, 1)
            rss_converged = rss_mib(operator.proc.pid)
            print(f"{services} InferenceServices Ready in {create_to_ready:.1f}s; RSS {rss_converged} MiB")

            # The windows fill (each InferenceService's condition says how far, one write a tick), then
            # the steady state: `steady_ticks` remediation ticks of a settled fleet.
            began = time.monotonic()
            wait_for(lambda: reporting(cluster) == services, WINDOW_S * 6 + 120, "every window filled")
            window_fill = time.monotonic() - began
            ticks_before = histogram(operator_metrics(), "kvpilot_operator_tick_duration_seconds")["count"]
            audit_before, steady_began = len(cluster.audit(OPERATOR_USER)), time.monotonic()
            wait_for(
                lambda: (
                    histogram(operator_metrics(), "kvpilot_operator_tick_duration_seconds")["count"]
                    >= ticks_before + steady_ticks
                ),
                steady_ticks * SCRAPE_INTERVAL_S * 4 + 60,
                "the steady ticks",
            )
            steady = cluster.audit(OPERATOR_USER)[audit_before:]
            steady_s = time.monotonic() - steady_began
            text = operator_metrics()
            ticks = histogram(text, "kvpilot_operator_tick_duration_seconds")
            ticks_seen = ticks["count"] - ticks_before
            by_verb = collections.Counter(e["verb"] for e in steady)
            writes = collections.Counter(
                "/".join(filter(None, (e["verb"] + " " + e["objectRef"].get("resource", ""),
                                       e["objectRef"].get("subresource"))))
                for e in steady
                if e["verb"] in ("create", "update", "patch", "delete")
            )  # fmt: skip
            rss_steady = rss_mib(operator.proc.pid)

            # A spec change to every InferenceService, until all rolled out again.
            began = time.monotonic()
            for i in range(services):
                cluster.kubectl(
                    "patch", "-n", NS, f"inferenceservice/svc-{i:03d}", "--type=merge",
                    "-p", '{"spec":{"engine":{"maxNumSeqs":16}}}',
                )  # fmt: skip
            patched = time.monotonic() - began
            rollout = patched + converge(cluster, endpoints, services, 2)
            text = operator_metrics()
            return {
                "inference_services": services,
                "pods": services,
                "metrics_body_bytes": len(endpoints.body),
                "scrape_interval_s": SCRAPE_INTERVAL_S,
                "create_to_ready_s": round(create_to_ready, 1),
                "reconcile": histogram(text, "kvpilot_operator_reconcile_duration_seconds"),
                "tick": ticks,
                "steady_ticks": ticks_seen,
                "steady_requests_per_tick": {k: round(v / ticks_seen, 1) for k, v in sorted(by_verb.items())},
                "steady_s": round(steady_s, 1),
                "steady_writes": dict(writes),
                # signals.sampledAt is refreshed once a minute by design (SIGNALS_REFRESH_S).
                "steady_writes_per_service_per_min": round(
                    sum(writes.values()) / services / steady_s * 60, 2
                ),
                "steady_write_sample": [e.get("requestObject") for e in steady if e["verb"] == "patch"][:3],
                "window_s": WINDOW_S,
                "windows_filled_s": round(window_fill, 1),
                "scrapes_served": endpoints.requests,
                "rss_mib": {
                    "started": rss_start,
                    "converged": rss_converged,
                    "steady": rss_steady,
                    "after_rollout": rss_mib(operator.proc.pid),
                },  # fmt: skip
                "patch_all_s": round(patched, 1),
                "rollout_s": round(rollout, 1),
            }
        finally:
            operator.stop()
            endpoints.close()


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=5):  # noqa: S310 - loopback
            return True
    except OSError:
        return False


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--services", type=int, default=200)
    ap.add_argument("--steady-ticks", type=int, default=5)
    ap.add_argument("--out", type=Path, default=RESULTS / "operator_k8s_scale.json")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="kvpilot-k8s-scale-") as tmp:
        result = run(args.services, args.steady_ticks, Path(tmp))
    print(json.dumps(result, indent=1))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
