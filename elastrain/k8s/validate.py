"""Offline validation of rendered manifests (no cluster).

- Core kinds (Secret, Service, Deployment, and the batch/v1 Job templates
  inside a JobSet) with the JSON schemas that the PyPI package
  `kubernetes-validate` ships, in its strict mode (unknown fields are errors).
- JobSet and Kueue kinds with the `openAPIV3Schema` of their
  CustomResourceDefinitions, via `jsonschema`, made strict the same way: an
  object schema that lists its properties (and does not say
  `x-kubernetes-preserve-unknown-fields`) rejects any other key, which the API
  server would silently prune.

The CRD schemas come from a directory of CRD YAML files as published by the
projects (`--crds DIR`, $ELASTRAIN_K8S_CRDS, or ../shared/k8s-crds beside the
repository), or else from the compact copies in `elastrain/k8s/crds/`
(descriptions removed; `tests/test_k8s.py` checks they match the originals).
Not checked offline: CEL rules (`x-kubernetes-validations`) and admission
webhooks (JobSet's and Kueue's own checks), which only a cluster runs.

Needs the `dev` or `k8s` extra: kubernetes-validate, jsonschema, pyyaml.
"""

from __future__ import annotations

import copy
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

Obj = dict[str, Any]

K8S_VERSION = "1.33"
"""Kubernetes version whose schemas the core kinds are checked against: the first
release with Job backoffLimitPerIndex and podReplacementPolicy GA (both beta since 1.29)."""

BUNDLED = Path(__file__).with_name("crds")


def strip_descriptions(schema: Any, names: bool = False) -> Any:
    """The schema without its `description` annotations (property names are kept:
    `names` is true for the map under `properties`, whose keys are field names)."""
    if isinstance(schema, dict):
        if names:
            return {k: strip_descriptions(v) for k, v in schema.items()}
        return {
            k: strip_descriptions(v, names=k in ("properties", "patternProperties"))
            for k, v in schema.items()
            if k != "description"
        }
    if isinstance(schema, list):
        return [strip_descriptions(x) for x in schema]
    return schema


def strict(schema: Any) -> Any:
    """A copy of an OpenAPI v3 schema in which listed properties are the only ones allowed."""
    if isinstance(schema, list):
        return [strict(x) for x in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: strict(v) for k, v in schema.items()}
    if (
        "properties" in out
        and "additionalProperties" not in out
        and not out.get("x-kubernetes-preserve-unknown-fields")
    ):
        out["additionalProperties"] = False
    return out


@dataclass(frozen=True)
class CRD:
    """One CustomResourceDefinition's served versions: {version: openAPIV3Schema}."""

    group: str
    kind: str
    scope: str
    versions: dict[str, Obj]


def compact(crd_doc: Obj) -> CRD:
    """The parts of a CRD document that validation needs (descriptions removed)."""
    spec = crd_doc["spec"]
    return CRD(
        group=spec["group"],
        kind=spec["names"]["kind"],
        scope=spec["scope"],
        versions={
            v["name"]: strip_descriptions(v["schema"]["openAPIV3Schema"])
            for v in spec["versions"]
            if v.get("served", True)
        },
    )


def default_crd_dir() -> Path | None:
    """$ELASTRAIN_K8S_CRDS, or ../shared/k8s-crds next to the repository, if present."""
    env_dir = os.environ.get("ELASTRAIN_K8S_CRDS")
    if env_dir:
        return Path(env_dir)
    repo = Path(__file__).resolve().parents[2]
    for cand in (repo.parent / "shared" / "k8s-crds", repo / "shared" / "k8s-crds"):
        if (cand / "jobset.yaml").is_file():
            return cand
    return None


def _crd_docs(crd_dir: Path) -> list[tuple[Path, Obj]]:
    """(file, document) of every CustomResourceDefinition in crd_dir/*.yaml."""
    import yaml

    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml: 10x faster
    out = []
    for f in sorted(Path(crd_dir).glob("*.yaml")):
        for doc in yaml.load_all(f.read_text(), Loader=loader):
            if isinstance(doc, dict) and doc.get("kind") == "CustomResourceDefinition":
                out.append((f, doc))
    if not out:
        raise FileNotFoundError(f"no CustomResourceDefinition in {crd_dir}/*.yaml")
    return out


def load_crds(crd_dir: Path | None = None) -> dict[tuple[str, str], CRD]:
    """{(group, kind): CRD} from CRD YAML files in `crd_dir`, or the bundled copies."""
    out: dict[tuple[str, str], CRD] = {}
    if crd_dir is not None:
        for _, doc in _crd_docs(crd_dir):
            c = compact(doc)
            out[(c.group, c.kind)] = c
        return out
    for f in sorted(BUNDLED.glob("*.json")):
        d = json.loads(f.read_text())
        c = CRD(d["group"], d["kind"], d["scope"], d["versions"])
        out[(c.group, c.kind)] = c
    return out


