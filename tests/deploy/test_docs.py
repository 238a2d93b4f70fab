"""The operator docs are checked, not just written.

- Every ```bash doc-check block in docs/ runs, in the order of DOCS (a reader follows api.md
  before the runbooks look at its run), in a temporary folder that holds links to the
  repository's deploy/, docs/ and canary.example.yaml, against a live `canary serve` on a free
  loopback port on the embedded default (SQLite, tasks in-process, no broker). A block that
  fails fails the test of its document, with the block's line and the output.
- Every ```sql doc-check block (the runbooks' queries, written for psql on Postgres in portable
  SQL) runs against that database afterwards, so every table and column it names exists.
- docs/configuration.md is what docs/gen_config_reference.py generates from `canary schema`.
- Every `canary …` command in any code block of docs/ and the README's deploy section names a
  real subcommand and real options; every CANARY_* variable named in docs/ is a setting or a
  variable the CLI or dashboard reads; relative links between the docs resolve.

Commands that cannot run here (docker compose up, kubectl apply, a GPU) are in blocks without
the doc-check tag.
"""

from __future__ import annotations

import os
import re
import shutil
import sqlite3
import subprocess
import sys
import time

import pytest

from tests.conftest import ROOT
from tests.deploy.tools import missing
from tests.loopback import canary_serve

DOCS_DIR = ROOT / "docs"
# the order a reader follows; the runbooks inspect the project and run that api.md created
DOCS = ["api.md", "ci-gate.md", "configuration.md", "concepts.md", "scorers.md", "service.md", "gpu-cluster.md",
        "runbooks.md", "design.md", "reference.md", "benchmarks.md", "development.md"]
FENCE = re.compile(r"^```(\S*)(.*)$")
SCRIPT_TIMEOUT_S = 240


def blocks(path, lang: str | None = None, tagged: bool | None = None) -> list[tuple[int, str, str]]:
    """(line, language, body) of each fenced block; tagged=True only doc-check blocks."""
    out, cur = [], None
    for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        m = FENCE.match(line)
        if cur is None and m:
            cur = (i, m.group(1), "doc-check" in m.group(2).split(), [])
        elif cur is not None and line.startswith("```"):
            start, language, is_tagged, body = cur
            if (lang is None or language == lang) and (tagged is None or tagged == is_tagged):
                out.append((start, language, "\n".join(body)))
            cur = None
        elif cur is not None:
            cur[3].append(line)
    assert cur is None, f"{path.name}: code block opened at line {cur[0]} is never closed"
    return out


def test_docs_are_listed():
    assert sorted(p.name for p in DOCS_DIR.glob("*.md")) == sorted(DOCS), "add new docs to DOCS (their doc-check order)"
    for name in DOCS:
        for line, lang, _ in blocks(DOCS_DIR / name, tagged=True):
            assert lang in ("bash", "sql"), f"docs/{name}:{line}: doc-check blocks are bash or sql, not {lang!r}"


def test_configuration_reference_is_fresh():
    r = subprocess.run([sys.executable, str(DOCS_DIR / "gen_config_reference.py"), "--check"], capture_output=True, text=True, cwd=ROOT, check=False)
    assert r.returncode == 0, r.stderr


# ---------------------------------------------------------------- runnable blocks


def _script(name: str) -> str:
    parts = ["set -euo pipefail"]
    for line, _, body in blocks(DOCS_DIR / name, "bash", tagged=True):
        parts.append(f"echo '>>> docs/{name}:{line}' >&2")
        parts.append(body)
    return "\n".join(parts) + "\n"


