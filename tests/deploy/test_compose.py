"""deploy/docker-compose.yml is valid for Docker Compose v2 (`config` needs no engine) and says
what the deployment needs: the services, the GPU reservation of each GPU worker, migrations
before the API and the workers, exactly one beat, healthchecks, secrets only from the
environment. The Prometheus and Alertmanager files it mounts pass promtool and amtool."""

from __future__ import annotations

import json
import os
import shutil
import subprocess

import pytest
import yaml

from tests.conftest import ROOT
from tests.deploy.tools import compose, missing

COMPOSE_FILE = ROOT / "deploy/docker-compose.yml"
ENV_EXAMPLE = ROOT / "deploy/.env.example"
SERVICES = {"postgres", "redis", "migrate", "api", "worker-gpu", "worker-cpu", "beat", "dashboard", "prometheus", "alertmanager"}
SECRET_VARIABLES = ("POSTGRES_PASSWORD", "REDIS_PASSWORD")


def _env() -> dict[str, str]:
    # the shell's values must not stand in for the env file's
    return {k: v for k, v in os.environ.items() if k not in SECRET_VARIABLES and not k.startswith(("CANARY_", "COMPOSE_"))}


def _config(*args: str, env_file=ENV_EXAMPLE) -> subprocess.CompletedProcess:
    return subprocess.run([*compose(), "-f", str(COMPOSE_FILE), "--env-file", str(env_file), "config", *args],
                          capture_output=True, text=True, env=_env(), cwd=ROOT, check=False)


@pytest.fixture(scope="module")
def config() -> dict:
    r = _config("--format", "json")
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def test_compose_config_is_valid():
    r = _config("-q")
    assert r.returncode == 0, r.stderr


def test_passwords_come_from_the_environment(tmp_path):
    """No password has a default in the compose file: without the env file, config refuses."""
    empty = tmp_path / "empty.env"
    empty.write_text("")
    r = _config("-q", env_file=empty)
    assert r.returncode != 0
    assert "POSTGRES_PASSWORD" in r.stderr or "REDIS_PASSWORD" in r.stderr, r.stderr
    text = COMPOSE_FILE.read_text()
    for var in SECRET_VARIABLES:
        assert f"${{{var}:-" not in text, f"{var} must not have a default value"
    for line in ENV_EXAMPLE.read_text().splitlines():
        if line.split("=", 1)[0] in SECRET_VARIABLES:
            assert "local-only" in line, f"{line}: a placeholder must say it is for local use only"


def test_services(config):
    assert SERVICES <= set(config["services"]), sorted(SERVICES - set(config["services"]))


def test_gpu_workers_reserve_one_nvidia_device_each(config):
    gpu = {n: s for n, s in config["services"].items() if n.startswith("worker-gpu")}
    assert gpu
    devices_seen = []
    for name, svc in gpu.items():
        devices = svc["deploy"]["resources"]["reservations"]["devices"]
        assert len(devices) == 1 and devices[0]["driver"] == "nvidia" and "gpu" in devices[0]["capabilities"], (name, devices)
        ids = devices[0].get("device_ids") or []
        assert len(ids) == 1, f"{name}: one GPU per worker process ({devices[0]})"
        devices_seen += ids
        cmd = svc["command"]
        assert cmd[:2] == ["canary", "worker"] and cmd[cmd.index("--queues") + 1] == "gpu", cmd
        assert cmd[cmd.index("--concurrency") + 1] == "1", cmd
        assert "--beat" not in cmd
    assert len(devices_seen) == len(set(devices_seen)), f"two GPU workers share a device: {devices_seen}"


def test_api_and_workers_start_after_the_migration(config):
    migrate = config["services"]["migrate"]
    assert migrate["command"] == ["canary", "db", "upgrade"]
    assert migrate["depends_on"]["postgres"]["condition"] == "service_healthy"
    for name in ("api", "worker-gpu", "worker-cpu", "beat"):
        assert config["services"][name]["depends_on"]["migrate"]["condition"] == "service_completed_successfully", name
    assert "--no-upgrade-db" in config["services"]["api"]["command"]  # the one-shot migrates, not each API


