"""The alert state machine and the send / don't-send rules of REFERENCE §9, under a
controllable clock (one evaluation per run)."""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime, timedelta

from app.alerting import AlertState, SilenceRule, evaluate, fingerprint, idempotency_key, inhibited, should_notify

T0 = datetime(2026, 1, 1, tzinfo=UTC)
LABELS = {"project": "p", "model": "m", "config": "int4", "metric": "ppl_ratio", "severity": "warn"}


def step(state, verdict, for_runs=1, at=0.0, value=1.2):
    return evaluate(state, verdict, value, for_runs, T0 + timedelta(hours=at))


def test_fires_on_the_first_breach_when_for_is_one():
    s, t = step(AlertState(LABELS), "warn")
    assert (s.state, t, s.consecutive, s.fired_at) == ("firing", "firing", 1, T0)


def test_pending_then_firing_after_for_consecutive_runs():
    s, t = step(AlertState(LABELS), "warn", for_runs=3)
    assert (s.state, t) == ("pending", "pending")
    s, t = step(s, "critical", for_runs=3, at=1)  # critical also breaches the warn rule
    assert (s.state, t, s.consecutive) == ("pending", None, 2)
    s, t = step(s, "warn", for_runs=3, at=2)
    assert (s.state, t, s.started_at, s.fired_at) == ("firing", "firing", T0, T0 + timedelta(hours=2))


def test_pending_that_clears_goes_back_to_inactive_silently():
    s, _ = step(AlertState(LABELS), "warn", for_runs=2)
    s, t = step(s, "ok", for_runs=2, at=1)
    assert (s.state, t, s.consecutive) == ("inactive", "inactive", 0)
    assert should_notify(s, t, T0, send_resolved=True, silences=[], others=[]) is None


def test_inconclusive_is_no_data():
    s, _ = step(AlertState(LABELS), "warn", for_runs=2)
    s2, t = step(s, "inconclusive", for_runs=2, at=1)
    assert s2 == s and t is None


def test_firing_resolves_and_a_new_breach_starts_a_new_episode():
    s, _ = step(AlertState(LABELS), "warn")
    s = replace(s, last_notified_at=T0)
    s, t = step(s, "ok", at=1)
    assert (s.state, t, s.resolved_at) == ("resolved", "resolved", T0 + timedelta(hours=1))
    assert should_notify(s, t, T0 + timedelta(hours=1), send_resolved=True, silences=[], others=[]) == "resolved"
    assert should_notify(s, t, T0 + timedelta(hours=1), send_resolved=False, silences=[], others=[]) is None
    s2, t2 = step(s, "warn", at=2)
    assert (s2.state, t2, s2.started_at, s2.last_notified_at) == ("firing", "firing", T0 + timedelta(hours=2), None)


def test_repeat_interval():
    s, t = step(AlertState(LABELS), "warn")
    assert should_notify(s, t, T0, send_resolved=True, silences=[], others=[]) == "firing"
    s = replace(s, last_notified_at=T0)
    s, t = step(s, "warn", at=1)  # still firing an hour later: no repeat
    assert should_notify(s, t, T0 + timedelta(hours=1), send_resolved=True, silences=[], others=[]) is None
    s, t = step(s, "warn", at=4)  # four hours after the last notification: repeat
    assert should_notify(s, t, T0 + timedelta(hours=4), send_resolved=True, silences=[], others=[]) == "firing"


def test_silence_mutes_only_matching_alerts_within_its_window():
    s, t = step(AlertState(LABELS), "warn")
    silence = SilenceRule(({"name": "config", "value": "int.*", "isRegex": "true"}, {"name": "metric", "value": "ppl_ratio"}),
                          T0 - timedelta(minutes=1), T0 + timedelta(hours=1))
    assert silence.mutes(LABELS, T0)
    assert should_notify(s, t, T0, send_resolved=True, silences=[silence], others=[]) is None
    assert not silence.mutes(LABELS, T0 + timedelta(hours=1))  # expired
    assert not silence.mutes({**LABELS, "metric": "ttft_ms"}, T0)
    assert should_notify(s, t, T0 + timedelta(hours=2), send_resolved=True, silences=[silence], others=[]) == "firing"


def test_critical_inhibits_warn_with_the_same_labels():
    warn, tw = step(AlertState(LABELS), "critical")
    crit, _ = step(AlertState({**LABELS, "severity": "critical"}), "critical")
    assert warn.state == crit.state == "firing"
    assert inhibited(warn, [crit]) and not inhibited(crit, [warn])
    assert should_notify(warn, tw, T0, send_resolved=True, silences=[], others=[crit]) is None
    other_config = replace(crit, labels={**crit.labels, "config": "int2"})
    assert should_notify(warn, tw, T0, send_resolved=True, silences=[], others=[other_config]) == "firing"


def test_fingerprint_and_idempotency_key_are_stable():
    assert fingerprint(LABELS) == fingerprint(dict(reversed(LABELS.items())))
    assert fingerprint(LABELS) != fingerprint({**LABELS, "severity": "critical"})
    s, _ = step(AlertState(LABELS), "warn")
    k = idempotency_key(1, s, "firing", T0)
    assert k == idempotency_key(1, s, "firing", T0 + timedelta(minutes=5))  # same run re-evaluated
    assert k != idempotency_key(2, s, "firing", T0)  # another channel
    assert k != idempotency_key(1, s, "firing", T0 + timedelta(hours=4))  # the repeat after 4 h
    assert k != idempotency_key(1, s, "resolved", T0)
