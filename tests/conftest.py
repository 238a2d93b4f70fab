"""Shared test helpers. Service URLs come from the environment with this machine's defaults;
outside CI a missing service skips loudly, under CI=true it fails."""

from __future__ import annotations

import os
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent


def service_unavailable(what: str, url: str, err: Exception) -> None:
    msg = f"{what} at {url} is unreachable ({err}); start it or set the URL in the environment"
    if os.environ.get("CI"):
        pytest.fail(f"CI=true: {msg}", pytrace=False)
    pytest.skip(f"SKIPPED LOUDLY: {msg}")


@pytest.fixture
def sqlite_env(tmp_path, monkeypatch):
    """A fresh embedded-default database (SQLite file, inline tasks), migrated."""
    from app.db import upgrade
    from app.settings import get_settings

    url = f"sqlite:///{tmp_path / 'canary.db'}"
    monkeypatch.setenv("CANARY_DATABASE_URL", url)
    monkeypatch.setenv("CANARY_EXECUTION", "inline")
    # a firing alert would start a full-suite run (526 documents) inside the test: only the
    # escalation tests turn it back on
    monkeypatch.setenv("CANARY_ESCALATION", "false")
    monkeypatch.setenv("CANARY_URL_ALLOWLIST", "127.0.0.1,localhost")  # the loopback receivers and judges of the tests
    monkeypatch.delenv("CANARY_BROKER_URL", raising=False)
    get_settings.cache_clear()
    upgrade(url)
    yield url
    get_settings.cache_clear()
