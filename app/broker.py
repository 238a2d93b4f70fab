"""What the broker still holds: the config-runs whose execute message waits in a queue or sits
with a worker unacknowledged. The reconciler (workers/tasks.py) re-sends only the config-runs
that are in neither place, so a backlog is never taken for lost messages and never doubled.

Read from kombu's Redis transport as it stores messages: one list per queue and priority step
(`gpu`, then `gpu` + "\\x06\\x16" + step for steps above 0), each item a JSON envelope whose body
is the task's JSON [args, kwargs, embed] (base64 when the envelope says so), and the `unacked`
hash of messages delivered to a worker and not yet acknowledged (each [envelope, exchange,
routing key]). Another broker (RabbitMQ cannot be read without taking its messages) answers None:
unknown, and the reconciler then re-sends by age alone, as before.
"""

from __future__ import annotations

import base64
import json
import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from app.dispatch import PRIORITY_STEPS, TASK_QUEUES

if TYPE_CHECKING:
    import redis

log = logging.getLogger(__name__)
PRIORITY_SEP = "\x06\x16"  # kombu.transport.redis.Channel.sep
UNACKED = "unacked"  # kombu.transport.redis.Channel.unacked_key
BATCH = 1000  # list items read per round trip


def queue_keys(queue: str) -> list[str]:
    """The Redis lists of one queue: one per priority step, step 0 under the queue's own name."""
    return [queue if step == 0 else f"{queue}{PRIORITY_SEP}{step}" for step in PRIORITY_STEPS]


def _first_arg(envelope: dict, task: str) -> int | None:
    """The first argument of a message for `task` (a config-run id), else None."""
    if (envelope.get("headers") or {}).get("task") != task:
        return None
    body = envelope.get("body")
    if (envelope.get("properties") or {}).get("body_encoding") == "base64" and isinstance(body, str):
        body = base64.b64decode(body)
    if not isinstance(body, str | bytes):
        return None
    try:
        args = json.loads(body)[0]
        return int(args[0])
    except (TypeError, ValueError, IndexError, KeyError):
        return None


def _waiting(client: redis.Redis, queue: str) -> Iterable[dict]:
    for key in queue_keys(queue):
        start = 0
        while True:
            items = client.lrange(key, start, start + BATCH - 1)
            for item in items:
                try:
                    yield json.loads(item)
                except ValueError:
                    continue
            if len(items) < BATCH:
                break
            start += BATCH


def _unacked(client: redis.Redis) -> Iterable[dict]:
    for item in client.hvals(UNACKED):
        try:
            envelope = json.loads(item)[0]
        except (ValueError, IndexError, KeyError):
            continue
        if isinstance(envelope, dict):
            yield envelope


@dataclass(frozen=True)
class Held:
    """The first arguments of a task's messages: waiting in a queue, and delivered to a worker
    and not yet acknowledged."""

    waiting: frozenset[int]
    unacked: frozenset[int]

    @property
    def all(self) -> frozenset[int]:
        return self.waiting | self.unacked


def held_args(broker_url: str | None, task: str) -> Held | None:
    """Every `task` message the broker holds, by first argument, or None when that cannot be read
    (no broker, not Redis, Redis unreachable)."""
    if not broker_url or not broker_url.startswith(("redis://", "rediss://")):
        return None
    import redis

    try:
        client = redis.Redis.from_url(broker_url, socket_timeout=10)
        waiting = {arg for envelope in _waiting(client, TASK_QUEUES[task])
                   if (arg := _first_arg(envelope, task)) is not None}
        unacked = {arg for envelope in _unacked(client) if (arg := _first_arg(envelope, task)) is not None}
        return Held(frozenset(waiting), frozenset(unacked))
    except redis.RedisError as e:
        log.warning("could not read the broker's queues (%s); the reconciler re-sends by age alone", type(e).__name__)
        return None
