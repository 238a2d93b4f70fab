"""A webhook receiver on loopback whose answers are scripted: each POST takes the next action
({"status": 429, "retry_after": "7"} | {"status": 500} | {"status": 400} | {"status": 404} |
{"sleep": 2.0} | {"drip": 0.5} (headers at once, then one byte of body every 0.5 s, for ever) |
{"status": 500, "bytes": 400_000_000} (a huge body, streamed) or answers 200 "ok"; every request
is recorded (time, headers, body); `sent` counts the body bytes the streamed answers got out."""

from __future__ import annotations

import asyncio
import time

from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse, StreamingResponse


class Receiver:
    def __init__(self):
        self.script: list[dict] = []
        self.requests: list[dict] = []
        self.sent = 0
        self.app = FastAPI()
        self.app.post("/{path:path}")(self.handle)

    async def handle(self, request: Request, path: str):
        body = await request.body()
        action = self.script.pop(0) if self.script else {}
        self.requests.append({"t": time.monotonic(), "path": "/" + path, "query": str(request.url.query),
                              "headers": dict(request.headers), "body": body, "answered": action.get("status", 200)})
        if "drip" in action:
            async def drip():
                while True:
                    yield b"."
                    self.sent += 1
                    await asyncio.sleep(action["drip"])
            return StreamingResponse(drip(), status_code=200, media_type="text/plain")
        if "bytes" in action:
            async def huge(n=action["bytes"]):
                block = b"x" * 65536
                while n > 0:
                    yield block[:n]
                    self.sent += min(n, len(block))
                    n -= len(block)
            return StreamingResponse(huge(), status_code=action.get("status", 200), media_type="text/plain")
        if "sleep" in action:
            await asyncio.sleep(action["sleep"])
            self.requests[-1]["answered"] = "late"
            return PlainTextResponse("ok")
        if "status" in action:
            headers = {"Retry-After": action["retry_after"]} if "retry_after" in action else {}
            return PlainTextResponse(action.get("text", f"scripted {action['status']}"), status_code=action["status"],
                                     headers=headers)
        return PlainTextResponse("ok")

    def delivered(self) -> list[dict]:
        return [r for r in self.requests if r["answered"] == 200]