@pytest.fixture(scope="module")
def doc_runs(tmp_path_factory):
    """Run every document's doc-check blocks once, in DOCS order; {doc: (rc, output, seconds)}."""
    for tool in ("bash", "curl", "jq"):
        if not shutil.which(tool):
            missing(tool, "the docs' examples use it; Debian package of the same name")
    work = tmp_path_factory.mktemp("doc-check")
    for entry in ("deploy", "docs", "canary.example.yaml"):
        (work / entry).symlink_to(ROOT / entry)
    env = {k: v for k, v in os.environ.items() if not k.startswith("CANARY_")}
    env.update({
        "PATH": f"{os.path.dirname(sys.executable)}{os.pathsep}{os.environ.get('PATH', '/usr/bin:/bin')}",
        "HOME": str(work), "COLUMNS": "200", "NO_COLOR": "1",
        "CANARY_DATABASE_URL": f"sqlite:///{work / 'canary.db'}",
        "CANARY_EXECUTION": "inline",
        "CANARY_ESCALATION": "false",  # a firing alert would start a 526-document run
        "CANARY_URL_ALLOWLIST": "127.0.0.1:*,localhost:*",
    })
    subprocess.run([sys.executable, "-m", "app.cli", "db", "upgrade"], env=env, cwd=work, check=True, capture_output=True)
    results: dict[str, tuple[int, str, float]] = {}
    with canary_serve(env, str(work / "serve.log"), "--no-upgrade-db") as url:
        env["CANARY_API_URL"] = url
        for name in DOCS:
            script = _script(name)
            t0 = time.monotonic()
            try:
                r = subprocess.run(["bash", "-c", script], env=env, cwd=work, capture_output=True, text=True, timeout=SCRIPT_TIMEOUT_S, check=False)
                results[name] = (r.returncode, r.stdout + r.stderr, time.monotonic() - t0)
            except subprocess.TimeoutExpired as e:
                out = (e.stdout or b"").decode() + (e.stderr or b"").decode() if isinstance(e.stdout, bytes) else f"{e.stdout}{e.stderr}"
                results[name] = (124, out + f"\n(timed out after {SCRIPT_TIMEOUT_S} s)", SCRIPT_TIMEOUT_S)
    results["_db"] = (0, str(work / "canary.db"), 0.0)
    return results


@pytest.mark.parametrize("name", DOCS)
def test_doc_commands_run(doc_runs, name):
    rc, out, seconds = doc_runs[name]
    marks = [m for m in out.splitlines() if m.startswith(">>> docs/")]
    where = marks[-1][4:] if marks else f"docs/{name}"
    assert rc == 0, f"the block at {where} failed (exit {rc}):\n{out[-4000:]}"
    print(f"docs/{name}: {len(marks)} blocks in {seconds:.1f} s")


def test_doc_sql_runs(doc_runs):
    """The runbooks' SQL names real tables and columns (run on the SQLite file the docs wrote)."""
    db = sqlite3.connect(doc_runs["_db"][1])
    ran = 0
    for name in DOCS:
        for line, _, body in blocks(DOCS_DIR / name, "sql", tagged=True):
            for stmt in (s.strip() for s in body.split(";")):
                lines = [x for x in stmt.splitlines() if not x.strip().startswith("--")]
                if not "".join(lines).strip():
                    continue
                try:
                    db.execute("\n".join(lines)).fetchall()
                except sqlite3.Error as e:
                    pytest.fail(f"docs/{name}:{line}: {e}\n{stmt}")
                ran += 1
    assert ran > 0


# ---------------------------------------------------------------- static checks


def _cli():
    import typer
    from app.cli import app

    return typer.main.get_command(app)


def _resolve(group, words: list[str]):
    cmd, used = group, 0
    while hasattr(cmd, "commands") and used < len(words) and words[used] in cmd.commands:
        cmd = cmd.commands[words[used]]
        used += 1
    return cmd, used


COMMAND_POSITION = re.compile(
    r"(?:^\s*(?:-\s+)?|[;|&(`]\s*|\b(?:if|then|else|do|!)\s+|\s--\s+|--rm\s+\S+\s+)canary\s+([a-z][^|;&)`#\n]*)", re.MULTILINE)
JSON_COMMAND = re.compile(r'\[\s*"canary"\s*,([^\]]*)\]')
INLINE_CODE = re.compile(r"`canary ([a-z][^`]*)`")


def _canary_invocations(text: str, code: bool) -> list[list[str]]:
    """`canary …` commands: in shell (code=True: continuations joined, at command position),
    in JSON-list form (compose and Kubernetes commands), and in inline code spans."""
    out = []
    if code:
        joined = re.sub(r"\\\n\s*", " ", text)
        out += [m.group(1).split() for m in COMMAND_POSITION.finditer(joined)]
    out += [[w.strip().strip('"') for w in m.group(1).split(",") if w.strip()] for m in JSON_COMMAND.finditer(text)]
    out += [m.group(1).split() for m in INLINE_CODE.finditer(text)]
    return out


def _doc_texts():
    """(where, text, is_code) for the docs' code blocks and prose, the README and deploy/."""
    for name in DOCS:
        path = DOCS_DIR / name
        for line, _, body in blocks(path):
            yield f"docs/{name}:{line}", body, True
        yield f"docs/{name}", path.read_text(encoding="utf-8"), False
    yield "README.md", (ROOT / "README.md").read_text(encoding="utf-8"), False
    for path in sorted((ROOT / "deploy").rglob("*")):
        if path.is_file() and path.suffix in ("", ".yml", ".yaml", ".example", ".api", ".worker", ".dashboard"):
            yield str(path.relative_to(ROOT)), path.read_text(encoding="utf-8"), False


