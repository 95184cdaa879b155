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


def rendered(name: str) -> list[dict]:
    return render(K8S / name)


def compose() -> dict:
    return yaml.safe_load((REPO_ROOT / "docker-compose.yml").read_text())


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
