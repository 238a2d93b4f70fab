"""A message is a turn on a GPU (security round 4, N5): the worker runs the config-run of the
project that deserves the turn most among the most urgent queued work, whatever the message's own
priority: fewest running, then longest since its last start, then first queued. Within one
project, nothing changes."""

from __future__ import annotations

from datetime import timedelta

from app import repo
from app.config_file import parse_config
from app.db import session_scope
from app.models import ConfigRun, utcnow
from app.services import apply_config_file, start_run
from sqlalchemy import select, update


class Recorder:
    def send(self, task, *args, priority=3):
        pass


def projects(*names: str) -> None:
    with session_scope() as s:
        for name in names:
            apply_config_file(s, parse_config({
                "project": name, "model": {"name": "tiny", "path": "builtin:pydoc-target"},
                "configs": [{"name": "base", "baseline": True}, {"name": "int8", "weights": "int8"}],
                "suites": [{"name": "s", "corpus": "builtin:pydoc-heldout", "samples": 4}]}))


def ids(run_id: int) -> list[int]:
    with session_scope() as s:
        return list(s.scalars(select(ConfigRun.id).where(ConfigRun.run_id == run_id).order_by(ConfigRun.id)))


def pick(config_run_id: int) -> int:
    with session_scope() as s:
        return repo.fair_pick(s, config_run_id)


def test_a_later_project_takes_the_turn_of_a_backlog(sqlite_env):
    projects("noisy", "quiet")
    noisy = [i for _ in range(3) for i in ids(start_run("noisy", "s", None, Recorder())[0])]
    with session_scope() as s:  # noisy has one running and started a moment ago
        s.execute(update(ConfigRun).where(ConfigRun.id == noisy[0]).values(status="running", started_at=utcnow()))
    quiet = ids(start_run("quiet", "s", None, Recorder())[0])
    # noisy's next message is quiet's turn: quiet runs nothing and never started
    assert pick(noisy[1]) == quiet[0]
    with session_scope() as s:
        s.execute(update(ConfigRun).where(ConfigRun.id == quiet[0]).values(status="running", started_at=utcnow()))
    # one running each: the project whose last start is older goes first (noisy), with its own
    assert pick(noisy[1]) == noisy[1]
    assert pick(quiet[1]) == noisy[1]  # quiet's message is noisy's turn now
    # at another priority nothing is shared: a gate's message runs the gate's config-run
    gate = ids(start_run("quiet", "s", None, Recorder(), trigger="gate")[0])
    assert pick(gate[0]) == gate[0]


def test_within_one_project_the_message_runs_its_own_config_run(sqlite_env):
    projects("solo")
    first = ids(start_run("solo", "s", None, Recorder())[0])
    second = ids(start_run("solo", "s", None, Recorder())[0])
    assert [pick(i) for i in first + second] == first + second
    with session_scope() as s:  # a message whose config-run finished is a turn for another project's
        s.execute(update(ConfigRun).where(ConfigRun.id == first[0]).values(
            status="succeeded", started_at=utcnow() - timedelta(minutes=1)))
    assert pick(first[0]) == first[1]  # its project's oldest queued: the one after it


def test_a_message_held_behind_runs_a_more_urgent_config_run_queued_since(sqlite_env, monkeypatch):
    """The worker prefetched noisy's next message, one step behind its fair share (priority 6),
    before quiet's manual run (priority 3) was queued: that message is quiet's turn. Before, the
    turn was shared only at the message's own priority, so quiet waited a config-run more."""
    from app.dispatch import DEFAULT_PRIORITY

    monkeypatch.setenv("CANARY_FAIR_SHARE_QUEUED_CONFIG_RUNS", "2")
    from app.settings import get_settings

    get_settings.cache_clear()
    projects("noisy", "quiet")
    noisy = [i for _ in range(2) for i in ids(start_run("noisy", "s", None, Recorder())[0])]
    with session_scope() as s:
        behind = [cr.id for cr in s.scalars(select(ConfigRun).where(ConfigRun.id.in_(noisy))) if cr.priority > 3]
    assert behind == noisy[2:]  # past its share of 2: one step behind
    with session_scope() as s:  # noisy holds the GPU
        s.execute(update(ConfigRun).where(ConfigRun.id == noisy[0]).values(status="running", started_at=utcnow()))
    quiet = ids(start_run("quiet", "s", None, Recorder())[0])
    assert pick(noisy[2]) == quiet[0]  # the held-behind message is quiet's turn
    assert pick(noisy[1]) == quiet[0]  # as is noisy's own message at quiet's priority
    with session_scope() as s:
        s.execute(update(ConfigRun).where(ConfigRun.id.in_(quiet)).values(status="succeeded", started_at=utcnow()))
    # nothing more urgent left: noisy's messages run noisy's work in order, the urgent one first
    assert pick(noisy[2]) == noisy[1] and pick(noisy[1]) == noisy[1]
    # an escalation's message (the last priority) runs the manual work queued before it
    escalation = ids(start_run("quiet", "s", None, Recorder(), trigger="alert")[0])
    assert pick(escalation[0]) == noisy[1]
    assert DEFAULT_PRIORITY == 3
    get_settings.cache_clear()


def test_a_message_re_sent_for_a_dead_worker_runs_its_own_config_run(sqlite_env):
    """A config-run whose worker died (running, its lease expired) was re-sent by the reconciler:
    that message runs it, however much more urgent work is queued. Before, the turn went to the
    queued work, and a dead gate's config-run waited for the whole backlog."""
    projects("noisy", "quiet")
    gate = ids(start_run("quiet", "s", None, Recorder(), trigger="gate")[0])
    backlog = [i for _ in range(3) for i in ids(start_run("noisy", "s", None, Recorder())[0])]
    with session_scope() as s:
        s.execute(update(ConfigRun).where(ConfigRun.id == gate[0]).values(
            status="running", started_at=utcnow(), lease_expires_at=utcnow() - timedelta(seconds=5)))
    assert pick(gate[0]) == gate[0]
    with session_scope() as s:  # a live lease: another worker runs it, and the message is a turn as before
        s.execute(update(ConfigRun).where(ConfigRun.id == gate[0]).values(lease_expires_at=utcnow() + timedelta(minutes=1)))
    assert pick(gate[0]) == gate[1] and backlog
