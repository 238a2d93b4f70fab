"""A webhook receiver on loopback whose answers are scripted: each POST takes the next action
({"status": 429, "retry_after": "7"} | {"status": 500} | {"status": 400} | {"status": 404} |
{"sleep": 2.0}) or answers 200 "ok"; every request is recorded (time, headers, body)."""

from __future__ import annotations

import asyncio
import time

from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse


class Receiver:
    def __init__(self):
        self.script: list[dict] = []
        self.requests: list[dict] = []
        self.app = FastAPI()
        self.app.post("/{path:path}")(self.handle)

    async def handle(self, request: Request, path: str):
        body = await request.body()
        action = self.script.pop(0) if self.script else {}
        self.requests.append({"t": time.monotonic(), "path": "/" + path, "query": str(request.url.query),
                              "headers": dict(request.headers), "body": body, "answered": action.get("status", 200)})
        if "sleep" in action:
            await asyncio.sleep(action["sleep"])
            self.requests[-1]["answered"] = "late"
            return PlainTextResponse("ok")
        if "status" in action:
            headers = {"Retry-After": action["retry_after"]} if "retry_after" in action else {}
            return PlainTextResponse(f"scripted {action['status']}", status_code=action["status"], headers=headers)
        return PlainTextResponse("ok")

    def delivered(self) -> list[dict]:
        return [r for r in self.requests if r["answered"] == 200]
