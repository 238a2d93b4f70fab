"""Deliver the notification outbox: at-least-once, one Idempotency-Key per notification.

Each due row is posted to its channel; 2xx (Slack: 200 "ok") marks it sent. 429 and 5xx, and
timeouts or refused connections, are retried with exponential backoff and ±50 % jitter, honouring
Retry-After; any other 4xx is final ("dead", with the receiver's answer) — and a Discord 404
disables the channel (its webhook was deleted). After max_attempts a row is dead too. Sends to one
channel are paced (Slack ≈ 1/s, Teams ≤ 4/s). Nothing is lost while a receiver is down: the row
stays pending with its next attempt time, and the next pass (beat, or the embedded reconciler)
picks it up.

A receiver cannot hold a worker (security round 3, H3 and M1): each POST has a total deadline
(CANARY_NOTIFY_TIMEOUT_SECONDS, connect to last byte, whatever the receiver trickles), at most
REPLY_BYTES of its reply are read, the next attempt counts from the end of this one, and the
tasks that deliver run on their own queue (`notify`), never on the one that aggregates and gates.
Text from the receiver is escaped before it is stored or logged (no forged log lines).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
import os
import random
import re
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from datetime import datetime, timedelta
from email.utils import parsedate_to_datetime
from typing import Any

import httpx
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from app import channels
from app.channels import webhook
from app.models import Channel, Notification, Project, aware, utcnow
from app.secret_names import ENV_REF, SecretNotAllowed, check_secret_name
from app.ssrf import AsyncPinnedTransport, UnsafeURL, check_url

log = logging.getLogger(__name__)
MAX_ATTEMPTS = 8
BACKOFF_S = 2.0
MAX_BACKOFF_S = 600.0
REPLY_BYTES = 4096  # of a receiver's reply read at most: its status and the start of its answer
Transport = Callable[[], httpx.AsyncBaseTransport]


@dataclass(frozen=True)
class Reply:
    status_code: int
    text: str  # at most REPLY_BYTES of the body, decoded leniently
    headers: httpx.Headers


def printable(text: str) -> str:
    """Remote text as one line: control characters (a newline that would start a forged log line)
    escaped."""
    return re.sub(r"[\x00-\x1f\x7f]", lambda m: m.group().encode("unicode_escape").decode(), text)


async def _post(url: str, body: bytes, headers: dict[str, str], deadline_s: float, transport: Transport) -> Reply:
    # identity: the reply's bytes are what is read, never a compressed body expanded
    async with httpx.AsyncClient(timeout=httpx.Timeout(deadline_s), follow_redirects=False,
                                 transport=transport()) as client:
        async with client.stream("POST", url, content=body,
                                 headers={**headers, "Accept-Encoding": "identity"}) as r:
            got = bytearray()
            async for chunk in r.aiter_raw():
                got += chunk
                if len(got) >= REPLY_BYTES:
                    break
            return Reply(r.status_code, bytes(got[:REPLY_BYTES]).decode("utf-8", "replace"), r.headers)


def _run(coro: Coroutine[Any, Any, Reply]) -> Reply:
    """The coroutine to its end on a loop of its own (a thread of its own where this thread already
    runs one)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coro).result()


def send(url: str, body: bytes, headers: dict[str, str], deadline_s: float, transport: Transport) -> Reply:
    """One POST, connect to last byte read within deadline_s (TimeoutError past it), whatever the
    receiver trickles; at most REPLY_BYTES of the reply read."""
    return _run(asyncio.wait_for(_post(url, body, headers, deadline_s, transport), deadline_s))


class ChannelConfigError(ValueError):
    pass


def resolve(value: str, channel: str, field: str, project: str | None = None) -> str:
    """A literal, or ${ENV_VAR} read at send time (the secret stays out of the database) — only
    from a variable on the operator's secret allow-list (SecretNotAllowed otherwise, also for
    rows stored before the allow-list existed)."""
    m = ENV_REF.fullmatch(value or "")
    if not m:
        return value
    got = os.environ.get(check_secret_name(m.group(1), f"channel '{channel}': {field}", project))
    if not got:
        raise ChannelConfigError(f"channel '{channel}': {field} refers to ${{{m.group(1)}}}, which is not set in the "
                                 "worker's environment")
    return got


def retry_after_s(r: Reply) -> float | None:
    v = r.headers.get("Retry-After")
    if v is None:
        return None
    try:
        return max(0.0, float(v))
    except ValueError:
        try:
            return max(0.0, parsedate_to_datetime(v).timestamp() - time.time())
        except (TypeError, ValueError):
            return None


