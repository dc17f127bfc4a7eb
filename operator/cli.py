"""``kvpilot operator`` (run the kopf operator), ``kvpilot render`` (print the children) and
``kvpilot replay`` (recorded metrics through the remediation policy).

``add_parser(subparsers)`` registers the three subcommands (``replay`` from
:mod:`~kvpilot.operator.replay_cli`); kopf is imported only when the operator actually starts, so
``kvpilot render`` and ``kvpilot replay`` work wherever PyYAML does.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

import yaml

from kvpilot.operator import leader
from kvpilot.operator.api import names
from kvpilot.operator.api.platform import (
    DEFAULT_ENGINE_IMAGE,
    DEFAULT_ROUTER_IMAGE,
    DEFAULT_VLLM_IMAGE,
    Platform,
    split_list,
)

_GLOB_CHARS = set("*?[]!")
# The chart passes its values to the operator through these (a flag wins over its variable).
ENV_DEFAULT_IMAGE = "KVPILOT_DEFAULT_IMAGE"
ENV_DEFAULT_VLLM_IMAGE = "KVPILOT_DEFAULT_VLLM_IMAGE"
ENV_ALLOWED_REGISTRIES = "KVPILOT_ALLOWED_REGISTRIES"
ENV_ALLOWED_SERVICE_ACCOUNTS = "KVPILOT_ALLOWED_SERVICE_ACCOUNTS"
ENV_ROUTER_IMAGE = "KVPILOT_ROUTER_IMAGE"


def _add_default_image(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--default-image",
        default=None,
        metavar="IMAGE",
        help=f"engine image for InferenceServices whose spec.image is unset (default: ${ENV_DEFAULT_IMAGE}, "
        f"else {DEFAULT_ENGINE_IMAGE})",
    )
    parser.add_argument(
        "--default-vllm-image",
        default=None,
        metavar="IMAGE",
        help="image for InferenceServices with spec.runtime vllm whose spec.image is unset (default: "
        f"${ENV_DEFAULT_VLLM_IMAGE}, else {DEFAULT_VLLM_IMAGE})",
    )
    parser.add_argument(
        "--router-image",
        default=None,
        metavar="IMAGE",
        help="image spec.router.frontDoor pods run `kvpilot router` from when it sets none (default: "
        f"${ENV_ROUTER_IMAGE}, else {DEFAULT_ROUTER_IMAGE})",
    )


def platform_from(args: argparse.Namespace, environ: dict[str, str] | None = None) -> Platform:
    """The operator-level settings from the flags, else the chart's environment variables.
    Raises ValueError for an empty default image."""
    env = os.environ if environ is None else environ
    image = getattr(args, "default_image", None) or env.get(ENV_DEFAULT_IMAGE) or DEFAULT_ENGINE_IMAGE
    vllm_image = (
        getattr(args, "default_vllm_image", None) or env.get(ENV_DEFAULT_VLLM_IMAGE) or DEFAULT_VLLM_IMAGE
    )
    router_image = getattr(args, "router_image", None) or env.get(ENV_ROUTER_IMAGE) or DEFAULT_ROUTER_IMAGE
    registries = getattr(args, "allowed_registries", None)
    accounts = getattr(args, "allowed_service_accounts", None)
    return Platform(
        default_image=image,
        default_vllm_image=vllm_image,
        router_image=router_image,
        allowed_registries=split_list(
            registries if registries is not None else env.get(ENV_ALLOWED_REGISTRIES)
        ),
        allowed_service_accounts=split_list(
            accounts if accounts is not None else env.get(ENV_ALLOWED_SERVICE_ACCOUNTS)
        ),
    )


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``operator`` and ``render`` subcommands to the ``kvpilot`` parser."""
    op = subparsers.add_parser(
        "operator",
        help="run the Kubernetes operator that reconciles InferenceServices",
        description="Run the kopf operator: each InferenceService becomes an engine Deployment, "
        "a Service and a PodDisruptionBudget.",
    )
    scope = op.add_mutually_exclusive_group(required=True)
    scope.add_argument(
        "-n",
        "--namespace",
        dest="namespaces",
        action="append",
        default=[],
        metavar="NS",
        help="serve InferenceServices in this namespace (repeatable)",
    )
    scope.add_argument("-A", "--all-namespaces", action="store_true", help="serve every namespace")
    op.add_argument(
        "--resync-interval",
        type=float,
        default=300.0,
        metavar="SECONDS",
        help="re-check every InferenceService's children this often (default: 300)",
    )
    op.add_argument(
        "--liveness",
        metavar="URL",
        default=None,
        help="serve a liveness endpoint, e.g. http://0.0.0.0:8080/healthz",
    )
    op.add_argument(
        "--peering",
        metavar="NAME",
        default=None,
        help="coordinate with other operator replicas through kopf peering (needs kopf's peering CRDs); "
        "without it the operator runs standalone, one replica per scope",
    )
    op.add_argument(
        "--service-monitors",
        action="store_true",
        help="manage Prometheus Operator ServiceMonitors for InferenceServices that ask for one "
        "(needs RBAC on servicemonitors.monitoring.coreos.com)",
    )
    op.add_argument(
        "--scrape-interval",
        type=positive_seconds,
        default=15.0,
        metavar="SECONDS",
        help="read every ready engine pod's /metrics and evaluate remediation this often (default: 15)",
    )
    op.add_argument(
        "--scrape-timeout",
        type=positive_seconds,
        default=3.0,
        metavar="SECONDS",
        help="give up on one pod's /metrics after this long (default: 3)",
    )
    op.add_argument(
        "--record",
        metavar="FILE",
        default=None,
        help="append every scrape to FILE as JSON Lines, /metrics text as served (~20 KiB per pod and "
        "scrape); replay them with `kvpilot replay --metrics FILE`",
    )
    op.add_argument(
        "--metrics-port",
        type=_port,
        default=None,
        metavar="PORT",
        help="serve the operator's own Prometheus metrics (kvpilot_operator_*) at :PORT/metrics "
        "(default: not served)",
    )
    op.add_argument(
        "--metrics-address",
        default="0.0.0.0",
        metavar="ADDR",
        help="the address --metrics-port binds (default: 0.0.0.0)",
    )
    op.add_argument(
        "--metrics-source",
        choices=["pods", "prometheus"],
        default="pods",
        help="where remediation reads the engines' metrics: scrape every ready pod (default), or query "
        "the same series from Prometheus (--prometheus-url), where the operator may not reach the pods",
    )
    op.add_argument(
        "--prometheus-url",
        default=None,
        metavar="URL",
        help="the Prometheus HTTP API for --metrics-source prometheus, e.g. "
        "http://prometheus-operated.monitoring:9090 (engine series labelled namespace and pod)",
    )
    _add_default_image(op)
    op.add_argument(
        "--allowed-registries",
        default=None,
        metavar="HOST,...",
        help="only run engine images from these registries (comma-separated, e.g. ghcr.io,nvcr.io; "
        f"default: ${ENV_ALLOWED_REGISTRIES}, else any); others get SpecValid=False",
    )
    op.add_argument(
        "--allowed-service-accounts",
        default=None,
        metavar="NAME,...",
        help="only run engine pods as these service accounts (comma-separated; unset means 'default'; "
        f"default: ${ENV_ALLOWED_SERVICE_ACCOUNTS}, else any); others get SpecValid=False",
    )
    op.add_argument("--priority", type=int, default=0, help="peering priority (with --peering)")
    leader.add_arguments(op)
    op.add_argument("--log-format", choices=["plain", "full", "json"], default="full", help="log format")
    op.add_argument("-v", "--verbose", action="store_true", help="log at debug level")
    op.set_defaults(func=run_operator)

    render = subparsers.add_parser(
        "render",
        help="print the manifests the operator would apply for an InferenceService",
        description="Render the child objects of the InferenceService(s) in FILE as multi-document YAML, "
        "with the same builders the operator uses (for GitOps previews and reviews).",
    )
    render.add_argument(
        "-f", "--filename", required=True, metavar="FILE", help="manifest file, or - for stdin"
    )
    render.add_argument(
        "-n",
        "--namespace",
        default=None,
        metavar="NS",
        help="namespace for InferenceServices that name none (default: leave it unset)",
    )
    _add_default_image(render)
    render.set_defaults(func=run_render)

    from kvpilot.operator.replay_cli import add_replay_parser

    add_replay_parser(subparsers)


