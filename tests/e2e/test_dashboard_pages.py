"""Every dashboard page under Streamlit's AppTest, against the seeded API over real HTTP:
what each page shows is checked against the API's own figures; empty states and API errors are
shown as messages, never as a stack trace."""

from __future__ import annotations

import pytest
from streamlit.testing.v1 import AppTest

from tests.conftest import ROOT

APP = str(ROOT / "dashboard/app.py")


def page(seeded_api, monkeypatch, name: str, **env) -> AppTest:
    monkeypatch.setenv("CANARY_API_URL", seeded_api["url"])
    monkeypatch.delenv("CANARY_DASHBOARD_WRITE_KEY", raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    at = AppTest.from_file(APP, default_timeout=60).run()
    assert not at.exception, at.exception
    if name != "Overview":
        at.sidebar.radio[0].set_value(name).run()
    assert not at.exception, at.exception
    return at


def frames(at) -> list:
    return [d.value for d in at.dataframe]


def test_overview_shows_every_config_coloured_by_state(seeded_api, monkeypatch):
    import httpx

    at = page(seeded_api, monkeypatch, "Overview")
    assert at.title[0].value == "Inference quality overview"
    df = at.table[0].value  # an HTML table, coloured by verdict
    assert {"fp32 (baseline)", "int8", "int2", "spec-ngram"} <= set(df["config"])
    over = httpx.get(seeded_api["url"] + "/api/v1/projects/dash/overview").json()
    int2 = next(c for c in over["models"]["tiny"] if c["config"] == "int2")
    row = df[df["config"] == "int2"].iloc[0]
    assert row["ppl ratio"] == format(int2["comparisons"]["ppl_ratio"]["estimate"], ".4f")
    assert int2["comparisons"]["ppl_ratio"]["verdict"] == "critical"
    assert at.metric[1].value != "no schedule"  # the daily schedule's next slot


def test_compare_lists_comparisons_with_cis(seeded_api, monkeypatch):
    at = page(seeded_api, monkeypatch, "Compare")
    df = frames(at)[0]
    assert {"ppl_ratio", "ttft_ms", "exact_match", "top1_agreement"} <= set(df["metric"])
    assert all(ci.startswith("[") for ci in df["CI"])
    assert at.subheader[0].value == "Quality lost vs speed and memory gained"


def test_trends_and_its_empty_state(seeded_api, monkeypatch):
    at = page(seeded_api, monkeypatch, "Trends")
    assert not at.info  # ppl_ratio has points
    at.selectbox(key="metric").set_value("judge_win_rate").run()  # no judge in the seeded suite
    assert "No judge_win_rate comparisons yet." in at.info[0].value


def test_alerts_history_and_read_only_silences(seeded_api, monkeypatch):
    at = page(seeded_api, monkeypatch, "Alerts")
    heads = [s.value for s in at.subheader]
    assert any(h.startswith("Firing (") for h in heads) and "Silences" in heads
    assert any("int8" in str(df.to_dict()) for df in frames(at))  # the seeded silence
    assert any("needs a write key" in i.value for i in at.info)


def test_run_detail_worst_samples_first_side_by_side(seeded_api, monkeypatch):
    at = page(seeded_api, monkeypatch, "Run detail")
    at.selectbox(key="run").set_value(min(at.selectbox(key="run").options, key=int)).run()  # the seeded run, not the gate's
    at.selectbox(key="candidate").set_value("int2").run()
    exps = at.expander
    assert exps, "no samples listed"
    deltas = [float(e.label.split("Δ ")[1].split(" ")[0]) for e in exps]
    assert deltas == sorted(deltas, reverse=True) and deltas[0] > 0  # worst regression first
    assert len(exps[0].code) == 2  # baseline and candidate generations side by side


def test_gates_history(seeded_api, monkeypatch):
    at = page(seeded_api, monkeypatch, "Gates")
    df = frames(at)[0]
    assert list(df["candidate"]) == ["int8"] and seeded_api["gate"]["verdict"] in df["verdict"].iloc[0]


@pytest.mark.parametrize("url,needle", [("http://127.0.0.1:9", "is unreachable")])
def test_api_down_is_a_message_not_a_stack_trace(monkeypatch, url, needle):
    monkeypatch.setenv("CANARY_API_URL", url)
    at = AppTest.from_file(APP, default_timeout=30).run()
    assert not at.exception
    assert needle in at.error[0].value


def test_with_keys_required_the_dashboard_reads_with_a_read_only_key(seeded_api, monkeypatch, tmp_path):
    """The production shape: the API requires keys; the dashboard holds a read-only key, which
    reads every page but cannot silence; without a key it says which setting to fix."""
    import subprocess
    import sys

    from tests.conftest import ROOT
    from tests.loopback import canary_serve

    env = {**seeded_api["env"], "CANARY_REQUIRE_API_KEYS": "true"}
    out = subprocess.run([sys.executable, "-m", "app.cli", "keys", "create", "--project", "dash", "--read-only", "--name", "dashboard"],
                         cwd=ROOT, env=env, check=True, capture_output=True, text=True).stdout
    key = out.strip().splitlines()[-1]
    with canary_serve(env, str(tmp_path / "api.log"), "--no-upgrade-db") as base:
        monkeypatch.delenv("CANARY_DASHBOARD_WRITE_KEY", raising=False)
        monkeypatch.setenv("CANARY_API_URL", base)
        monkeypatch.delenv("CANARY_API_KEY", raising=False)
        at = AppTest.from_file(APP, default_timeout=60).run()
        assert not at.exception and "refused the dashboard's key; set CANARY_API_KEY" in at.error[0].value

        monkeypatch.setenv("CANARY_API_KEY", key)
        at = AppTest.from_file(APP, default_timeout=60).run()
        assert not at.exception and not at.error
        assert "int2" in set(at.table[0].value["config"])
        at.sidebar.radio[0].set_value("Alerts").run()
        assert not at.exception and not at.error
        assert any("needs a write key" in i.value for i in at.info)

        # the key is read-only: handed to the dashboard as its write key, a silence is refused
        monkeypatch.setenv("CANARY_DASHBOARD_WRITE_KEY", key)
        from dashboard.client import Api, ApiError

        with pytest.raises(ApiError, match="refused the dashboard's key"):
            Api().post("/projects/dash/silences", {"matchers": [{"name": "config", "value": "int2"}], "duration_minutes": 5,
                                                   "author": "ana", "comment": "x"})
