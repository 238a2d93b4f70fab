"""The dashboard's only way to the data: the HTTP API, with a read-only key (a write key only
for silences). Every failure becomes an ApiError whose message a person can act on."""

from __future__ import annotations

import os
import time
from typing import Any

import httpx


class ApiError(Exception):
    pass


class Api:
    def __init__(self, base_url: str | None = None, key: str | None = None, write_key: str | None = None,
                 timeout: float = 10.0):
        self.base_url = (base_url or os.environ.get("CANARY_API_URL", "http://127.0.0.1:8000")).rstrip("/")
        self.key = key if key is not None else os.environ.get("CANARY_API_KEY")
        self.write_key = write_key if write_key is not None else os.environ.get("CANARY_DASHBOARD_WRITE_KEY")
        self.timeout = timeout
        self.last_ms = 0.0

    @property
    def can_write(self) -> bool:
        return bool(self.write_key)

    def _call(self, method: str, path: str, write: bool = False, **kw: Any) -> Any:  # the answer's JSON
        key = self.write_key if write else self.key
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        url = f"{self.base_url}/api/v1{path}"
        t0 = time.perf_counter()
        try:
            response = httpx.request(method, url, headers=headers, timeout=self.timeout, **kw)
        except httpx.TimeoutException:
            raise ApiError(f"The API did not answer within {self.timeout:.0f} s ({path}); it may be busy — reload in "
                           "a moment.") from None
        except httpx.HTTPError as e:
            raise ApiError(f"The API at {self.base_url} is unreachable ({type(e).__name__}); check "
                           "CANARY_API_URL.") from None
        finally:
            self.last_ms = (time.perf_counter() - t0) * 1000
        if response.status_code in (401, 403):
            raise ApiError("The API refused the dashboard's key; set CANARY_API_KEY to a valid read-only key.")
        if response.status_code >= 400:
            try:
                detail = response.json().get("detail")
            except ValueError:
                detail = response.text[:200]
            if isinstance(detail, list):  # FastAPI's validation errors: the field's path (after body/query) and why
                detail = "; ".join(f"{'.'.join(str(part) for part in error.get('loc', [])[1:])}: {error.get('msg')}"
                                   for error in detail)
            raise ApiError(f"{detail} (HTTP {response.status_code})")
        return response.json()

    def get(self, path: str, **params: str | int | float | None) -> Any:
        return self._call("GET", path, params={name: value for name, value in params.items() if value is not None})

    def post(self, path: str, body: dict) -> Any:
        return self._call("POST", path, write=True, json=body)

    def delete(self, path: str) -> Any:
        return self._call("DELETE", path, write=True)
