"""Gates never starve behind escalations: the in-process dispatcher runs waiting tasks by
priority (a gate's first, an escalation's last), then in the order they were sent."""

from __future__ import annotations

import threading

from app import dispatch
from app.dispatch import DEFAULT_PRIORITY, ESCALATION_PRIORITY, GATE_PRIORITY, InlineDispatcher, priority_of


def test_priority_follows_the_run_trigger():
    assert priority_of("gate") == GATE_PRIORITY < priority_of("manual") == priority_of("schedule") == DEFAULT_PRIORITY
    assert priority_of("alert") == ESCALATION_PRIORITY > DEFAULT_PRIORITY
    assert priority_of(None) == DEFAULT_PRIORITY


def test_inline_queue_runs_a_gate_before_queued_escalations(monkeypatch):
    ran: list[str] = []

    def first(*, dispatcher, enqueued_at):
        ran.append("first")
        # what an aggregation does when two alerts escalate, then a CI gate arrives
        for name in ("escalation-1", "escalation-2"):
            dispatcher.send("record", name, priority=ESCALATION_PRIORITY)
        dispatcher.send("record", "scheduled")
        dispatcher.send("record", "gate", priority=GATE_PRIORITY)

    def record(name, *, dispatcher, enqueued_at):
        ran.append(name)

    monkeypatch.setattr(dispatch, "_inline_tasks", lambda: {"first": first, "record": record})
    InlineDispatcher().send("first")
    assert ran == ["first", "gate", "scheduled", "escalation-1", "escalation-2"]


def test_background_queue_takes_a_gate_sent_while_escalations_wait(monkeypatch):
    ran: list[str] = []
    release = threading.Event()

    def block(*, dispatcher, enqueued_at):
        release.wait(10)  # an escalation run that holds the one executor thread
        ran.append("running escalation")

    def record(name, *, dispatcher, enqueued_at):
        ran.append(name)

    monkeypatch.setattr(dispatch, "_inline_tasks", lambda: {"block": block, "record": record})
    d = InlineDispatcher(background=True)
    d.send("block", priority=ESCALATION_PRIORITY)
    d.send("record", "escalation config-run 2", priority=ESCALATION_PRIORITY)
    d.send("record", "escalation config-run 3", priority=ESCALATION_PRIORITY)
    d.send("record", "gate config-run", priority=GATE_PRIORITY)
    release.set()
    assert d.drain(10)
    assert ran == ["running escalation", "gate config-run", "escalation config-run 2", "escalation config-run 3"]
