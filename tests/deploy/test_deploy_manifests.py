"""Schemas: docker-compose.yml against the Compose spec, every rendered k8s manifest against the
Kubernetes OpenAPI schemas (strict), KServe CRDs by their required fields."""

from __future__ import annotations

import copy
import subprocess
import sys

import jsonschema
import kubernetes_validate
import pytest
from check_jsonschema.builtin_schemas import get_builtin_schema
from kubernetes_validate.utils import SchemaNotFoundError

from tests.deploy.deploy_files import KUSTOMIZATIONS, K8S_VERSION, REPO_ROOT, compose, rendered
from tests.deploy.kustomize_render import KustomizeError, render, strategic_merge

CRD_KINDS = {"ServingRuntime", "InferenceService", "Certificate", "Issuer"}  # cert-manager: tests/security


def test_compose_matches_compose_spec():
    jsonschema.validate(compose(), get_builtin_schema("vendor.compose-spec"))


def test_compose_cli_check():
    # The same check as a user would run it (the acceptance wording).
    result = subprocess.run(
        [sys.executable, "-m", "check_jsonschema", "--builtin-schema", "vendor.compose-spec",
         str(REPO_ROOT / "docker-compose.yml")], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("name", KUSTOMIZATIONS)
def test_k8s_manifests_validate_strict(name):
    resources = rendered(name)
    assert resources
    for res in resources:
        if res["kind"] in CRD_KINDS:
            with pytest.raises(SchemaNotFoundError):   # no schema: checked by hand below
                kubernetes_validate.validate(res, K8S_VERSION, strict=True)
            continue
        try:
            kubernetes_validate.validate(res, K8S_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            path = ".".join(str(p) for p in exc.path)
            pytest.fail(f"{name}: {res['kind']}/{res['metadata']['name']}: {path}: {exc.message}")


def test_strict_validation_rejects_unknown_fields():
    (deployment,) = [r for r in rendered("base") if r["metadata"]["name"] == "tandem-decode"
                     and r["kind"] == "Deployment"]
    bad = copy.deepcopy(deployment)
    bad["spec"]["template"]["spec"]["containers"][0]["readinessProbes"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, K8S_VERSION, strict=True)


def test_kserve_resources_have_required_fields():
    resources = {r["kind"]: r for r in rendered("kserve")}
    runtime, isvc = resources["ServingRuntime"], resources["InferenceService"]
    assert runtime["apiVersion"] == "serving.kserve.io/v1alpha1"
    assert isvc["apiVersion"] == "serving.kserve.io/v1beta1"
    (container,) = runtime["spec"]["containers"]
    assert container["name"] == "kserve-container" and container["image"]
    formats = runtime["spec"]["supportedModelFormats"]
    assert all(f["name"] for f in formats)
    model = isvc["spec"]["predictor"]["model"]
    assert model["modelFormat"]["name"] in {f["name"] for f in formats}
    assert model["runtime"] == runtime["metadata"]["name"]
    assert model["storageUri"].startswith("pvc://tandem-models/")
    claims = [r for r in rendered("kserve") if r["kind"] == "PersistentVolumeClaim"]
    assert [c["metadata"]["name"] for c in claims] == ["tandem-models"]


@pytest.mark.parametrize("name", ["overlays/gpu", "kserve"])
def test_model_pvc_component_replaced_the_models_volume(name):
    for res in rendered(name):
        if res["kind"] != "Deployment" or res["metadata"]["name"] == "tandem-redis":
            continue
        pod = res["spec"]["template"]["spec"]
        (models,) = [v for v in pod["volumes"] if v["name"] == "models"]
        assert models == {"name": "models", "persistentVolumeClaim":
                          {"claimName": "tandem-models", "readOnly": True}}
        assert "initContainers" not in pod


def test_gpu_overlay_requests_gpus_for_engine_pods_only():
    for res in rendered("overlays/gpu"):
        if res["kind"] != "Deployment":
            continue
        (container,) = res["spec"]["template"]["spec"]["containers"]
        gpus = container["resources"].get("limits", {}).get("nvidia.com/gpu")
        engine = container["name"] in ("prefill", "decode", "draft")
        assert (gpus == 1) == engine, res["metadata"]["name"]
        if engine:
            env = {e["name"]: e.get("value") for e in container["env"]}
            assert env["TANDEM_DEVICE"] == "cuda"
            assert res["spec"]["template"]["spec"]["tolerations"]


def test_renderer_semantics(tmp_path):
    assert strategic_merge({"containers": [{"name": "a", "env": [{"name": "X", "value": "1"}]}]},
                           {"containers": [{"name": "a", "env": [{"name": "X", "value": "2"},
                                                                 {"name": "Y", "value": "3"}]}]}) \
        == {"containers": [{"name": "a", "env": [{"name": "X", "value": "2"}, {"name": "Y", "value": "3"}]}]}
    (tmp_path / "kustomization.yaml").write_text("resources: []\nhelmCharts: []\n")
    with pytest.raises(KustomizeError, match="helmCharts"):
        render(tmp_path)


def test_every_manifest_file_is_rendered_somewhere():
    # A YAML file under k8s/ that no kustomization reaches would go unvalidated.
    reached = set()
    import yaml
    for name in KUSTOMIZATIONS:
        stack = [REPO_ROOT / "k8s" / name]
        while stack:
            directory = stack.pop()
            k = yaml.safe_load((directory / "kustomization.yaml").read_text())
            reached.add(directory / "kustomization.yaml")
            for entry in k.get("resources", []) + k.get("components", []):
                target = (directory / entry).resolve()
                (stack.append(target) if target.is_dir() else reached.add(target))
            for patch in k.get("patches", []):
                if "path" in patch:
                    reached.add((directory / patch["path"]).resolve())
    all_yaml = {p.resolve() for p in (REPO_ROOT / "k8s").rglob("*.yaml")}
    assert all_yaml - reached == set()
