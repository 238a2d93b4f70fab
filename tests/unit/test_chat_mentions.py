"""A project name can never ping a chat channel: `canary keys create` checks it against
NAME_PATTERN like the API and canary.yaml do, and the Slack and Teams payloads escape `&`, `<`
and `>` in whatever an alert quotes (`<!here>` is a Slack mention)."""

from __future__ import annotations

import json
from datetime import UTC, datetime

import pytest
from app import repo
from app.channels import AlertMessage, build

from tests.unit.test_cli_pipe import canary


def test_keys_create_refuses_a_project_name_outside_the_pattern(tmp_path):
    db = f"sqlite:///{tmp_path / 'k.db'}"
    r = canary("keys", "create", "--project", "<!here>", cwd=tmp_path, db=db, timeout=120)
    assert r.returncode == 2 and r.stdout == "", (r.stdout, r.stderr)
    [line] = r.stderr.strip().splitlines()
    assert "--project '<!here>'" in line and "[A-Za-z0-9]" in line, line
    ok = canary("keys", "create", "--project", "team-a.prod", cwd=tmp_path, db=db, timeout=120)
    assert ok.returncode == 0 and ok.stdout.startswith("cnry_"), ok.stderr


def test_get_or_create_project_checks_the_name(sqlite_env):
    from app.db import session_scope

    with session_scope() as s, pytest.raises(ValueError, match="not a valid name"):
        repo.get_or_create_project(s, "<!channel>")
    with session_scope() as s:
        assert repo.get_or_create_project(s, "ok_1").name == "ok_1"


def alert(**labels: str) -> AlertMessage:
    return AlertMessage("firing", {"project": "p", "model": "m", "config": "int2", "metric": "ppl_ratio",
                                   "severity": "critical", **labels}, "fp1", 1.06, 1.05, 1.07, 12, "fp32", 1.0, 1.06,
                        "remote <!channel> & <@U123>", 3, "http://dash", datetime(2026, 1, 1, tzinfo=UTC))


def test_slack_text_and_mrkdwn_escape_mentions():
    p = build("slack", alert(project="<!here>", model="<!everyone>"))
    assert "(&lt;!here&gt;)" in p["text"] and "&lt;!everyone&gt;" in p["text"]
    assert "remote &lt;!channel&gt; &amp; &lt;@U123&gt;" in p["text"]
    mrkdwn = p["blocks"][1]["text"]
    assert mrkdwn["type"] == "mrkdwn" and "&lt;!channel&gt;" in mrkdwn["text"]
    parsed = [p["text"], mrkdwn["text"]]  # the fields Slack parses for mentions
    assert not any(c in field for field in parsed for c in "<>"), parsed


def test_teams_text_escapes_mentions():
    p = build("teams", alert(project="<!here>"))
    blocks = p["attachments"][0]["content"]["body"]
    text = json.dumps([b["text"] for b in blocks])
    assert "&lt;!here&gt;" in text and "&lt;!channel&gt; &amp;" in text and "<" not in text


def test_every_list_of_channel_kinds_is_the_registrys():
    # app/channels.KINDS is the one list: the config file's field accepts exactly those, and each
    # has its module with a payload, a success test and a pace
    from typing import get_args

    from app import channels
    from app.config_file import ChannelEntry

    assert get_args(ChannelEntry.model_fields["kind"].annotation) == channels.KINDS
    for kind in channels.KINDS:
        mod = channels.module(kind)
        assert callable(mod.payload) and callable(mod.succeeded) and mod.PACE_PER_SECOND > 0
    with pytest.raises(KeyError, match="one of slack, teams"):
        channels.module("pager")
