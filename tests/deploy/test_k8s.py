"""deploy/k8s renders with kustomize (built into kubectl) for every overlay, every rendered
object validates against the Kubernetes API schema (kubernetes-validate, strict: an unknown or
misspelt field fails), and the manifests say what the deployment needs: GPU workers asking for
one GPU each on GPU nodes, probes on /healthz, a migration Job that the API and workers wait
for, exactly one beat, secrets referenced and never written (except the dev overlay's labelled
placeholders)."""

from __future__ import annotations

import base64
import os
import subprocess
import sys

import pytest
import yaml

from tests.conftest import ROOT
from tests.deploy.tools import kustomize, missing

K8S = ROOT / "deploy/k8s"
OVERLAYS = sorted(p.name for p in (K8S / "overlays").iterdir() if (p / "kustomization.yaml").is_file())
KUBERNETES_VERSION = "1.30.0"
APP_DEPLOYMENTS = ("canary-api", "canary-worker-gpu", "canary-worker-cpu", "canary-beat")


def validator():
    try:
        import kubernetes_validate
    except ImportError:
        missing("kubernetes-validate", "pip install kubernetes-validate, the dev extra")
    return kubernetes_validate


def render(path) -> list[dict]:
    r = subprocess.run([*kustomize(), str(path)], capture_output=True, text=True, check=False)
    assert r.returncode == 0, r.stderr
    return [d for d in yaml.safe_load_all(r.stdout) if d]


@pytest.fixture(scope="module", params=OVERLAYS)
def overlay(request) -> tuple[str, list[dict]]:
    return request.param, render(K8S / "overlays" / request.param)


def by(objs: list[dict], kind: str, name: str) -> dict:
    found = [o for o in objs if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind}/{name}: {len(found)} found"
    return found[0]


def pod(objs, kind, name) -> dict:
    return by(objs, kind, name)["spec"]["template"]["spec"]


def test_overlays_exist():
    assert {"dev", "production"} <= set(OVERLAYS)


def test_every_object_validates(overlay):
    kubernetes_validate = validator()
    name, objs = overlay
    assert len(objs) >= 10
    for o in objs:
        try:
            kubernetes_validate.validate(o, KUBERNETES_VERSION, strict=True)
        except kubernetes_validate.ValidationError as e:
            pytest.fail(f"{name}: {o['kind']}/{o['metadata']['name']}: {e.message} at {'.'.join(map(str, e.path))}")


def test_the_validator_catches_a_misspelt_field():
    kubernetes_validate = validator()
    bad = {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "x"},
           "spec": {"selector": {"matchLabels": {"a": "b"}}, "template": {"metadata": {"labels": {"a": "b"}},
                    "spec": {"containers": [{"name": "c", "image": "i", "readinessProbes": {}}]}}}}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, KUBERNETES_VERSION, strict=True)


def test_gpu_workers_request_one_gpu_each_on_gpu_nodes(overlay):
    _, objs = overlay
    spec = pod(objs, "Deployment", "canary-worker-gpu")
    (c,) = spec["containers"]
    assert c["resources"]["requests"]["nvidia.com/gpu"] == 1 and c["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert c["command"] == ["canary", "worker", "--queues", "gpu", "--concurrency", "1"]
    assert spec["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in spec["tolerations"]
    for other in ("canary-api", "canary-worker-cpu", "canary-beat", "canary-dashboard"):
        for c in pod(objs, "Deployment", other)["containers"]:
            assert "nvidia.com/gpu" not in str(c.get("resources")), f"{other} must not hold a GPU"


def test_production_runs_one_gpu_worker_per_gpu():
    objs = render(K8S / "overlays/production")
    assert by(objs, "Deployment", "canary-worker-gpu")["spec"]["replicas"] >= 1
    assert by(objs, "Deployment", "canary-api")["metadata"]["namespace"] == "canary"
    images = {c["image"] for o in objs if o["kind"] in ("Deployment", "Job") for c in
              o["spec"]["template"]["spec"]["containers"] + o["spec"]["template"]["spec"].get("initContainers", [])}
    assert all(":" in i and not i.endswith(":latest") for i in images), images  # pinned tags


def test_api_probes_on_healthz(overlay):
    _, objs = overlay
    (c,) = pod(objs, "Deployment", "canary-api")["containers"]
    for probe in ("readinessProbe", "livenessProbe"):
        assert c[probe]["httpGet"]["path"] == "/healthz", probe
    assert "--no-upgrade-db" in c["command"]
    svc = by(objs, "Service", "canary-api")
    assert svc["spec"]["selector"] == {"app.kubernetes.io/name": "canary-api"}


def test_migration_job_and_the_wait_for_it(overlay):
    _, objs = overlay
    job = by(objs, "Job", "canary-migrate")
    (c,) = job["spec"]["template"]["spec"]["containers"]
    assert c["command"] == ["canary", "db", "upgrade"]
    for name in APP_DEPLOYMENTS:
        (init,) = pod(objs, "Deployment", name)["initContainers"]
        assert init["command"][:2] == ["python", "/opt/canary-scripts/wait-for-schema.py"], name


def test_wait_for_schema_waits_until_the_migrations_ran(tmp_path):
    """The init container's script, as the manifests run it, against a real (SQLite) database."""
    script = K8S / "base/wait-for-schema.py"
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("CANARY_")},
           "CANARY_DATABASE_URL": f"sqlite:///{tmp_path / 'canary.db'}"}
    r = subprocess.run([sys.executable, str(script), "1"], env=env, capture_output=True, text=True, cwd=ROOT, timeout=60, check=False)
    assert r.returncode == 1 and "waiting for the migration job" in r.stdout, r.stdout + r.stderr
    subprocess.run([sys.executable, "-m", "app.cli", "db", "upgrade"], env=env, check=True, capture_output=True, cwd=ROOT)
    r = subprocess.run([sys.executable, str(script), "1"], env=env, capture_output=True, text=True, cwd=ROOT, timeout=60, check=False)
    assert r.returncode == 0, r.stdout + r.stderr


