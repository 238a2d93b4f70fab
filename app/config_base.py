"""What every part of a canary.yaml shares: the rule for names, the bound on counts, strict parsing
(an unknown key or a non-finite number refused), and errors phrased as 'field: what is wrong; how
to fix it'."""

from __future__ import annotations

import re
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, ValidationError

NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,63}$"  # ≤ 64 characters, as stored
NAME_RULE = "1 to 64 letters, digits, '_', '.' or '-', starting with a letter or digit"


def name_problem(name: str) -> str | None:
    """Why `name` cannot name a project (or another stored object), or None. Names reach URLs,
    Prometheus labels and chat messages, so every way in (API, canary.yaml, CLI) checks them."""
    if re.fullmatch(NAME_PATTERN, name):
        return None
    return f"{name!r} is not a valid name: use {NAME_RULE} (pattern {NAME_PATTERN})"
# a reference to a stored name (suite, config, model): bounded like the columns that hold names
NameRef = Annotated[str, Field(min_length=1, max_length=128)]
DB_INT_MAX = 2**31 - 1  # the largest count or id an INTEGER column holds (PostgreSQL)


class ConfigFileError(ValueError):
    """A canary.yaml problem, phrased as 'field: what is wrong; how to fix it'."""


def format_validation_error(err: ValidationError, prefix: str = "") -> str:
    lines = []
    for e in err.errors():
        loc = prefix
        for part in e["loc"]:
            if isinstance(part, int):
                loc += f"[{part}]"
            else:
                loc += f".{part}" if loc else str(part)
        msg = e["msg"].removeprefix("Value error, ")
        lines.append(f"{loc}: {msg}" if loc else msg)  # cross-field checks name their fields themselves
    return "\n".join(lines)


# NaN and ±Infinity (which JSON parsers accept) are never a threshold or a setting; an unknown key is refused
STRICT = ConfigDict(extra="forbid", allow_inf_nan=False)


class Strict(BaseModel):
    model_config = STRICT
