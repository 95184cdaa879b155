"""Compose, k8s, Dockerfile and settings.py agree: env names, ports, probes, images."""

from __future__ import annotations

import re
import tomllib

import pytest

from services.runtime import settings as S

from tests.deploy.deploy_files import (FETCH_CACHE_ENV, IMAGE_REPO, KUSTOMIZATIONS, REPO_ROOT, compose, dockerfile,
                                       interpolate_compose, pod_specs, rendered)

POD_IP = "10.0.0.7"


def _check_env_names(service: str, names, where: str) -> None:
    allowed = S.all_env_vars(service)
    for name in names:
        assert name in allowed, f"{where}: {name} is not a setting of `tandem {service}`"


# --- compose -----------------------------------------------------------------------------------

def _compose_tandem_services():
    for name, svc in compose()["services"].items():
        command = svc.get("command")
        if isinstance(command, list) and command[:1] == ["tandem"] and command[1] in S.SERVICES:
            yield name, command[1], svc


def test_compose_runs_every_service_with_valid_env():
    seen = set()
    for name, service, svc in _compose_tandem_services():
        seen.add(service)
        env = {k: interpolate_compose(v) for k, v in svc["environment"].items()}
        _check_env_names(service, env, f"docker-compose.yml:{name}")
        settings = S.parse_settings(service, svc["command"][2:], env)   # values parse and validate
        ports = {"grpc": settings.common.grpc_port}
        if service == "gateway":
            ports["http"] = settings.http_port
            probe = ["CMD", "python", "-m", "services.runtime.health_probe", "http",
                     f"http://127.0.0.1:{settings.http_port}/health"]
            published = {int(p.split(":")[-1]) for p in svc["ports"]}
            assert published == {settings.http_port, settings.common.grpc_port}
        else:
            probe = ["CMD", "python", "-m", "services.runtime.health_probe", "grpc",
                     f"127.0.0.1:{settings.common.grpc_port}"]
        assert svc["healthcheck"]["test"] == probe, name
        assert svc["image"] == compose()["services"]["model-init"]["image"]
        assert "redis" in svc["depends_on"]
        assert all(dep["condition"] in ("service_healthy", "service_completed_successfully")
                   for dep in svc["depends_on"].values())
        assert settings.common.redis_url == "redis://redis:6379/0"
    assert seen == set(S.SERVICES)


def test_compose_image_and_model_volume():
    services = compose()["services"]
    image = services["model-init"]["image"]
    assert image.split(":")[0] == IMAGE_REPO
    assert "models" in compose()["volumes"]
    assert "tracing" in services["jaeger"]["profiles"]
    for service in S.SERVICES:
        assert services[service]["environment"]["TANDEM_MODEL"] == "/models/default"


# --- Dockerfile ---------------------------------------------------------------------------------