def _port(value: str) -> int:
    try:
        port = int(value)
    except ValueError:
        port = -1
    if not 1 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"must be a TCP port (1-65535), got {value}")
    return port


def positive_seconds(value: str) -> float:
    number = float(value)
    if not number > 0:
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {value}")
    return number


def read_one_inference_service(filename: str) -> dict[str, Any] | None:
    """The one InferenceService in the YAML file ``filename`` (``-``: stdin), as ``kvpilot replay`` and
    ``kvpilot plan`` take it; None after one error line on stderr (unreadable, or not exactly one)."""
    try:
        documents = [d for d in _load_documents(filename) if isinstance(d, dict)]
    except (OSError, yaml.YAMLError) as exc:
        print(f"error: cannot read {filename}: {exc}", file=sys.stderr)
        return None
    isvcs = [d for d in documents if d.get("kind") == names.KIND]
    if len(isvcs) != 1:
        print(f"error: {filename} must hold exactly one {names.KIND}, found {len(isvcs)}", file=sys.stderr)
        return None
    return isvcs[0]


def _load_documents(filename: str) -> list[Any]:
    if filename == "-":
        return [d for d in yaml.safe_load_all(sys.stdin) if d is not None]
    with open(filename, encoding="utf-8") as handle:
        return [d for d in yaml.safe_load_all(handle) if d is not None]