def test_exactly_one_beat(overlay):
    _, objs = overlay
    beat = by(objs, "Deployment", "canary-beat")
    assert beat["spec"]["replicas"] == 1 and beat["spec"]["strategy"]["type"] == "Recreate"
    with_beat = [o["metadata"]["name"] for o in objs if o["kind"] in ("Deployment", "StatefulSet", "DaemonSet")
                 for c in o["spec"]["template"]["spec"]["containers"] if "--beat" in (c.get("command") or [])]
    assert with_beat == ["canary-beat"]


def _env_sources(objs):
    for o in objs:
        if o["kind"] not in ("Deployment", "StatefulSet", "Job"):
            continue
        spec = o["spec"]["template"]["spec"]
        for c in spec["containers"] + spec.get("initContainers", []):
            yield o["metadata"]["name"], c


def test_secrets_are_referenced_not_written(overlay):
    name, objs = overlay
    for owner, c in _env_sources(objs):
        for e in c.get("env", []):
            if e["name"] in ("CANARY_DATABASE_URL", "CANARY_BROKER_URL", "CANARY_API_KEY", "POSTGRES_PASSWORD", "REDIS_PASSWORD"):
                assert "value" not in e and "secretKeyRef" in e["valueFrom"], f"{owner}: {e['name']} must come from a Secret"
    app_containers = [(o, c) for o, c in _env_sources(objs) if o.startswith("canary-") and o not in ("canary-postgres", "canary-redis")]
    assert app_containers
    for owner, c in app_containers:
        refs = {e["valueFrom"]["secretKeyRef"]["name"] for e in c.get("env", []) if "secretKeyRef" in e.get("valueFrom", {})}
        assert refs, f"{owner}: no secret referenced"
    secrets = [o for o in objs if o["kind"] == "Secret"]
    if name == "production":
        assert secrets == [], "the production overlay expects its Secrets to exist; it must not create them"
    else:
        for s in secrets:
            for k, v in s.get("data", {}).items():
                value = base64.b64decode(v).decode()
                assert value == "" or "dev-only-not-a-secret" in value, f"dev secret {k} must be a labelled placeholder"


def test_config_map_holds_no_secret(overlay):
    _, objs = overlay
    cm = next(o for o in objs if o["kind"] == "ConfigMap" and o["metadata"]["name"] == "canary-config")
    assert not {"CANARY_DATABASE_URL", "CANARY_BROKER_URL"} & set(cm["data"])
    assert cm["data"]["CANARY_EXECUTION"] == "celery"


def test_pods_run_as_non_root(overlay):
    _, objs = overlay
    for o in objs:
        if o["kind"] in ("Deployment", "StatefulSet", "Job"):
            spec = o["spec"]["template"]["spec"]
            assert spec["securityContext"]["runAsNonRoot"] is True, o["metadata"]["name"]
            for c in spec["containers"] + spec.get("initContainers", []):
                assert c["securityContext"]["allowPrivilegeEscalation"] is False, (o["metadata"]["name"], c["name"])
                assert c["resources"]["requests"], (o["metadata"]["name"], c["name"])
