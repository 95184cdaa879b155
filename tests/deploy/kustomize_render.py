"""A small, strict, pure-Python renderer for the subset of Kustomize that k8s/ uses.

No kubectl or kustomize binary is available offline (no PyPI package ships one), so the tests
render with this. It implements kustomize's semantics for exactly these fields, and refuses any
other field, so a manifest can't silently use something it does not understand:

    resources   files (multi-document YAML) and directories holding a kustomization.yaml
    components  directories whose kustomization.yaml has kind: Component (applied after resources)
    patches     `path:` or inline `patch:`; strategic-merge (a document with kind/metadata.name) or
                JSON 6902 (a list of add/remove/replace ops; needs `target:`, whose name is a regex)
    namespace   set on every namespaced resource
    images      name -> newName/newTag on every `containers`/`initContainers` image, at any depth
    replicas    name -> count on Deployments

Order, as kustomize: resources, then components, then this kustomization's patches, namespace,
images, replicas. Strategic merge uses the Kubernetes merge keys for the lists we patch
(containers/initContainers/env/volumes/imagePullSecrets by name, volumeMounts by mountPath,
ports by containerPort); other lists are replaced, as Kubernetes does for atomic lists.
"""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any

import yaml

KUSTOMIZATION_FIELDS = {"apiVersion", "kind", "resources", "components", "patches", "namespace",
                        "images", "replicas"}
MERGE_KEYS = {"containers": "name", "initContainers": "name", "env": "name", "volumes": "name",
              "imagePullSecrets": "name", "volumeMounts": "mountPath", "ports": "containerPort"}
CLUSTER_SCOPED_KINDS = {"Namespace", "ClusterRole", "ClusterRoleBinding", "PersistentVolume",
                        "StorageClass", "CustomResourceDefinition", "PriorityClass"}


class KustomizeError(Exception):
    pass


def load_yaml_documents(path: Path) -> list[Any]:
    with open(path) as f:
        return [doc for doc in yaml.safe_load_all(f) if doc is not None]


def render(directory: str | Path) -> list[dict]:
    """Render the kustomization in `directory` into a list of resources."""
    return _build(Path(directory), expect_kind="Kustomization")


def _read_kustomization(directory: Path, expect_kind: str) -> dict:
    path = directory / "kustomization.yaml"
    if not path.is_file():
        raise KustomizeError(f"{directory}: no kustomization.yaml")
    (k,) = load_yaml_documents(path)
    unknown = set(k) - KUSTOMIZATION_FIELDS
    if unknown:
        raise KustomizeError(f"{path}: fields this renderer does not implement: {sorted(unknown)}")
    kind = k.get("kind", "Kustomization")
    if kind != expect_kind:
        raise KustomizeError(f"{path}: kind {kind!r}, expected {expect_kind!r}")
    want_api = {"Kustomization": "kustomize.config.k8s.io/v1beta1",
                "Component": "kustomize.config.k8s.io/v1alpha1"}[kind]
    if k.get("apiVersion") != want_api:
        raise KustomizeError(f"{path}: apiVersion {k.get('apiVersion')!r}, expected {want_api!r}")
    return k


def _build(directory: Path, expect_kind: str, resources: list[dict] | None = None) -> list[dict]:
    k = _read_kustomization(directory, expect_kind)
    resources = [] if resources is None else resources
    for entry in k.get("resources", []):
        target = (directory / entry).resolve()
        if target.is_dir():
            resources.extend(_build(target, "Kustomization"))
        elif target.is_file():
            resources.extend(copy.deepcopy(load_yaml_documents(target)))
        else:
            raise KustomizeError(f"{directory}: resource {entry!r} not found")
    for entry in k.get("components", []):
        resources = _build((directory / entry).resolve(), "Component", resources)
    for patch in k.get("patches", []):
        _apply_patch(directory, patch, resources)
    if "namespace" in k:
        for res in resources:
            if res["kind"] not in CLUSTER_SCOPED_KINDS:
                res.setdefault("metadata", {})["namespace"] = k["namespace"]
    for image in k.get("images", []):
        _set_image(resources, image)
    for rep in k.get("replicas", []):
        matches = [r for r in resources if r["kind"] == "Deployment" and r["metadata"]["name"] == rep["name"]]
        if not matches:
            raise KustomizeError(f"{directory}: replicas: no Deployment {rep['name']!r}")
        for res in matches:
            res["spec"]["replicas"] = rep["count"]
    _check_unique(resources, directory)
    return resources


def _check_unique(resources: list[dict], where: Path) -> None:
    seen = set()
    for res in resources:
        key = (res["apiVersion"], res["kind"], res["metadata"].get("namespace"), res["metadata"]["name"])
        if key in seen:
            raise KustomizeError(f"{where}: duplicate resource {key}")
        seen.add(key)


# --- patches ---------------------------------------------------------------------------------