def test_dockerfile_contract():
    text = dockerfile()
    instructions = [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    health = [line for line in instructions if line.startswith("HEALTHCHECK")]
    assert len(health) == 1
    gateway_grpc = S.default_ports("gateway")["grpc"]
    assert f'services.runtime.health_probe grpc "127.0.0.1:${{TANDEM_GRPC_PORT:-{gateway_grpc}}}"' in health[0]
    assert instructions[-1] == 'CMD ["tandem"]'
    users = [line for line in instructions if line.startswith("USER ")]
    assert users and not users[-1].split()[1].startswith(("0", "root"))
    # ENV TANDEM_* names are common to every service (but fetch-model's cache: test_deploy_model_init).
    for name in set(re.findall(r"\b(TANDEM_[A-Z_]+)=", text)) - {FETCH_CACHE_ENV}:
        for service in S.SERVICES:
            _check_env_names(service, [name], "Dockerfile")
    exposed = {int(p) for line in instructions if line.startswith("EXPOSE") for p in line.split()[1:]}
    assert exposed == {port for s in S.SERVICES for port in S.default_ports(s).values()}
    # torch from the variant's PyTorch index, same version as pyproject's pin.
    pins = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    torch_pin = next(p for p in pins if p.startswith("torch=="))
    assert f"ARG TORCH_VERSION={torch_pin.split('==')[1]}" in text
    assert "download.pytorch.org/whl/${TORCH_VARIANT}" in text
    assert "pip install ." in text and text.count("FROM ") >= 2


def test_dockerignore_keeps_what_the_build_copies():
    ignored = {line.strip() for line in (REPO_ROOT / ".dockerignore").read_text().splitlines()
               if line.strip() and not line.startswith("#")}
    copied = set()
    for line in dockerfile().splitlines():
        if line.startswith("COPY ") and "--from" not in line:
            copied.update(p.rstrip("/").removeprefix("./") for p in line.split()[1:-1])
    assert copied >= {"pyproject.toml", "README.md", "protos", "common", "services"}
    assert not copied & ignored


# --- Kubernetes ---------------------------------------------------------------------------------

def _configmaps(resources):
    return {r["metadata"]["name"]: r["data"] for r in resources if r["kind"] == "ConfigMap"}


def _container_env(container, configmaps) -> dict[str, str]:
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        env.update(configmaps[source["configMapRef"]["name"]])
    for item in container.get("env", []):
        if "valueFrom" in item:
            assert item["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}, item
            env[item["name"]] = POD_IP
        else:
            env[item["name"]] = item["value"]
    return env


def _tandem_containers(resources):
    configmaps = _configmaps(resources)
    for res, pod in pod_specs(resources):
        for container in pod["containers"]:
            if container.get("command") == ["tandem"]:
                service = container["args"][0]
                yield res, pod, container, service, _container_env(container, configmaps)


def _port_number(port, container) -> int:
    if isinstance(port, int):
        return port
    (number,) = [p["containerPort"] for p in container["ports"] if p.get("name") == port]
    return number


@pytest.mark.parametrize("name", KUSTOMIZATIONS)
def test_k8s_env_ports_probes_agree_with_settings(name):
    resources = rendered(name)
    services_by_name = {r["metadata"]["name"]: r for r in resources if r["kind"] == "Service"}
    seen = set()
    for res, pod, container, service, env in _tandem_containers(resources):
        where = f"{name}: {res['kind']}/{res['metadata']['name']}"
        seen.add(service)
        assert container["name"] in (service, "kserve-container", "main")  # main: LLMInferenceService
        _check_env_names(service, env, where)
        args = [a.replace("{{.Name}}", "tandem") for a in container["args"][1:]]
        settings = S.parse_settings(service, args, env)
        assert settings.common.advertise_host == POD_IP, where
        assert settings.common.redis_url == "redis://tandem-redis:6379/0", where
        grpc_port = settings.common.grpc_port
        expected = {grpc_port}
        expected.add(settings.http_port if service == "gateway" else settings.common.metrics_port)
        declared = {p["containerPort"] for p in container["ports"]}
        if res["kind"] in ("ServingRuntime", "LLMInferenceService"):  # KServe exposes one port: the HTTP one
            assert declared == {settings.http_port}, where
        else:
            assert declared == expected, where
        for probe_name in ("startupProbe", "readinessProbe", "livenessProbe"):
            probe = container.get(probe_name)
            if probe is None:
                continue
            if "grpc" in probe:
                assert probe["grpc"]["port"] == grpc_port and not probe["grpc"].get("service"), where
            elif "exec" in probe:  # mTLS (k8s/components/mtls): the image's probe with the pod's certificate
                assert probe["exec"]["command"] == ["python", "-m", "services.runtime.health_probe", "grpc",
                                                    f"127.0.0.1:{grpc_port}"], where
                assert settings.common.tls_enabled, where
            else:
                assert service == "gateway" and probe["httpGet"]["path"] == "/health", where
                assert _port_number(probe["httpGet"]["port"], container) == settings.http_port, where
        if res["kind"] == "Deployment":
            assert {"livenessProbe", "readinessProbe", "startupProbe"} <= set(container), where
            template = res["spec"]["template"]
            scrape_port = settings.http_port if service == "gateway" else settings.common.metrics_port
            assert template["metadata"]["annotations"]["prometheus.io/port"] == str(scrape_port), where
            assert template["metadata"]["annotations"]["prometheus.io/scrape"] == "true"
            assert container["lifecycle"]["preStop"]["sleep"]["seconds"] > 0
            assert pod["terminationGracePeriodSeconds"] > container["lifecycle"]["preStop"]["sleep"]["seconds"]
            sc = container["securityContext"]
            assert sc["readOnlyRootFilesystem"] and sc["runAsNonRoot"] and sc["capabilities"]["drop"] == ["ALL"]
            assert any(m["mountPath"] == "/tmp" for m in container["volumeMounts"])
            svc = services_by_name[res["metadata"]["name"]]
            for port in svc["spec"]["ports"]:
                assert _port_number(port["targetPort"], container) == port["port"], where
    assert seen == ({"prefill", "decode", "draft"} | ({"gateway"} if name != "base/workers" else set()))


# Images that are not Tandem's: Redis, and the Inference Extension's endpoint picker (k8s/inference-pool).
OTHER_IMAGES = ("redis:", "registry.k8s.io/gateway-api-inference-extension/")


@pytest.mark.parametrize("name", KUSTOMIZATIONS)
def test_k8s_images_agree(name):
    compose_image = compose()["services"]["model-init"]["image"]
    tag = compose_image.split(":")[1]
    expected_tag = tag.replace("-cpu", "-cuda") if name == "overlays/gpu" else tag
    images = {c["image"] for _, pod in pod_specs(rendered(name))
              for c in pod["containers"] + pod.get("initContainers", []) if not c["image"].startswith(OTHER_IMAGES)}
    assert images == {f"{IMAGE_REPO}:{expected_tag}"}
    redis_images = {c["image"] for _, pod in pod_specs(rendered(name))
                    for c in pod["containers"] if c["image"].startswith("redis:")}
    assert redis_images == {compose()["services"]["redis"]["image"]}


def test_k8s_autoscaling_and_disruption_budgets():
    resources = rendered("base")
    hpas = {r["spec"]["scaleTargetRef"]["name"]: r for r in resources if r["kind"] == "HorizontalPodAutoscaler"}
    assert set(hpas) == {"tandem-prefill", "tandem-decode"}
    for hpa in hpas.values():
        (metric,) = hpa["spec"]["metrics"]
        assert metric["type"] == "Pods" and metric["pods"]["metric"]["name"] == "tandem_num_requests_waiting"
    pdbs = {r["metadata"]["name"] for r in resources if r["kind"] == "PodDisruptionBudget"}
    assert pdbs == {f"tandem-{s}" for s in S.SERVICES}
    deployments = {r["metadata"]["name"]: r for r in resources if r["kind"] == "Deployment"}
    for pdb in (r for r in resources if r["kind"] == "PodDisruptionBudget"):
        selector = pdb["spec"]["selector"]["matchLabels"]
        labels = deployments[pdb["metadata"]["name"]]["spec"]["template"]["metadata"]["labels"]
        assert selector.items() <= labels.items()