def render_documents(
    documents: list[Any], namespace: str | None = None, platform: Platform | None = None
) -> tuple[list[dict], list[str]]:
    """(children of every valid InferenceService, error lines) for parsed YAML documents, resolved
    with ``platform`` (None: the built-in defaults)."""
    from kvpilot.operator.api.settings import resolve
    from kvpilot.operator.render.builders import build_children

    children: list[dict] = []
    errors: list[str] = []
    found = 0
    for index, doc in enumerate(documents):
        if isinstance(doc, dict) and doc.get("kind") == "List":
            documents.extend(doc.get("items") or [])
            continue
        if not isinstance(doc, dict) or doc.get("kind") != names.KIND:
            continue  # other objects in the same file (Namespaces, Secrets, ...) are not ours
        found += 1
        if namespace and not (doc.get("metadata") or {}).get("namespace"):
            doc.setdefault("metadata", {})["namespace"] = namespace
        label = f"{names.KIND} {(doc.get('metadata') or {}).get('name', f'#{index}')}"
        settings = resolve(doc, platform or Platform())
        if not settings.is_valid:
            errors += [f"{label}: {p}" for p in settings.problems]
            continue
        children += build_children(settings)
    if not found:
        errors.append(f"no {names.KIND} ({names.API_VERSION}) found")
    return children, errors


def run_render(args: argparse.Namespace) -> int:
    """``kvpilot render -f FILE``: 0 and YAML on stdout, or 1 and the problems on stderr."""
    try:
        documents = _load_documents(args.filename)
    except (OSError, yaml.YAMLError) as exc:
        print(f"error: cannot read {args.filename}: {exc}", file=sys.stderr)
        return 1
    children, errors = render_documents(documents, args.namespace, platform_from(args))
    for line in errors:
        print(f"error: {line}", file=sys.stderr)
    if errors:
        return 1
    sys.stdout.write(yaml.safe_dump_all(children, sort_keys=False, default_flow_style=False))
    return 0


def run_operator(args: argparse.Namespace) -> int:
    """``kvpilot operator``: runs until SIGTERM/SIGINT; returns the exit code."""
    globs = [ns for ns in args.namespaces if _GLOB_CHARS & set(ns)]
    if globs:
        print(
            f"error: namespace patterns are not supported, name namespaces exactly: {globs}", file=sys.stderr
        )
        return 2
    if args.metrics_source == "prometheus":
        from kvpilot.operator.observability.promsource import PrometheusUrlError, check_url

        try:
            check_url(args.prometheus_url or "")
        except PrometheusUrlError as exc:
            print(f"error: --metrics-source prometheus needs --prometheus-url: {exc}", file=sys.stderr)
            return 2
    elif args.prometheus_url:
        print("error: --prometheus-url is only read with --metrics-source prometheus", file=sys.stderr)
        return 2
    if args.record:
        try:
            open(args.record, "a", encoding="utf-8").close()
        except OSError as exc:
            print(f"error: cannot record to {args.record}: {exc}", file=sys.stderr)
            return 2
    import kopf

    from kvpilot.operator.handlers import build_registry, new_memo
    from kvpilot.operator.options import OperatorOptions

    options = OperatorOptions(
        namespaces=tuple(dict.fromkeys(args.namespaces)),
        clusterwide=args.all_namespaces,
        resync_interval=args.resync_interval,
        service_monitors=args.service_monitors,
        scrape_interval=args.scrape_interval,
        scrape_timeout=args.scrape_timeout,
        record=args.record,
        platform=platform_from(args),
        metrics_port=args.metrics_port,
        metrics_address=args.metrics_address,
        metrics_source=args.metrics_source,
        prometheus_url=args.prometheus_url,
    )
    log_format = {"plain": kopf.LogFormat.PLAIN, "full": kopf.LogFormat.FULL, "json": kopf.LogFormat.JSON}
    kopf.configure(verbose=args.verbose, log_format=log_format[args.log_format])
    run_kwargs = dict(
        registry=build_registry(options),
        memo=new_memo(),
        clusterwide=options.clusterwide,
        namespaces=list(options.namespaces),
        standalone=args.peering is None,
        peering_name=args.peering,
        priority=args.priority,
        liveness_endpoint=args.liveness,
    )
    if args.leader_elect:
        if args.peering is not None:
            print("error: --leader-elect and --peering both coordinate replicas: pick one", file=sys.stderr)
            return 2
        try:
            config = leader.config_from(args)
        except leader.LeaderElectionError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        return leader.run_elected(config, run_kwargs)
    kopf.run(**run_kwargs)
    return 0
