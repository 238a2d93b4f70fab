"""A generation or echo job as the engine thread holds it (ServeRequest: queued, then running in
a row of the batch as Running), and the refusals a route turns into its status: ServeQueueFull
(429), ShuttingDown (503), Cancelled (the client left a one-at-a-time generation)."""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass, field

from engines.protocol import GenerationRequest
from engines.reference.batching import Sequence

SHUTTING_DOWN = "the server is shutting down"


class ServeQueueFull(Exception):
    """The waiting queue cannot take a request's sequences within max_queue: the route answers 429."""


class ShuttingDown(Exception):
    """The server is draining (SIGTERM): it takes no new request, the route answers 503."""


class Cancelled(Exception):
    """Raised from the streaming hook of a one-at-a-time generation whose client left: it stops there."""


@dataclass(eq=False)  # a job is itself: `in` and remove() on the queue compare identity
class ServeRequest:
    request: GenerationRequest
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue
    arrived: float
    prompt_ids: list[int] | None = None  # echo: score these instead of generating
    top_k: int = 0  # echo: alternatives per position (OpenAI's logprobs)
    stamps: list[float] = field(default_factory=list)
    stream: bool = True  # its route reads ("tokens", ids) events; else only the outcome is sent
    # set from the route's event loop when nobody reads the job any more; the engine thread retires it
    cancelled: threading.Event = field(default_factory=threading.Event)
    stop_reason: str = "abort"  # how a cancelled job counts in vllm:request_success
    started: float | None = None  # when the engine took it from the queue (scheduled, in vLLM's words)
    group: int = 0  # the request it came in: its prompts × n choices share one

    def cancel(self, reason: str = "abort") -> None:
        if not self.cancelled.is_set():
            self.stop_reason = reason
            self.cancelled.set()


@dataclass
class Running:
    """A job in a row of the batch."""

    job: ServeRequest
    seq: Sequence
    started: float  # when the engine took it from the queue
    sent: int = 0  # tokens emitted so far
