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

CRD_KINDS = {"ServingRuntime", "InferenceService", "Certificate", "Issuer",  # cert-manager: tests/security
             "LLMInferenceService", "InferencePool", "HTTPRoute"}


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


def test_servingruntime_declares_what_the_gateway_serves():
    (runtime,) = [r for r in rendered("kserve") if r["kind"] == "ServingRuntime"]
    # The gateway serves the OpenAI API, not KServe's v1/v2 prediction protocols.
    assert "protocolVersions" not in runtime["spec"]
    assert runtime["metadata"]["annotations"]["opendatahub.io/apiProtocol"] == "REST"


def test_llminferenceservice_runs_the_gateway_with_tandems_metric_names():
    resources = rendered("kserve-llm")
    (llm,) = [r for r in resources if r["kind"] == "LLMInferenceService"]
    assert llm["apiVersion"] == "serving.kserve.io/v1alpha1"
    spec = llm["spec"]
    assert spec["model"]["uri"].startswith("pvc://tandem-models/") and spec["model"]["name"]
    (main,) = spec["template"]["containers"]
    assert main["name"] == "main" and main["args"][0] == "gateway"
    env = {e["name"]: e.get("value") for e in main["env"]}
    assert env["TANDEM_MODEL"] == "/mnt/models" and env["TANDEM_HTTP_PORT"] == "8000"
    kubernetes_validate.validate({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "x"},
                                  "spec": {"containers": [main]}}, K8S_VERSION, strict=True)
    args = spec["router"]["scheduler"]["template"]["containers"][0]["args"]
    assert set(args) == {"--total-queued-requests-metric=tandem_num_requests_waiting",
                         "--total-running-requests-metric=tandem_num_requests_running",
                         "--kv-cache-usage-percentage-metric=tandem_kv_cache_usage_perc"}
    assert {"route", "gateway"} <= set(spec["router"])
    assert any(r["kind"] == "Deployment" and r["metadata"]["name"] == "tandem-decode" for r in resources)


def test_inference_pool_selects_the_gateways_and_the_epp_reads_tandems_gauges():
    import yaml

    from services.runtime.metrics import SERVED_BY

    resources = rendered("inference-pool")
    by_kind = {}
    for r in resources:
        by_kind.setdefault(r["kind"], []).append(r)
    (pool,) = by_kind["InferencePool"]
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
    (gateway,) = [d for d in by_kind["Deployment"] if d["metadata"]["name"] == "tandem-gateway"]
    labels = gateway["spec"]["template"]["metadata"]["labels"]
    assert pool["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert gateway["spec"]["replicas"] >= 2
    workers = [d for d in by_kind["Deployment"] if d["metadata"]["name"] != "tandem-gateway"]
    for w in workers:  # only gateways are endpoints: the workers do not speak OpenAI HTTP
        assert not pool["spec"]["selector"]["matchLabels"].items() <= w["spec"]["template"]["metadata"]["labels"].items()
    env = {e["name"]: e.get("value") for e in gateway["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert pool["spec"]["targetPorts"] == [{"number": int(env["TANDEM_HTTP_PORT"])}]
    picker = pool["spec"]["endpointPickerRef"]
    (service,) = [s for s in by_kind["Service"] if s["metadata"]["name"] == picker["name"]]
    assert picker["port"]["number"] in [p["port"] for p in service["spec"]["ports"]]
    (config_map,) = [c for c in by_kind["ConfigMap"] if c["metadata"]["name"] == "tandem-epp-config"]
    config = yaml.safe_load(config_map["data"]["config.yaml"])
    assert config["kind"] == "EndpointPickerConfig"
    (extractor,) = [p for p in config["plugins"] if p["type"] == "core-metrics-extractor"]
    (engine,) = extractor["parameters"]["engineConfigs"]
    specs = {engine["queuedRequestsSpec"], engine["runningRequestsSpec"], engine["kvUsageSpec"]}
    assert specs == {"tandem_num_requests_waiting", "tandem_num_requests_running", "tandem_kv_cache_usage_perc"}
    assert specs <= SERVED_BY["gateway"]  # the pool's endpoints export every gauge it reads
    (route,) = by_kind["HTTPRoute"]
    assert route["spec"]["rules"][0]["backendRefs"][0] == {"group": "inference.networking.k8s.io",
                                                           "kind": "InferencePool", "name": "tandem"}
