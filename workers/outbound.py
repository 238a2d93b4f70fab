"""What a worker hands an engine or a judge for talking to the outside: httpx transports that
check every request's URL against the service's outbound policy and connect to the address they
checked (app/ssrf.py), and a secret reader that refuses variables off the operator's allow-list.
The checks run here, at use time, as well as when the config was created: a row stored before the
policy (or written to the database directly) can neither reach a private address nor send the
worker's own environment — its database URL, say — as a key."""

from __future__ import annotations

from typing import Any

from app.secret_names import read_secret
from app.ssrf import AsyncPinnedTransport, PinnedTransport, check_engine_options, check_judge
from engines.spec import OptimizationSpec

ENGINE_URL = "engine_options.base_url / metrics_url"


def check_engine(spec: OptimizationSpec, project: str | None) -> None:
    """UnsafeURL / SecretNotAllowed (ValueErrors naming the field) for an engine the policy refuses,
    its key's name checked against the project that owns the config."""
    if spec.engine == "openai":
        check_engine_options(spec.engine_options, "engine_options", project)


def engine_options(spec: OptimizationSpec) -> dict[str, Any]:
    """Keyword arguments for the engine's constructor (empty for engines that make no requests)."""
    if spec.engine != "openai":
        return {}
    return {"transport": lambda: PinnedTransport(ENGINE_URL),
            "async_transport": lambda: AsyncPinnedTransport(ENGINE_URL),
            # the name's form; check_engine has checked it against the config's project before any load
            "secret": lambda name: read_secret(name, "engine_options.api_key_env")}


def judge_http(settings: dict, project: str | None) -> tuple[str | None, PinnedTransport]:
    """(the judge's API key, the transport its client uses), after the judge passes the policy
    for the project that owns the suite."""
    check_judge(settings, "judge", project)
    key_env = settings.get("api_key_env")
    return ((read_secret(key_env, "judge.api_key_env", project) if key_env else None),
            PinnedTransport("judge.base_url"))