def _apply_patch(directory: Path, spec: dict, resources: list[dict]) -> None:
    unknown = set(spec) - {"path", "patch", "target"}
    if unknown or ("path" in spec) == ("patch" in spec):
        raise KustomizeError(f"{directory}: bad patch entry {spec}")
    docs = (load_yaml_documents(directory / spec["path"]) if "path" in spec
            else [d for d in yaml.safe_load_all(spec["patch"]) if d is not None])
    if len(docs) != 1:
        raise KustomizeError(f"{directory}: patch {spec} must hold exactly one document")
    body = docs[0]
    if isinstance(body, list):  # JSON 6902
        if "target" not in spec:
            raise KustomizeError(f"{directory}: JSON 6902 patch {spec} needs a target")
        targets = [r for r in resources if _matches(r, spec["target"])]
        if not targets:
            raise KustomizeError(f"{directory}: patch target {spec['target']} matches nothing")
        for res in targets:
            for op in body:
                _json6902(res, op)
        return
    targets = ([r for r in resources if _matches(r, spec["target"])] if "target" in spec else
               [r for r in resources if r["kind"] == body["kind"]
                and r["metadata"]["name"] == body["metadata"]["name"]])
    if not targets:
        raise KustomizeError(f"{directory}: strategic merge patch for {body['kind']}/"
                             f"{body['metadata']['name']} matches no resource")
    for res in targets:
        merged = strategic_merge(res, {k: v for k, v in body.items() if k not in ("apiVersion", "kind")}
                                 | {"metadata": {kk: vv for kk, vv in body["metadata"].items() if kk != "name"}})
        res.clear()
        res.update(merged)


def _matches(res: dict, target: dict) -> bool:
    unknown = set(target) - {"group", "version", "kind", "name"}
    if unknown:
        raise KustomizeError(f"patch target fields not implemented: {sorted(unknown)}")
    group, _, version = res["apiVersion"].rpartition("/")
    return (target.get("kind", res["kind"]) == res["kind"]
            and target.get("group", group) == group
            and target.get("version", version) == version
            and re.fullmatch(target.get("name", ".*"), res["metadata"]["name"]) is not None)


def strategic_merge(base: Any, patch: Any, key: str | None = None) -> Any:
    """Kubernetes strategic merge of `patch` into `base` (a copy is returned)."""
    if isinstance(base, dict) and isinstance(patch, dict):
        out = copy.deepcopy(base)
        for k, v in patch.items():
            if v is None:
                out.pop(k, None)
            elif k in out:
                out[k] = strategic_merge(out[k], v, k)
            else:
                out[k] = copy.deepcopy(v)
        return out
    if isinstance(base, list) and isinstance(patch, list) and key in MERGE_KEYS:
        merge_key = MERGE_KEYS[key]
        out = copy.deepcopy(base)
        for item in patch:
            for i, existing in enumerate(out):
                if existing.get(merge_key) == item.get(merge_key):
                    out[i] = strategic_merge(existing, item)
                    break
            else:
                out.append(copy.deepcopy(item))
        return out
    return copy.deepcopy(patch)


def _json6902(res: dict, op: dict) -> None:
    parts = [p.replace("~1", "/").replace("~0", "~") for p in op["path"].split("/")[1:]]
    parent = res
    for part in parts[:-1]:
        parent = parent[int(part)] if isinstance(parent, list) else parent[part]
    last = parts[-1]
    kind = op["op"]
    if isinstance(parent, list):
        index = len(parent) if last == "-" else int(last)
        if kind == "add":
            parent.insert(index, copy.deepcopy(op["value"]))
        elif kind == "replace":
            parent[index] = copy.deepcopy(op["value"])
        elif kind == "remove":
            del parent[index]
        else:
            raise KustomizeError(f"JSON 6902 op not implemented: {kind}")
    else:
        if kind in ("replace", "remove") and last not in parent:
            raise KustomizeError(f"JSON 6902 {kind}: {op['path']} does not exist in "
                                 f"{res['kind']}/{res['metadata']['name']}")
        if kind in ("add", "replace"):
            parent[last] = copy.deepcopy(op["value"])
        elif kind == "remove":
            del parent[last]
        else:
            raise KustomizeError(f"JSON 6902 op not implemented: {kind}")


# --- images ----------------------------------------------------------------------------------

def _split_image(image: str) -> tuple[str, str | None]:
    name, sep, tag = image.rpartition(":")
    if sep and "/" not in tag:
        return name, tag
    return image, None


def _set_image(resources: list[dict], rule: dict) -> None:
    unknown = set(rule) - {"name", "newName", "newTag"}
    if unknown:
        raise KustomizeError(f"images fields not implemented: {sorted(unknown)}")

    def visit(node: Any) -> None:
        if isinstance(node, dict):
            for k, v in node.items():
                if k in ("containers", "initContainers") and isinstance(v, list):
                    for c in v:
                        name, tag = _split_image(c.get("image", ""))
                        if name == rule["name"]:
                            c["image"] = f"{rule.get('newName', name)}:{rule.get('newTag', tag)}" \
                                if rule.get("newTag", tag) else rule.get("newName", name)
                visit(v)
        elif isinstance(node, list):
            for item in node:
                visit(item)

    visit(resources)
