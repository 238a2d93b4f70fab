"""The canary watching itself, end to end (issue: "a stopped scheduler is alerted within one period
plus 5 minutes"): the real stack — its own Postgres and Redis, the API, a worker, the beat — with a
schedule every minute, a real Prometheus scraping the API's /metrics with the shipped rules and
intervals (deploy/prometheus: scrape and evaluation every 30 s) and a real Alertmanager with the
shipped route (deploy/alertmanager: group_wait 30 s), whose receiver is a webhook on loopback.

    A  kill -9 the beat (nothing starts runs any more): the time from the kill to CanaryStale
       reaching Alertmanager's receiver. The project's own channel cannot hear of it: the
       reconciler that sends it runs in the beat.
    B  the beat back, a run succeeds again (CanaryStale resolves: Alertmanager says so at its next
       group_interval, 1 min for CanaryStale's route as shipped), then kill -9 the worker (the beat
       keeps starting runs that never finish): the time from the kill to CanaryStale in the
       project's channel (the reconciler) and at Alertmanager's receiver (Prometheus).

The bound is one period (60 s here) plus 5 minutes. The floor is set by the definition, not the
pipeline: a schedule is stale once the run due after its last success is overdue by a period, so
at least one and at most two periods after the last success; the pipeline adds up to a scrape, an
evaluation and Alertmanager's group_wait (30 s each with the shipped settings).

    python benchmarks/stale_alert.py            # about 15 minutes; writes benchmarks/results/stale_alert.json
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime

import httpx
import yaml

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.soak import Stack, log, service_stores  # noqa: E402
from tests.http.receiver import Receiver  # noqa: E402
from tests.loopback import free_port, serve_in_thread, wait_http  # noqa: E402

PERIOD_S = 60  # the schedule's cron: every minute
BOUND_S = PERIOD_S + 5 * 60


def binary(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        sys.exit(f"error: {name} is not installed (Debian: apt-get install prometheus prometheus-alertmanager)")
    return path


def start_prometheus(workdir: str, api_port: int, am_port: int, key_file: str) -> tuple[subprocess.Popen, str]:
    """deploy/prometheus/prometheus.yml as shipped (intervals, rules, the Bearer scrape), its
    targets pointed at this stack."""
    conf = yaml.safe_load((ROOT / "deploy/prometheus/prometheus.yml").read_text())
    conf["rule_files"] = [str(ROOT / "deploy/prometheus/canary-rules.yml")]
    conf["alerting"]["alertmanagers"][0]["static_configs"] = [{"targets": [f"127.0.0.1:{am_port}"]}]
    job = conf["scrape_configs"][0]
    job["authorization"]["credentials_file"] = key_file
    job["static_configs"] = [{"targets": [f"127.0.0.1:{api_port}"]}]
    path = os.path.join(workdir, "prometheus.yml")
    pathlib.Path(path).write_text(yaml.safe_dump(conf))
    port = free_port()
    logfile = os.path.join(workdir, "prometheus.log")
    proc = subprocess.Popen([binary("prometheus"), f"--config.file={path}", f"--storage.tsdb.path={workdir}/tsdb",
                             f"--web.listen-address=127.0.0.1:{port}"], stdout=open(logfile, "w"),
                            stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    wait_http(url + "/-/ready", proc, logfile)
    return proc, url


def start_alertmanager(workdir: str, hook: str) -> tuple[subprocess.Popen, int]:
    """deploy/alertmanager/alertmanager.yml's route as shipped (group_wait, inhibition), its Slack
    receiver replaced by a webhook of the same name."""
    conf = yaml.safe_load((ROOT / "deploy/alertmanager/alertmanager.yml").read_text())
    for receiver in conf["receivers"]:
        receiver.pop("slack_configs", None)
        receiver["webhook_configs"] = [{"url": hook, "send_resolved": True}]
    path = os.path.join(workdir, "alertmanager.yml")
    pathlib.Path(path).write_text(yaml.safe_dump(conf))
    port = free_port()
    logfile = os.path.join(workdir, "alertmanager.log")
    proc = subprocess.Popen([binary("prometheus-alertmanager"), f"--config.file={path}",
                             f"--storage.path={workdir}/am-data", f"--web.listen-address=127.0.0.1:{port}",
                             "--cluster.listen-address="], stdout=open(logfile, "w"), stderr=subprocess.STDOUT,
                            start_new_session=True)
    wait_http(f"http://127.0.0.1:{port}/-/ready", proc, logfile)
    return proc, port


def stale_posts(receiver: Receiver, path: str, since: float, status: str = "firing",
                started_after: datetime | None = None) -> list[dict]:
    """The receiver's POSTs on `path` after `since` (time.monotonic) holding a CanaryStale alert in
    `status` (Alertmanager's webhook body, which the canary's webhook channel sends too); with
    started_after, only an episode that began after it (the alert's startsAt), not a late message
    about an earlier one."""
    found = []
    for r in receiver.requests:
        if r["path"] != path or r["t"] < since:
            continue
        try:
            alerts = json.loads(r["body"])["alerts"]
        except (ValueError, KeyError, TypeError):
            continue
        if any(a["labels"].get("alertname") == "CanaryStale" and a["status"] == status
               and (started_after is None or datetime.fromisoformat(a["startsAt"].replace("Z", "+00:00"))
                    > started_after) for a in alerts):
            found.append(r)
    return found


def wait_for(what: str, check, timeout: float, poll: float = 1.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = check()
        if got:
            return got
        time.sleep(poll)
    raise TimeoutError(f"{what}: not within {timeout:.0f} s")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/stale_alert.json"))
    args = ap.parse_args()

    workdir = tempfile.mkdtemp(prefix="canary-stale-")
    pg, redis, env = service_stores("stale", CANARY_RECONCILE_SECONDS="10")
    receiver = Receiver()
    receiver_port = free_port()
    hook_server = serve_in_thread(receiver.app, receiver_port)
    stack = Stack(env, workdir)
    extra: list[subprocess.Popen] = []
    report: dict = {"period_s": PERIOD_S, "bound_s": BOUND_S,
                    "prometheus": "deploy/prometheus/prometheus.yml (scrape and evaluation every 30 s)",
                    "alertmanager": "deploy/alertmanager/alertmanager.yml (group_wait 30 s)"}
    try:
        api_port = free_port()
        stack.start("api", [sys.executable, "-m", "uvicorn", "app.api.main:app", "--host", "127.0.0.1",
                            "--port", str(api_port)])
        api = f"http://127.0.0.1:{api_port}"
        wait_http(f"{api}/healthz", stack.procs["api"], os.path.join(workdir, "api.log"))
        stack.worker("work", "gpu,cpu", "--concurrency", "1")
        stack.worker("beat", "default,notify", "--concurrency", "1", "--beat")
        key = subprocess.run([sys.executable, "-m", "app.cli", "keys", "create", "--project", "ops", "--scope",
                              "metrics-all"], cwd=ROOT, env=env, check=True, capture_output=True,
                             text=True).stdout.strip().splitlines()[-1]
        key_file = os.path.join(workdir, "metrics.key")
        pathlib.Path(key_file).write_text(key + "\n")
        am_proc, am_port = start_alertmanager(workdir, f"http://127.0.0.1:{receiver_port}/am")
        extra.append(am_proc)
        prom_proc, prom = start_prometheus(workdir, api_port, am_port, key_file)
        extra.append(prom_proc)

        http = httpx.Client(base_url=f"{api}/api/v1", timeout=60)
        assert http.post("/projects", json={"name": "legit"}).status_code == 201
        project = httpx.Client(base_url=f"{api}/api/v1/projects/legit", timeout=60)
        assert project.post("/models", json={"name": "tiny", "path": "builtin:pydoc-target"}).status_code == 201
        for body in ({"name": "fp32", "model": "tiny", "baseline": True, "engine": "reference", "weights": "fp32"},
                     {"name": "int8", "model": "tiny", "engine": "reference", "weights": "int8"}):
            assert project.post("/configs", json=body).status_code == 201, body
        assert project.post("/suites", json={"name": "smoke", "corpus": "builtin:pydoc-heldout", "samples": 4,
                                             "scorers": ["perplexity"], "perplexity": {"window": 64}}).status_code == 201
        assert project.put("/channels", json={"name": "hook", "kind": "webhook",
                                              "url": f"http://127.0.0.1:{receiver_port}/canary"}).status_code == 200
        r = project.put("/schedules", json={"name": "minutely", "cron": "* * * * *", "suite": "smoke"})
        assert r.status_code == 200, r.text

        def schedule() -> dict:
            return project.get("/schedules").json()[0]

        def succeeded_since(t: datetime):
            s = schedule()
            return s if s["last_success_at"] and datetime.fromisoformat(s["last_success_at"]) > t else None

        log("waiting for the schedule's first successful run")
        first = wait_for("a scheduled run that succeeds", lambda: succeeded_since(datetime(2000, 1, 1, tzinfo=UTC)),
                         240)
        log(f"last success {first['last_success_at']}")

        # A: the beat dies (once the schedule is not stale: before its first success it may have been)
        wait_for("the schedule not stale", lambda: not schedule()["stale"], 120)
        time.sleep(2)
        heartbeat = schedule()["last_success_at"]
        t_kill, wall_kill = time.monotonic(), datetime.now(UTC)
        stack.kill("beat", 9)
        log("A: beat killed; waiting for CanaryStale at Alertmanager's receiver")
        wait_for("CanaryStale at the receiver (beat dead)", lambda: stale_posts(receiver, "/am", t_kill,
                                                                                  started_after=wall_kill), BOUND_S + 120)
        t_alert = stale_posts(receiver, "/am", t_kill, started_after=wall_kill)[0]["t"]
        stale_at = schedule()
        report["A_beat_killed"] = {
            "last_success_at": heartbeat, "killed_at": wall_kill.isoformat(),
            "seconds_kill_to_alertmanager_receiver": round(t_alert - t_kill, 1),
            "stale_reason": stale_at.get("stale_reason"),
            "channel_messages_while_beat_dead": len(stale_posts(receiver, "/canary", t_kill, started_after=wall_kill)),
            "within_bound": t_alert - t_kill <= BOUND_S}
        log(f"A: {report['A_beat_killed']}")

        # B: the beat back, a success, then the worker dies
        t_back, wall_back = time.monotonic(), datetime.now(UTC)
        stack.worker("beat", "default,notify", "--concurrency", "1", "--beat")
        wait_for("a run that succeeds after the beat came back", lambda: succeeded_since(wall_back), 240)
        # Alertmanager sends a group's resolution at its next group_interval (CanaryStale's route: 1 min)
        resolved = wait_for("CanaryStale resolved at the receiver",
                            lambda: stale_posts(receiver, "/am", t_back, "resolved"), 240 + 5 * 60)
        report["A_recovery_seconds_to_resolved"] = round(resolved[0]["t"] - t_back, 1)
        time.sleep(2)
        t_kill2, wall_kill2 = time.monotonic(), datetime.now(UTC)
        heartbeat2 = schedule()["last_success_at"]
        stack.kill("work", 9)
        log("B: worker killed; waiting for CanaryStale in the project's channel and at Alertmanager's receiver")
        def episode(path: str) -> list[dict]:
            return stale_posts(receiver, path, t_kill2, started_after=wall_kill2)

        wait_for("CanaryStale in the channel and at the receiver (worker dead)",
                 lambda: episode("/canary") and episode("/am"), BOUND_S + 120)
        t_channel, t_am = episode("/canary")[0]["t"], episode("/am")[0]["t"]
        report["B_worker_killed"] = {
            "last_success_at": heartbeat2, "killed_at": wall_kill2.isoformat(),
            "seconds_kill_to_project_channel": round(t_channel - t_kill2, 1),
            "seconds_kill_to_alertmanager_receiver": round(t_am - t_kill2, 1),
            "channel_message": episode("/canary")[0]["body"].decode(errors="replace")[:400],
            "within_bound": max(t_channel, t_am) - t_kill2 <= BOUND_S}
        log(f"B: {report['B_worker_killed']}")
        report["alerts_prometheus_saw"] = [
            {k: a[k] for k in ("state", "activeAt")} | {"alertname": a["labels"]["alertname"]}
            for a in httpx.get(prom + "/api/v1/alerts").json()["data"]["alerts"]]
    finally:
        stack.stop_all()
        for proc in extra:
            proc.terminate()
            proc.wait(10)
        hook_server.should_exit = True
        redis.close()
        pg.stop()
    report["machine"] = {"cpus": os.cpu_count(), "load_avg": os.getloadavg()}
    text = json.dumps(report, indent=1)
    print(text)
    pathlib.Path(args.out).write_text(text + "\n")
    return 0 if report["A_beat_killed"]["within_bound"] and report["B_worker_killed"]["within_bound"] else 1


if __name__ == "__main__":
    sys.exit(main())