def post(channel: Channel, n: Notification, project: str | None = None, deadline_s: float = 15.0,
         transport: Transport | None = None) -> tuple[str, float | None, str]:
    """One attempt: ("sent" | "retry" | "dead" | "disable", retry-after seconds, what happened).
    `project`: the channel's project, whose secrets its ${VAR}s may name; `transport`: the
    client's (by default one that checks the URL again and connects to the address it checked)."""
    mod = channels.module(channel.kind)
    try:
        url = resolve(channel.url, channel.name, "url", project)
        secret = resolve((channel.settings or {}).get("signing_secret", ""), channel.name, "signing_secret", project)
    except ChannelConfigError as e:
        return "retry", None, str(e)  # an operator can set the variable; the row waits
    except SecretNotAllowed as e:
        return "dead", None, f"refused: {e}"
    url = mod.url(url) if hasattr(mod, "url") else url
    try:
        check_url(url, f"channel '{channel.name}' url")
    except UnsafeURL as e:
        return "dead", None, f"refused: {e}"
    body = json.dumps(n.payload, separators=(",", ":")).encode()
    headers = {"Content-Type": "application/json", "Idempotency-Key": n.idempotency_key}
    if channel.kind == "webhook" and secret:
        headers[webhook.SIGNATURE_HEADER] = webhook.signature(secret, body)
    try:
        r = send(url, body, headers, deadline_s, transport or (lambda: AsyncPinnedTransport("channel url")))
    except UnsafeURL as e:  # the pinned transport's own check, at connect time
        return "dead", None, f"refused: {e}"
    except (httpx.TimeoutException, TimeoutError):
        return "retry", None, f"timed out (no whole answer within {deadline_s:g} s)"
    except httpx.HTTPError as e:
        return "retry", None, f"unreachable ({type(e).__name__})"
    if mod.succeeded(r.status_code, r.text):
        return "sent", None, f"HTTP {r.status_code}"
    what = f"HTTP {r.status_code}: {printable(r.text[:200])}"
    if r.status_code == 429 or r.status_code >= 500:
        return "retry", retry_after_s(r), what
    if r.status_code in getattr(mod, "DISABLE_ON", ()):
        return "disable", None, what
    return "dead", None, what


def backoff_s(attempts: int) -> float:
    return min(MAX_BACKOFF_S, BACKOFF_S * 2 ** (attempts - 1)) * random.uniform(0.5, 1.5)


SLOW_FRACTION = 0.5  # a post that takes this share of its deadline or more marks its receiver slow


def deliver_due(session: Session, *, now: datetime | None = None, transport: Transport | None = None,
                deadline_s: float | None = None, sleep: Callable[[float], None] = time.sleep,
                max_attempts: int = MAX_ATTEMPTS, limit: int = 500) -> dict[str, int]:
    """Post every due pending notification once; returns counts by outcome. `now`: the clock at
    the start of the pass (each retry is scheduled from the end of its attempt, on that clock).

    Fair to every tenant (security round 4, N3): the pass goes in rounds, each project and each
    channel posting at most once a round, oldest row first, so one project's backlog or one
    channel's many rows never queue another project's alert behind them. Each channel has a
    circuit breaker (`strike`): a receiver that fails (a retry: timeout, refused, 429, 5xx) or
    answers slowly (half the deadline or more) opens it, and the channel posts nothing until
    its cool-down ends, rows created since included; the cool-down doubles with each strike in
    a row. When it ends, one post tries the receiver again: a quick success closes the breaker,
    another strike opens it for longer. A dead or dripping receiver therefore costs one
    deadline per cool-down, fewer and fewer, however many rows it has."""
    from app.settings import get_settings

    now = now or utcnow()
    started = time.monotonic()
    deadline_s = deadline_s or get_settings().notify_timeout_seconds
    assert session.bind is not None, "deliver_due needs a session bound to an engine"
    locking = session.bind.dialect.name == "postgresql"
    seen: set[int] = set()  # rows taken in this pass
    round_projects: set[int] = set()
    round_channels: set[int] = set()

    def next_row() -> Notification | None:
        """The oldest due row of a project and channel that have not posted in this round, on a
        channel whose breaker is closed or has cooled down; a new round when every one has."""
        for new_round in (False, True):
            if new_round:
                if not (round_projects or round_channels):
                    return None
                round_projects.clear()
                round_channels.clear()
            due = (select(Notification).join(Channel, Channel.id == Notification.channel_id)
                   .where(Notification.status == "pending")
                   .where((Notification.next_attempt_at.is_(None)) | (Notification.next_attempt_at <= now))
                   .where((Channel.breaker_until.is_(None)) | (Channel.breaker_until <= now)))
            if seen:
                due = due.where(Notification.id.not_in(seen))
            if round_channels:
                due = due.where(Notification.channel_id.not_in(round_channels))
            if round_projects:
                due = due.where(Channel.project_id.not_in(round_projects))
            due = due.order_by(Notification.id).limit(1)
            if locking:
                # one row per transaction, locked until its outcome commits: a second notifier skips it
                due = due.with_for_update(skip_locked=True, of=Notification)
            found = session.scalars(due).first()
            if found is not None:
                return found
        return None

    counts = {"sent": 0, "retry": 0, "dead": 0}
    last_post: dict[int, float] = {}
    for _ in range(limit):
        notification = next_row()
        if notification is None:
            break
        seen.add(notification.id)
        channel = session.get(Channel, notification.channel_id)
        if channel is None or not channel.enabled:
            notification.status, notification.last_error = "dead", "channel disabled or deleted"
            counts["dead"] += 1
            session.commit()
            continue
        round_projects.add(channel.project_id)
        round_channels.add(channel.id)
        pace = 1.0 / channels.module(channel.kind).PACE_PER_SECOND
        wait = last_post.get(channel.id, -1e9) + pace - time.monotonic()
        if wait > 0:
            sleep(wait)
        owner = session.get(Project, channel.project_id)
        began = time.monotonic()
        outcome, retry_after, what = post(channel, notification, owner.name if owner else "", deadline_s, transport)
        last_post[channel.id] = time.monotonic()
        # the end of this attempt on the pass's clock: a slow receiver's cool-down starts from there
        ended = now + timedelta(seconds=last_post[channel.id] - started)
        slow = last_post[channel.id] - began >= SLOW_FRACTION * deadline_s
        notification.attempts += 1
        notification.last_error = None if outcome == "sent" else what
        if outcome == "sent":
            notification.status, notification.sent_at = "sent", utcnow()
            counts["sent"] += 1
            answered(channel, ended, slow)
        elif outcome == "retry":
            cooled = strike(channel, ended, retry_after, attempts=notification.attempts, what=what)
            if notification.attempts < max_attempts:
                notification.next_attempt_at = cooled
                counts["retry"] += 1
            else:
                notification.status = "dead"
                notification.last_error = f"gave up after {notification.attempts} attempts: {what}"
                counts["dead"] += 1
                log.warning("notification %s to channel '%s' is dead: %s", notification.id, channel.name,
                            notification.last_error)
        else:
            answered(channel, ended, slow)  # a final answer (4xx, refused by policy): the receiver is there
            if outcome == "disable":
                channel.enabled = False
                what = f"{what}; channel '{channel.name}' disabled (its webhook is gone)"
            notification.status, notification.last_error = "dead", what
            counts["dead"] += 1
            log.warning("notification %s to channel '%s' is dead: %s", notification.id, channel.name,
                        notification.last_error)
        session.commit()  # each outcome is durable before the next post
    return counts