def _where(obj: Obj) -> str:
    return f"{obj.get('kind', '?')}/{obj.get('metadata', {}).get('name', '?')}"


def _path(err: Any) -> str:
    return "/".join(str(p) for p in err.absolute_path) or "(root)"


class Validator:
    """Validates rendered objects; `errors(objs)` lists what is wrong, one line each."""

    def __init__(self, crd_dir: Path | None = None, k8s_version: str = K8S_VERSION) -> None:
        self.crds = load_crds(crd_dir)
        self.k8s_version = k8s_version
        self._validators: dict[tuple[str, str, str], Any] = {}

    def _crd_validator(self, group: str, version: str, kind: str) -> Any:
        key = (group, version, kind)
        if key not in self._validators:
            import jsonschema

            crd = self.crds.get((group, kind))
            if crd is None or version not in crd.versions:
                raise KeyError(f"no served CRD schema for {kind} {group}/{version}")
            schema = copy.deepcopy(crd.versions[version])
            # OpenAPI 3.0 schemas: Draft 4 has the same boolean exclusiveMinimum/Maximum.
            self._validators[key] = jsonschema.Draft4Validator(strict(schema))
        return self._validators[key]

    def _core(self, obj: Obj, where: str) -> list[str]:
        import kubernetes_validate

        try:
            kubernetes_validate.validate(obj, self.k8s_version, strict=True)
        except kubernetes_validate.ValidationError as e:
            return [f"{where}: {e.message}"]
        except kubernetes_validate.SchemaNotFoundError:
            return [f"{where}: no schema for {obj.get('apiVersion')} {obj.get('kind')}"]
        return []

    def errors(self, objs: list[Obj]) -> list[str]:
        out: list[str] = []
        for obj in objs:
            where = _where(obj)
            api = obj.get("apiVersion", "")
            group, _, version = api.rpartition("/")
            if (group, obj.get("kind", "")) not in self.crds:
                out += self._core(obj, where)  # a core kind (or an unknown one: an error)
                continue
            try:
                v = self._crd_validator(group, version, obj.get("kind", ""))
            except KeyError as e:
                out.append(f"{where}: {e.args[0]}")
                continue
            out += [f"{where}: {_path(e)}: {e.message}" for e in v.iter_errors(obj)]
            crd = self.crds[(group, obj["kind"])]
            ns = obj.get("metadata", {}).get("namespace")
            if crd.scope == "Cluster" and ns:
                out.append(f"{where}: {obj['kind']} is cluster-scoped but has namespace {ns}")
            if obj["kind"] == "JobSet":
                # The Job templates are batch/v1 JobSpecs: check them strictly too.
                for rj in obj.get("spec", {}).get("replicatedJobs", []):
                    job = {
                        "apiVersion": "batch/v1",
                        "kind": "Job",
                        "metadata": {"name": f"{obj['metadata']['name']}-{rj.get('name')}"},
                        "spec": rj.get("template", {}).get("spec", {}),
                    }
                    out += self._core(job, f"{where} replicatedJobs[{rj.get('name')}]")
        return out


def validate(objs: list[Obj], crd_dir: Path | None = None) -> list[str]:
    """Every problem found in `objs` (empty: all valid). See the module docstring."""
    return Validator(crd_dir if crd_dir is not None else default_crd_dir()).errors(objs)


def bundle(src: Path, dst: Path = BUNDLED) -> list[Path]:
    """Write the compact schemas of the CRDs this package renders from the CRD YAMLs in src."""
    written = []
    for f, doc in _crd_docs(src):
        c = compact(doc)
        if c.kind in BUNDLED_KINDS:
            out = dst / (f.stem + ".json")
            body = {"group": c.group, "kind": c.kind, "scope": c.scope, "versions": c.versions}
            out.write_text(json.dumps(body, sort_keys=True, separators=(",", ":")) + "\n")
            written.append(out)
    return written


BUNDLED_KINDS = ("JobSet", "ClusterQueue", "LocalQueue", "ResourceFlavor", "WorkloadPriorityClass")
"""The CRD kinds `render` writes, whose schemas are bundled."""


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(prog="python -m elastrain.k8s.validate")
    ap.add_argument("--bundle", metavar="SRC_DIR", required=True, help="CRD YAML directory")
    for p in bundle(Path(ap.parse_args().bundle)):
        print(p)
