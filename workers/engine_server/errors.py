"""vLLM's error shape (OpenAI's, with the HTTP status as `code`), for every refusal of the server."""

from __future__ import annotations

from fastapi.responses import JSONResponse


def error(status: int, message: str, kind: str = "BadRequestError", param: str | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": status}},
                        status_code=status)


def param_of(loc: tuple | list) -> str | None:
    """The request field a validation error is about: 'messages[0].content', 'temperature'."""
    out = ""
    for part in loc[1:] if loc and loc[0] == "body" else loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part == "str" or "[" in str(part) or "-" in str(part):
            continue  # pydantic's union-branch labels ('str', 'constrained-str', 'list[int]') are not fields
        else:
            out += f".{part}" if out else str(part)
    return out or None