def answered(channel: Channel, ended: datetime, slow: bool) -> None:
    """The receiver answered (a success or a final 4xx): a quick answer closes the breaker; a slow
    one rests the channel one strike's cool-down, not a count that grows while it keeps answering."""
    channel.breaker_strikes, channel.breaker_until = 0, None
    if slow:
        strike(channel, ended, None, what="answered slowly")


def strike(channel: Channel, ended: datetime, retry_after: float | None, *, attempts: int = 0,
           what: str) -> datetime:
    """Open the channel's breaker after a failed or slow answer that ended at `ended`; returns when
    it may post again. The cool-down is the receiver's Retry-After when it gave one, else the
    backoff of the strikes in a row (or of the row's own attempts, when more): 2 s, 4 s, 8 s, ...
    up to 10 minutes, each ±50 %."""
    channel.breaker_strikes += 1
    delay_s = retry_after if retry_after is not None else backoff_s(max(channel.breaker_strikes, attempts))
    channel.breaker_until = ended + timedelta(seconds=delay_s)
    log.info("channel '%s' %s: its breaker opens for %.0f s (strike %d in a row)", channel.name, printable(what),
             delay_s, channel.breaker_strikes)
    return channel.breaker_until


def next_due(session: Session) -> datetime | None:
    """When the earliest pending notification is due: its own retry time, or its channel's
    cool-down when that ends later. A row never tried yet (a crash between its commit and the
    first send) has no next attempt time and is due now, unless its channel is cooling down."""
    now = utcnow()
    pending = (select(Notification.next_attempt_at).join(Channel, Channel.id == Notification.channel_id)
               .where(Notification.status == "pending"))
    closed = pending.where(Channel.breaker_until.is_(None) | (Channel.breaker_until <= now))
    due: list[datetime] = []
    if session.scalar(closed.where(Notification.next_attempt_at.is_(None)).limit(1).exists().select()):
        due.append(now)
    first = aware(session.scalar(closed.where(Notification.next_attempt_at.is_not(None))
                                 .order_by(Notification.next_attempt_at).limit(1)))
    if first is not None:
        due.append(first)
    cooling = aware(session.scalar(select(func.min(Channel.breaker_until)).where(
        Channel.breaker_until > now, Channel.id.in_(select(Notification.channel_id)
                                                    .where(Notification.status == "pending")))))
    if cooling is not None:
        due.append(cooling)
    return min(due, default=None)
