"""On the broker: a gate's task is delivered before escalation tasks queued earlier. The real
Redis transport of kombu, publishing through the API's dispatcher and reading the `gpu` queue
with the worker's own Celery settings (priority_steps), as a worker's consumer does."""

from __future__ import annotations

import json

from app.dispatch import ESCALATION_PRIORITY, EXECUTE_CONFIG_RUN, GATE_PRIORITY, CeleryDispatcher
from app.settings import Settings

from tests.services.conftest import SPARE_REDIS_URL


def test_gate_message_is_delivered_before_earlier_escalations(redis_url):
    url = SPARE_REDIS_URL  # a database no stack's Celery worker consumes (tests/services/conftest.py)
    from workers.celery_app import celery_app

    with celery_app.connection_for_read(url) as conn:
        channel = conn.default_channel
        channel._purge("gpu")
        sender = CeleryDispatcher(Settings(broker_url=url, execution="celery"))
        for config_run_id in (101, 102, 103):
            sender.send(EXECUTE_CONFIG_RUN, config_run_id, priority=ESCALATION_PRIORITY)
        sender.send(EXECUTE_CONFIG_RUN, 150)  # a scheduled run: the default priority
        sender.send(EXECUTE_CONFIG_RUN, 200, priority=GATE_PRIORITY)
        order = []
        while (message := channel.basic_get("gpu", no_ack=True)) is not None:
            body = message.body if isinstance(message.body, (bytes, str)) else json.dumps(message.body)
            order.append(json.loads(body)[0][0])  # Celery protocol 2: [args, kwargs, embed]
        assert order == [200, 150, 101, 102, 103]
