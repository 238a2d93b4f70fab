"""A scripted OpenAI-compatible judge on loopback (real HTTP, deterministic verdicts). Each
POST /v1/chat/completions first takes the next scripted action, if any:
  {"status": 429, "retry_after": "1"} | {"status": 500} | {"status": 400} | {"sleep": 2.0} |
  {"content": "raw reply text", "top_logprobs": [[token, logprob], ...]}
otherwise it judges by rule: an answer containing RIGHT beats one without; rubric 5 with RIGHT,
else 2; statements are the answer's sentences; a statement is supported when all its words occur
in the context. `bias_a` makes it always prefer answer A (position bias)."""

from __future__ import annotations

import asyncio
import re
import time

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse


def _section(prompt: str, head: str, *stops: str) -> str:
    start = prompt.index(head) + len(head)
    ends = [prompt.find(s, start) for s in stops]
    end = min([e for e in ends if e != -1] or [len(prompt)])
    return prompt[start:end].strip()


class ScriptedJudge:
    def __init__(self):
        self.script: list[dict] = []
        self.requests: list[tuple[float, dict]] = []
        self.bias_a = False
        self.app = FastAPI()
        self.app.post("/v1/chat/completions")(self.chat)

    def rule(self, prompt: str) -> tuple[str, list | None]:
        if "Answer A:" in prompt:
            a = _section(prompt, "Answer A:", "Answer B:")
            b = _section(prompt, "Answer B:", "Reply with")
            if self.bias_a:
                w = "A"
            else:
                w = "A" if ("RIGHT" in a and "RIGHT" not in b) else "B" if ("RIGHT" in b and "RIGHT" not in a) else "tie"
            return f'{{"winner": "{w}", "reason": "rule"}}', None
        if "1-5 scale" in prompt:
            s = 5 if "RIGHT" in _section(prompt, "Answer:", "Reply with") else 2
            return f'{{"score": {s}, "reason": "rule"}}', None  # no log-probs unless scripted
        if "Break the answer" in prompt:
            ans = _section(prompt, "Answer:", "Reply with")
            sts = [x.strip() for x in re.split(r"(?<=[.!?])\s+", ans) if x.strip()]
            import json

            return json.dumps({"statements": sts}), None
        if "For each statement" in prompt:
            import json

            ctx = set(re.findall(r"\w+", _section(prompt, "Context:", "For each statement").lower()))
            sts = re.findall(r"^\d+\. (.*)$", prompt, flags=re.M)
            return json.dumps({"verdicts": [{"statement": s, "supported": set(re.findall(r"\w+", s.lower())) <= ctx} for s in sts]}), None
        return "I cannot judge this.", None

    async def chat(self, request: Request):
        body = await request.json()
        self.requests.append((time.monotonic(), body))
        action = self.script.pop(0) if self.script else {}
        if "sleep" in action:
            await asyncio.sleep(action["sleep"])
            action = {}
        if "status" in action:
            headers = {"Retry-After": action["retry_after"]} if "retry_after" in action else {}
            return JSONResponse({"error": {"message": f"scripted {action['status']}"}}, status_code=action["status"], headers=headers)
        prompt = body["messages"][-1]["content"]
        if "content" in action:
            text, top = action["content"], action.get("top_logprobs")
            top = [[tuple(t) for t in top]] if top else None
        else:
            text, top = self.rule(prompt)
        logprobs = None
        if body.get("logprobs") and top:
            logprobs = {"content": [{"token": alts[0][0], "logprob": alts[0][1],
                                     "top_logprobs": [{"token": t, "logprob": lp} for t, lp in alts]} for alts in top]}
        return {"id": "x", "object": "chat.completion", "model": body["model"],
                "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": logprobs, "finish_reason": "stop"}],
                "usage": {"prompt_tokens": len(prompt.split()), "completion_tokens": len(text.split()), "total_tokens": 0}}