def test_exactly_one_beat(config):
    beats = [n for n, s in config["services"].items() if "--beat" in (s.get("command") or [])]
    assert beats == ["beat"], beats
    assert config["services"]["beat"].get("deploy", {}).get("replicas", 1) == 1
    cpu = config["services"]["worker-cpu"]["command"]
    assert cpu[cpu.index("--queues") + 1] == "cpu,default"


def test_redis_is_a_broker_that_never_evicts(config):
    cmd = " ".join(config["services"]["redis"]["command"])
    assert "--maxmemory-policy noeviction" in cmd and "--appendonly yes" in cmd


def test_healthchecks(config):
    api = config["services"]["api"]["healthcheck"]["test"]
    assert any("/healthz" in part for part in api), api
    for name, svc in config["services"].items():
        if name != "migrate":
            assert svc.get("healthcheck", {}).get("test"), f"{name} has no healthcheck"


def test_dashboard_reads_the_api_with_a_key(config):
    env = config["services"]["dashboard"]["environment"]
    assert env["CANARY_API_URL"] == "http://api:8000"
    assert "CANARY_API_KEY" in env
    assert "CANARY_DATABASE_URL" not in env  # the dashboard never touches the database


def test_every_service_that_needs_the_database_gets_it_from_the_environment(config):
    for name in ("migrate", "api", "worker-gpu", "worker-cpu", "beat"):
        env = config["services"][name]["environment"]
        assert env["CANARY_DATABASE_URL"].startswith("postgresql://canary:change-me-local-only"), name  # from the env file
        if name != "migrate":
            assert env["CANARY_BROKER_URL"].startswith("redis://:change-me-local-only"), name


def test_prometheus_scrapes_the_api_and_loads_the_rules(config):
    prom = yaml.safe_load((ROOT / "deploy/prometheus/prometheus.yml").read_text())
    targets = [t for job in prom["scrape_configs"] for sc in job["static_configs"] for t in sc["targets"]]
    assert "api:8000" in targets
    api_job = next(job for job in prom["scrape_configs"] if "api:8000" in job["static_configs"][0]["targets"])
    # /metrics shows projects' figures only to a metrics key, sent from a compose secret
    assert api_job["authorization"]["credentials_file"] == "/run/secrets/canary_metrics_key"
    assert "canary_metrics_key" in config["services"]["prometheus"]["secrets"][0]["source"]
    assert config["secrets"]["canary_metrics_key"]["environment"] == "PROMETHEUS_CANARY_METRICS_KEY"
    assert prom["rule_files"] == ["canary-rules.yml"]
    assert prom["alerting"]["alertmanagers"][0]["static_configs"][0]["targets"] == ["alertmanager:9093"]
    mounts = {v["target"]: v["source"] for v in config["services"]["prometheus"]["volumes"] if v["type"] == "bind"}
    assert mounts["/etc/prometheus/canary-rules.yml"].endswith("deploy/prometheus/canary-rules.yml")
    assert mounts["/etc/prometheus/prometheus.yml"].endswith("deploy/prometheus/prometheus.yml")


@pytest.mark.parametrize("tool,args,package", [
    ("promtool", ["check", "config", "deploy/prometheus/prometheus.yml"], "prometheus"),  # and the rules it loads
    ("amtool", ["check-config", "deploy/alertmanager/alertmanager.yml"], "prometheus-alertmanager"),
], ids=["promtool", "amtool"])
def test_prometheus_tools_accept_the_files(tool, args, package, tmp_path):
    path = shutil.which(tool)
    if not path:
        missing(tool, f"Debian package {package}; .ci/run installs it")
    if tool == "promtool":
        # promtool opens the metrics-key file the scrape sends (a compose secret in the
        # container): check a copy that points at a stand-in, next to the rules it loads
        key_file = "/run/secrets/canary_metrics_key"
        text = (ROOT / args[-1]).read_text()
        assert f"credentials_file: {key_file}" in text
        (tmp_path / "key").write_text("cnry_stand-in\n")
        (tmp_path / "prometheus.yml").write_text(text.replace(key_file, str(tmp_path / "key")))
        shutil.copy(ROOT / "deploy/prometheus/canary-rules.yml", tmp_path / "canary-rules.yml")
        args = [*args[:-1], str(tmp_path / "prometheus.yml")]
    r = subprocess.run([path, *args], capture_output=True, text=True, cwd=ROOT, check=False)
    assert r.returncode == 0, r.stdout + r.stderr
