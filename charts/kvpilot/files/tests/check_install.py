"""`helm test` for the kvpilot chart: the InferenceService CRD is served with the version and printer
columns this chart ships (so an upgrade applied it), and every running operator pod answers its
health endpoint.

Standard library only (it runs in the operator image with `python -c`). It reads what to expect from
KVPILOT_TEST_EXPECT (JSON, rendered by the chart) and talks to the Kubernetes API with the pod's
ServiceAccount token; KVPILOT_TEST_API overrides the API address. Exits 0 when every check passes,
1 with one line per failed check otherwise.
"""

import json
import os
import ssl
import sys
import urllib.error
import urllib.parse
import urllib.request

SA_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"


def api_base() -> str:
    if os.environ.get("KVPILOT_TEST_API"):
        return os.environ["KVPILOT_TEST_API"].rstrip("/")
    host, port = os.environ["KUBERNETES_SERVICE_HOST"], os.environ["KUBERNETES_SERVICE_PORT"]
    return f"https://[{host}]:{port}" if ":" in host else f"https://{host}:{port}"


def api_get(path: str) -> dict:
    request = urllib.request.Request(api_base() + path)
    token_file = os.path.join(SA_DIR, "token")
    if os.path.exists(token_file):
        with open(token_file) as f:
            request.add_header("Authorization", "Bearer " + f.read().strip())
    ca_file = os.path.join(SA_DIR, "ca.crt")
    context = ssl.create_default_context(cafile=ca_file) if os.path.exists(ca_file) else None
    with urllib.request.urlopen(request, timeout=10, context=context) as response:
        return json.loads(response.read())


def check_crd(expect: dict) -> list[str]:
    try:
        crd = api_get(f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{expect['crd']}")
    except urllib.error.URLError as exc:
        return [f"CRD {expect['crd']}: cannot read it ({exc})"]
    problems = []
    conditions = {c.get("type"): c.get("status") for c in (crd.get("status") or {}).get("conditions") or []}
    if conditions.get("Established") != "True":
        problems.append(f"CRD {expect['crd']} is not Established")
    versions = {v["name"]: v for v in crd["spec"]["versions"]}
    version = versions.get(expect["version"])
    if not version or not version.get("served") or not version.get("storage"):
        problems.append(
            f"CRD {expect['crd']}: version {expect['version']} is not served as the storage version"
        )
        return problems
    columns = [c["name"] for c in version.get("additionalPrinterColumns") or []]
    if columns != expect["columns"]:
        problems.append(
            f"CRD {expect['crd']}: printer columns {columns}, this chart ships {expect['columns']}"
        )
    return problems


def check_operator(expect: dict) -> list[str]:
    query = urllib.parse.urlencode({"labelSelector": expect["selector"]})
    try:
        pods = api_get(f"/api/v1/namespaces/{expect['namespace']}/pods?{query}")["items"]
    except urllib.error.URLError as exc:
        return [f"operator pods: cannot list them ({exc})"]
    running = [p for p in pods if (p.get("status") or {}).get("phase") == "Running"]
    if not running:
        return [f"no running operator pod in {expect['namespace']} ({expect['selector']})"]
    problems = []
    for pod in running:
        ip = pod["status"].get("podIP", "")
        host = f"[{ip}]" if ":" in ip else ip
        url = f"http://{host}:{expect['port']}{expect['path']}"
        try:
            with urllib.request.urlopen(url, timeout=10) as response:
                status = response.status
        except (urllib.error.URLError, OSError) as exc:
            problems.append(f"operator pod {pod['metadata']['name']}: {url} does not answer ({exc})")
            continue
        if status != 200:
            problems.append(f"operator pod {pod['metadata']['name']}: {url} answered {status}")
    return problems


def main() -> int:
    expect = json.loads(os.environ["KVPILOT_TEST_EXPECT"])
    problems = check_crd(expect) + check_operator(expect)
    for problem in problems:
        print("FAIL", problem)
    if not problems:
        print(
            f"ok: CRD {expect['crd']} serves {expect['version']} with {len(expect['columns'])} columns; "
            "the operator answers its health endpoint"
        )
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
