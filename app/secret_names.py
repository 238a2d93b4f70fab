"""Secrets named by configuration — `api_key_env` of engines and judges, a channel's `${VAR}` —
come only from the operator's allow-list of variable names (CANARY_SECRET_ENV_PREFIX, default
CANARY_SECRET_, and CANARY_SECRET_ENV_NAMES): otherwise a tenant could name the worker's database
URL and have it sent as a Bearer token (`check_secret_name`, `read_secret`). Each secret belongs
to projects: a project names its own variables (CANARY_SECRET_<SLUG>__…, one owner per name:
`secret_slug`) or those the operator grants it (CANARY_SECRET_GRANTS), checked when a row is
created and again when it is used, against the project that owns the row; otherwise one team
could send another's key to a server it controls.
"""

from __future__ import annotations

import os
import re

ENV_REF = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")  # ${VAR}: a secret read from the environment at send time


class SecretNotAllowed(ValueError):
    pass


def _secret_policy() -> tuple[str, set[str], set[str]]:
    from app.settings import Settings, get_settings

    settings = get_settings()
    # the service's own settings are never a tenant's secret
    own = {f"CANARY_{name.upper()}" for name in Settings.model_fields}
    names = {name.strip() for name in (settings.secret_env_names or "").split(",") if name.strip()}
    return settings.secret_env_prefix or "", names, own


def secret_grants() -> dict[str, set[str]]:
    """The operator's grants (CANARY_SECRET_GRANTS): {variable: projects that may name it}, '*'
    for every project. Written `NAME=alpha+beta,OTHER=*`."""
    from app.settings import get_settings

    grants: dict[str, set[str]] = {}
    for entry in (get_settings().secret_grants or "").split(","):
        name, _, projects = entry.partition("=")
        if name.strip():
            grants.setdefault(name.strip(), set()).update(p.strip() for p in projects.split("+") if p.strip())
    return grants


def secret_slug(project: str) -> str:
    """A project's own part of its secret names: its name in capitals, each run of characters
    other than a letter or digit as one '_', none at either end ('ml-infra', 'ML.Infra' and
    'ml__infra' all read ML_INFRA). No two projects may share one (get_or_create_project refuses
    the second), and a slug never holds '__', so no project's prefix begins another's."""
    return re.sub(r"[^A-Z0-9]+", "_", project.upper()).strip("_")


def project_secret_prefix(project: str) -> str:
    """The variables a project owns: the secret prefix, its slug (secret_slug), then '__' —
    CANARY_SECRET_ALPHA__ENGINE_KEY for 'alpha'. The owner of a name is the text between the
    prefix and its first '__', exactly: CANARY_SECRET_ALPHA__X__KEY is alpha's, never 'alpha--x''s
    (whose slug is ALPHA_X)."""
    prefix, _, _ = _secret_policy()
    return f"{prefix}{secret_slug(project)}__"


def _in_space(name: str) -> bool:
    """The name is one configuration may name at all: the prefix, listed, or granted; never one of
    the service's own settings."""
    prefix, names, own = _secret_policy()
    if name in own:
        return False
    return (name in names or name in secret_grants()
            or bool(prefix and name.startswith(prefix) and len(name) > len(prefix)))


def secret_allowed(name: str, project: str | None = None) -> bool:
    """Whether a configuration may name the variable; with `project`, whether that project may:
    a variable under its own prefix (project_secret_prefix), one granted to it (or to '*') in
    CANARY_SECRET_GRANTS, or one listed in CANARY_SECRET_ENV_NAMES (shared by every project).
    With CANARY_SECRET_SCOPE=shared (one team), any prefixed name serves every project."""
    from app.settings import get_settings

    if not _in_space(name):
        return False
    if project is None:  # the form only: the project's check follows where the row's project is known
        return True
    granted = secret_grants().get(name)
    if granted is not None:
        return "*" in granted or project in granted
    _, names, _ = _secret_policy()
    if name in names or get_settings().secret_scope == "shared":
        return True
    own = project_secret_prefix(project)
    return name.startswith(own) and len(name) > len(own)


def check_secret_name(name: str, field: str, project: str | None = None) -> str:
    """The name unchanged, or SecretNotAllowed naming the field and how to fix it."""
    if not _in_space(name):
        prefix, _, _ = _secret_policy()
        how = (f"name a variable that starts with {prefix} (e.g. {prefix}{name.removeprefix(prefix) or 'KEY'})"
               if prefix else "name a listed variable")
        raise SecretNotAllowed(f"{field}: '{name}' is not an allowed secret variable; secrets are read only from "
                               f"variables the operator allows: {how}, or have the operator add '{name}' to "
                               "CANARY_SECRET_ENV_NAMES")
    if project is not None and not secret_allowed(name, project):
        prefix, _, _ = _secret_policy()
        own = project_secret_prefix(project)
        rest = name.removeprefix(prefix).split("__", 1)[-1] or "KEY"  # without another project's part
        raise SecretNotAllowed(f"{field}: '{name}' is not a secret of project '{project}'; a project names only its "
                               f"own variables, {own}… (e.g. {own}{rest}), or those the operator grants it: "
                               f"CANARY_SECRET_GRANTS={name}={project}")
    return name


def check_secret_ref(value: str | None, field: str, project: str | None = None) -> str | None:
    """A ${VAR} reference names an allowed variable (a literal passes unchanged)."""
    m = ENV_REF.fullmatch(value or "")
    if m:
        check_secret_name(m.group(1), field, project)
    return value


def read_secret(name: str, field: str, project: str | None = None) -> str | None:
    """The value of an allowed secret variable (None when unset); SecretNotAllowed otherwise — the
    check at use time, for rows stored before the allow-list existed or written behind the API's
    back, against the project that owns the row."""
    return os.environ.get(check_secret_name(name, field, project))
