"""``kvpilot router``: the scoring front door in a cluster, in front of an InferenceService's pods.

    kvpilot router --listen 0.0.0.0:8000 --backends-dns <headless-service>.<ns>.svc:<engine port>
    kvpilot router --backend http://10.0.0.7:8000 --backend http://10.0.0.8:8000

Backends are the ``--backend`` URLs plus one ``http://IP:PORT`` per A/AAAA record of the
``--backends-dns`` host, re-resolved every ``--dns-refresh-s``. Requests are proxied by
:class:`~kvpilot.operator.router.proxy.BalancingProxy` (the local platform's front door too).
``/health`` answers 200 while a backend is known; ``/metrics`` is the router's own
(``kvpilot_router_*``), in Prometheus text. A request that finds no backend waits for one (at most
``--hold-max-waiting`` requests, ``--hold-timeout-s`` each; then a 503 with ``Retry-After``); with
``--wake NAMESPACE/NAME`` the router meanwhile asks for a replica of that InferenceService (scale from
zero, :mod:`~kvpilot.operator.router.wake`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from kvpilot.operator.api import names
from kvpilot.operator.router import scoring
from kvpilot.operator.router.discovery import DnsBackends, parse_host_port
from kvpilot.operator.router.hold import ColdStartHold
from kvpilot.operator.router.prefix import PrefixConfig
from kvpilot.operator.router.proxy import POLICIES, POLICY_SCORE, BalancingProxy
from kvpilot.operator.router.wake import SERVICE_ACCOUNT_DIR, ApiWaker, parse_target

LOG = logging.getLogger("kvpilot.router")
PREFIX = "kvpilot_router_"


class Router(BalancingProxy):
    """The proxy over static ``backends`` and, with ``dns``, the records of a headless Service;
    ``registry`` holds its metrics (see :class:`RouterCollector`)."""

    def __init__(self, backends: list[str], dns: DnsBackends | None = None, **options: Any) -> None:
        self.static = [url.rstrip("/") for url in backends]
        self.dns = dns
        super().__init__(self.backends, **options)
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(RouterCollector(self))

    def backends(self) -> list[str]:
        """The backends known now: the static ones, then those DNS resolved (no duplicates)."""
        found = self.static + (self.dns.urls if self.dns is not None else [])
        return list(dict.fromkeys(found))

    def add_routes(self, app: web.Application) -> None:
        super().add_routes(app)
        app.router.add_get(names.METRICS_PATH, self._metrics)

    def background(self) -> list[Any]:
        return super().background() + ([self.dns.run()] if self.dns is not None else [])

    async def start(self) -> str:
        if self.dns is not None:
            await self.dns.refresh()  # the first requests already see the pods
        return await super().start()

    async def _metrics(self, request: web.Request) -> web.Response:
        body = generate_latest(self.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


class RouterCollector:
    """The router's counters, read when scraped: requests per backend, picks per reason, backends
    known, scrape errors per backend, connections refused per backend, requests in flight, requests
    held for a backend by outcome and waiting now, wakes asked and failed, DNS errors."""

    def __init__(self, router: Router) -> None:
        self.router = router

    def collect(self) -> Iterator[Any]:
        router = self.router
        requests = CounterMetricFamily(
            PREFIX + "requests", "Requests proxied to each backend", labels=["backend"]
        )
        known = router.backends()
        for url in sorted(set(known) | set(router.served)):
            requests.add_metric([url], router.served[url])
        yield requests
        picks = CounterMetricFamily(
            PREFIX + "picks",
            "Backend picks by reason (prefix affinity, load, round robin)",
            labels=["reason"],
        )
        for reason in scoring.REASONS:
            picks.add_metric([reason], router.picks[reason])
        yield picks
        yield GaugeMetricFamily(PREFIX + "backends", "Backends known now", value=len(known))
        in_flight = GaugeMetricFamily(
            PREFIX + "in_flight", "Requests in flight per backend", labels=["backend"]
        )
        for url in known:
            in_flight.add_metric([url], router.in_flight[url])
        yield in_flight
        prefill = GaugeMetricFamily(
            PREFIX + "pending_prefill_tokens",
            "Uncached prompt tokens (estimated) sent to a backend whose answer has not begun",
            labels=["backend"],
        )
        for url in known:
            prefill.add_metric([url], router.flights.pending_prefill_tokens(url))
        yield prefill
        errors = CounterMetricFamily(
            PREFIX + "scrape_errors", "Failed reads of a backend's /metrics", labels=["backend"]
        )
        for url in sorted(set(known) | set(router.scraper.errors)):
            errors.add_metric([url], router.scraper.errors[url])
        yield errors
        refused = CounterMetricFamily(
            PREFIX + "refused", "Requests a backend refused (retried on another)", labels=["backend"]
        )
        for url, count in sorted(router.refused.items()):
            refused.add_metric([url], count)
        yield refused
        if router.hold is not None:
            held = CounterMetricFamily(
                PREFIX + "held",
                "Requests that found no backend and waited, by how the wait ended",
                labels=["outcome"],
            )
            for outcome, count in router.hold.outcomes.items():
                held.add_metric([outcome], count)
            yield held
            yield GaugeMetricFamily(
                PREFIX + "waiting", "Requests waiting for a backend now", value=router.hold.waiting
            )
            yield CounterMetricFamily(
                PREFIX + "wakes", "Replicas asked for (wake-requested-at stamped)", value=router.hold.wakes
            )
            yield CounterMetricFamily(
                PREFIX + "wake_errors",
                "Wake requests that failed (asked again)",
                value=router.hold.wake_errors,
            )
        dns_errors = router.dns.errors if router.dns is not None else 0
        yield CounterMetricFamily(
            PREFIX + "dns_errors", "Failed DNS refreshes (last list kept)", value=dns_errors
        )


def _host_port(value: str) -> tuple[str, int]:
    try:
        return parse_host_port(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _positive(value: str) -> float:
    try:
        number = float(value)
    except ValueError:
        number = float("nan")
    if not number > 0 or number == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number, not {value!r}")
    return number


def _target(value: str) -> str:
    try:
        parse_target(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return value


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register ``kvpilot router``."""
    router = subparsers.add_parser(
        "router",
        help="scoring front door: sends each request to the replica predicted to answer it first",
        description=__doc__.split("\n\n")[0],
    )
    router.add_argument(
        "--listen",
        type=_host_port,
        default=("0.0.0.0", 8000),
        metavar="HOST:PORT",
        help="address to listen on; port 0 picks a free one (default: 0.0.0.0:8000)",
    )
    router.add_argument(
        "--backend", action="append", default=[], metavar="URL", help="a backend's base URL (repeatable)"
    )
    router.add_argument(
        "--backends-dns",
        type=_host_port,
        metavar="HOST:PORT",
        help="backends: one http://IP:PORT per A/AAAA record of HOST (a headless Service)",
    )
    router.add_argument(
        "--dns-refresh-s",
        type=float,
        default=2.0,
        help="seconds between DNS refreshes (default: %(default)s)",
    )
    router.add_argument(
        "--policy",
        choices=POLICIES,
        default=POLICY_SCORE,
        help="how to pick a backend (default: %(default)s)",
    )
    router.add_argument(
        "--scrape-interval-s",
        type=float,
        default=0.2,
        help="least seconds between two reads of a backend's /metrics (default: %(default)s)",
    )
    router.add_argument(
        "--chars-per-token",
        type=_positive,
        default=PrefixConfig().chars_per_token,
        help="characters per token of the served model's tokenizer, for the prefill work a prompt "
        "brings, until learned from the backends' vllm:request_prompt_tokens (default: %(default)s, "
        "English text; about 1 for CJK)",
    )
    router.add_argument(
        "--hold-max-waiting",
        type=int,
        default=64,
        help="requests that may wait for a backend at once; more get a 503 (default: %(default)s)",
    )
    router.add_argument(
        "--hold-timeout-s",
        type=float,
        default=300.0,
        help="seconds a request waits for a backend before a 503 (default: %(default)s)",
    )
    router.add_argument(
        "--wake",
        type=_target,
        metavar="NAMESPACE/NAME",
        help="while requests wait, stamp this InferenceService's wake-requested-at (scale from zero)",
    )
    router.add_argument(
        "--kube-server", metavar="URL", help="the API server for --wake (default: the in-cluster one)"
    )
    router.add_argument(
        "--kube-token-file",
        type=Path,
        default=SERVICE_ACCOUNT_DIR / "token",
        help="bearer token for --wake (default: %(default)s)",
    )
    router.add_argument(
        "--kube-ca-file",
        type=Path,
        default=SERVICE_ACCOUNT_DIR / "ca.crt",
        help="CA bundle of the API server for --wake (default: %(default)s)",
    )
    router.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    router.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Serve until SIGINT or SIGTERM; exit code 0, or 2 for no backend source."""
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not args.backend and args.backends_dns is None:
        LOG.error("kvpilot router needs --backend URL or --backends-dns HOST:PORT")
        return 2
    if min(args.dns_refresh_s, args.scrape_interval_s, args.hold_timeout_s) <= 0 or args.hold_max_waiting < 1:
        LOG.error(
            "--dns-refresh-s, --scrape-interval-s, --hold-timeout-s and --hold-max-waiting must be positive"
        )
        return 2
    waker = None
    if args.wake is not None:
        try:
            waker = ApiWaker(
                args.wake, server=args.kube_server, token_file=args.kube_token_file, ca_file=args.kube_ca_file
            )
        except ValueError as exc:
            LOG.error(f"--wake: {exc}")
            return 2
    asyncio.run(_serve(args, waker))
    return 0


async def _serve(args: argparse.Namespace, waker: ApiWaker | None) -> None:
    dns = None
    if args.backends_dns is not None:
        host, port = args.backends_dns
        dns = DnsBackends(host, port, refresh_s=args.dns_refresh_s, logger=LOG)
    listen_host, listen_port = args.listen
    router = Router(
        args.backend,
        dns,
        host=listen_host,
        port=listen_port,
        logger=LOG,
        policy=args.policy,
        scrape_interval_s=args.scrape_interval_s,
        prefix_config=PrefixConfig(chars_per_token=args.chars_per_token),
        hold=ColdStartHold(
            waker, max_waiting=args.hold_max_waiting, timeout_s=args.hold_timeout_s, logger=LOG
        ),
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    url = await router.start()
    wakes = f"; wakes {args.wake} from zero" if waker is not None else ""
    LOG.info(
        f"kvpilot router listening on {url} (policy {args.policy}; backends: {router.backends()}{wakes})"
    )
    try:
        await stop.wait()
    finally:
        with contextlib.suppress(Exception):
            await router.close()
