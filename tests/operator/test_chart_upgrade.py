"""The chart ships the CRD as a template: installs and upgrades apply it, uninstalls keep it."""

from __future__ import annotations

import shutil

import yaml

from tests.operator.conftest import CHART, CRD_PATH
from tests.operator.test_chart import by_kind, helm, render

CRD_NAME = "inferenceservices.serving.kvpilot.io"


def crd_of(objects: list[dict]) -> dict | None:
    crds = by_kind(objects).get("CustomResourceDefinition", [])
    assert len(crds) <= 1
    return crds[0] if crds else None


def without_chart_metadata(crd: dict) -> dict:
    out = yaml.safe_load(yaml.safe_dump(crd))
    out["metadata"].pop("annotations", None)
    out["metadata"].pop("labels", None)
    return out


def test_rendered_crd_is_the_repository_crd_with_release_labels_and_keep():
    source = yaml.safe_load(CRD_PATH.read_text())
    crd = crd_of(render("--set", "commonLabels.team=ml"))
    assert without_chart_metadata(crd) == without_chart_metadata(source)
    assert crd["metadata"]["annotations"] == {"helm.sh/resource-policy": "keep"}
    labels = crd["metadata"]["labels"]
    assert labels["app.kubernetes.io/managed-by"] == "Helm" and labels["app.kubernetes.io/instance"] == "kvp"
    assert labels["team"] == "ml"
    assert source["metadata"]["labels"].items() <= labels.items()


def test_crd_values_turn_keep_and_the_crd_off():
    assert "annotations" not in crd_of(render("--set", "crds.keep=false"))["metadata"]
    assert crd_of(render("--set", "crds.enabled=false")) is None


def test_an_upgrade_applies_the_new_crd(tmp_path):
    """Old release (CRD in the chart's crds/ folder) -> new chart (CRD as a template).

    Helm renders a crds/ folder only on a first install (``helm upgrade`` skips it, and
    ``helm template --is-upgrade`` without ``--include-crds`` shows what an upgrade applies): the old
    layout upgrades everything but the schema. The new chart's upgrade manifest carries the new
    schema, with the keep policy.
    """
    old = tmp_path / "old"
    shutil.copytree(CHART, old)
    (old / "crds").mkdir()
    shutil.move(old / "files" / "crds" / "inferenceservice.yaml", old / "crds" / "inferenceservice.yaml")
    (old / "templates" / "crd-inferenceservice.yaml").unlink()
    shutil.rmtree(old / "templates" / "tests")  # 0.1.0 had no helm test (it reads files/crds/)
    chart_yaml = old / "Chart.yaml"
    chart_yaml.write_text(chart_yaml.read_text().replace("\nversion: 0.2.0\n", "\nversion: 0.1.0\n"))
    assert "\nversion: 0.1.0\n" in chart_yaml.read_text()
    upgrade = ("template", "kvp", "--namespace", "kvpilot-system", "--is-upgrade")
    result = helm(*upgrade, str(old))
    assert result.returncode == 0, result.stderr
    old_objects = [d for d in yaml.safe_load_all(result.stdout) if d]
    assert crd_of(old_objects) is None and by_kind(old_objects)["Deployment"]

    # The new chart, with a schema change (a new field) the upgrade must carry to the cluster.
    new = tmp_path / "new"
    shutil.copytree(CHART, new)
    crd_file = new / "files" / "crds" / "inferenceservice.yaml"
    changed = yaml.safe_load(crd_file.read_text())
    spec_schema = changed["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    spec_schema["properties"]["newField"] = {"type": "string", "description": "Added by the upgrade."}
    crd_file.write_text(yaml.safe_dump(changed, sort_keys=False))
    result = helm(*upgrade, str(new))
    assert result.returncode == 0, result.stderr
    crd = crd_of([d for d in yaml.safe_load_all(result.stdout) if d])
    assert crd["metadata"]["name"] == CRD_NAME
    assert crd["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    rendered_spec = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    assert rendered_spec["properties"]["newField"] == {
        "type": "string",
        "description": "Added by the upgrade.",
    }
    assert without_chart_metadata(crd) == without_chart_metadata(changed)