def test_canary_commands_in_docs_exist():
    """A `canary` subcommand or option that the docs name but the CLI lacks fails here, in
    runnable and non-runnable blocks alike (compose, Kubernetes, the runbooks)."""
    cli = _cli()
    checked = 0
    for where, text, is_code in _doc_texts():
        for words in _canary_invocations(text, is_code):
            cmd, used = _resolve(cli, words)
            assert used > 0, f"{where}: `canary {' '.join(words)}`: no such command (have: {', '.join(cli.commands)})"
            if hasattr(cmd, "commands"):
                continue  # `canary db` alone
            opts = {o for p in cmd.params for o in (*p.opts, *p.secondary_opts)} | {"--help"}
            for w in words[used:]:
                flag = w.split("=", 1)[0]
                if flag.startswith("--") and not cmd.context_settings.get("ignore_unknown_options"):
                    assert flag in opts, f"{where}: `canary {' '.join(words)}`: {flag} is not an option of `canary {' '.join(words[:used])}`"
            checked += 1
    assert checked > 20


KNOWN_CLIENT_VARIABLES = {
    "CANARY_API_URL", "CANARY_API_KEY", "CANARY_DASHBOARD_WRITE_KEY",  # the gate CLI and the dashboard
    "CANARY_GATE_KEY", "CANARY_KERNELS", "CANARY_FUSED_STEP",  # canary gate's idempotency key; engines/kernels
    "CANARY_AWQ_CACHE",  # engines/reference/awq.py: where AWQ search results are cached
    "CANARY_ENGINE_API_KEY",  # canary engine-serve's --api-key default (workers/engine_server/app.py API_KEY_ENV)
    "CANARY_TEST_DATABASE_URL", "CANARY_TEST_REDIS_URL", "CANARY_PG_BINDIR", "CANARY_REDIS_SERVER",  # the test suite
    # deploy/.env.example's compose variables (not read by the service itself)
    "CANARY_IMAGE_PREFIX", "CANARY_VERSION", "CANARY_MODELS_DIR", "CANARY_DASHBOARD_API_KEY",
    "CANARY_API_BIND", "CANARY_DASHBOARD_BIND",
}


def test_canary_variables_in_docs_exist():
    from app.settings import Settings

    settings = {f"CANARY_{name.upper()}" for name in Settings.model_fields}
    for where, text, _ in _doc_texts():
        for var in set(re.findall(r"\bCANARY_[A-Z0-9_]+\b", text)):
            if var.startswith(Settings.model_fields["secret_env_prefix"].default) and var not in settings:
                continue  # a secret an operator names (CANARY_SECRET_SLACK_WEBHOOK_URL): the allow-listed prefix
            assert var in settings | KNOWN_CLIENT_VARIABLES, f"{where}: {var} is neither a setting (app/settings.py) nor a known variable"


def test_doc_links_resolve():
    for name in DOCS + ["../README.md"]:
        path = (DOCS_DIR / name).resolve()
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", path.read_text(encoding="utf-8")):
            if re.match(r"^[a-z]+://", target):
                continue
            assert (path.parent / target).exists(), f"{path.relative_to(ROOT)}: link to {target} does not resolve"


def test_celery_settings_in_the_docs_are_the_code_s():
    """gpu-cluster.md's table of Celery reliability settings matches workers/celery_app.py."""
    from workers.celery_app import celery_app

    conf = celery_app.conf
    actual = {"task_acks_late": conf.task_acks_late, "task_reject_on_worker_lost": conf.task_reject_on_worker_lost,
              "worker_prefetch_multiplier": conf.worker_prefetch_multiplier, "task_time_limit": conf.task_time_limit,
              "task_soft_time_limit": conf.task_soft_time_limit,
              "visibility_timeout": conf.broker_transport_options["visibility_timeout"],
              "broker_connection_retry_on_startup": conf.broker_connection_retry_on_startup}
    rows = {m.group(1): m.group(2) for m in re.finditer(r"^\| `(\w+)` \| `([^`]+)`", (DOCS_DIR / "gpu-cluster.md").read_text(), re.MULTILINE)}
    for key, value in actual.items():
        assert rows.get(key) == str(value), f"docs/gpu-cluster.md says {key} = {rows.get(key)}, workers/celery_app.py {value}"
    assert conf.accept_content == ["json"]
