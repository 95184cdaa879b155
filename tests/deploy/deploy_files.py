"""Shared loaders for tests/deploy: the repo's deployment files, rendered and parsed."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

from tests.deploy.kustomize_render import render

REPO_ROOT = Path(__file__).resolve().parents[2]
K8S = REPO_ROOT / "k8s"
# Every kustomization a user may apply (plus base/workers, which kserve builds on).
KUSTOMIZATIONS = ["base", "base/workers", "overlays/cpu-dev", "overlays/gpu", "kserve", "kserve-llm",
                  "inference-pool"]
IMAGE_REPO = "tandem"
K8S_VERSION = "1.37.0"
# Not a settings.py option: fetch-model's cache (common/models/model_fetch.py), also used by
# `--model file.gguf`. The Dockerfile sets it; the model-init steps point it at the models volume.
FETCH_CACHE_ENV = "TANDEM_CACHE_DIR"
_COMPOSE_VARIABLE = re.compile(r"\$\$|\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")


def rendered(name: str) -> list[dict]:
    return render(K8S / name)


def compose() -> dict:
    return yaml.safe_load((REPO_ROOT / "docker-compose.yml").read_text())


def interpolate_compose(value, shell_env: dict[str, str] | None = None) -> str:
    """A compose value as compose passes it on: ${VAR:-default} from shell_env (unset: the
    default), and $$ (compose's escape) as a literal $ for the container's shell."""
    shell_env = shell_env or {}

    def replace(match: re.Match) -> str:
        if match.group(0) == "$$":
            return "$"
        return shell_env.get(match.group(1)) or (match.group(2) or "")

    return _COMPOSE_VARIABLE.sub(replace, str(value))


def dockerfile() -> str:
    # Join continuation lines so each instruction is one line.
    return re.sub(r"\\\n\s*", " ", (REPO_ROOT / "Dockerfile").read_text())


def pod_specs(resources: list[dict]):
    """(resource, pod-spec-like dict) for Deployments, KServe ServingRuntimes and LLMInferenceServices."""
    for res in resources:
        if res["kind"] == "Deployment":
            yield res, res["spec"]["template"]["spec"]
        elif res["kind"] == "ServingRuntime":
            yield res, res["spec"]
        elif res["kind"] == "LLMInferenceService":
            yield res, res["spec"]["template"]
