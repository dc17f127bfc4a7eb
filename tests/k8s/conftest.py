"""The real control plane for the cluster tests: one per module, started in a fresh folder."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from tests.k8s.cluster import BIN, KUBECTL, KWOK, Cluster


def require_binaries() -> None:
    binaries = (BIN / "kube-apiserver", BIN / "etcd", KWOK, KUBECTL)
    missing = [p for p in binaries if not os.access(p, os.X_OK)]
    if missing:
        message = f"{', '.join(map(str, missing))} missing; run `make k8s-tools test-operator-prereqs`"
        if os.environ.get("KVPILOT_REQUIRE_TOOLS") == "1":
            pytest.fail(message)
        pytest.skip(message)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    require_binaries()
    with Cluster(tmp_path_factory.mktemp("cluster")) as running:
        yield running


@pytest.fixture(scope="module")
def node_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """The control plane with kwok's simulated nodes (kwok.yaml), one per module."""
    require_binaries()
    with Cluster(tmp_path_factory.mktemp("cluster"), nodes=True) as running:
        yield running
