"""The learner's Redis queue as the tests read it: the ``tandem.learn`` messages that were really sent.

Each test uses a key prefix of its own (``TANDEM_REDIS_KEY_PREFIX``) and deletes its keys afterwards.
With no worker consuming, every message sent stays in the queue's list, so a test can count them.
"""

from __future__ import annotations

import base64
import json
import os
import secrets
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import pytest
import redis

from learner.celery_app import QUEUE

REDIS = "redis://127.0.0.1:6379/0"


@dataclass(frozen=True)
class SentTask:
    task_id: str
    task: str
    kwargs: dict[str, Any]
    expires: str | None


@contextmanager
def redis_prefix() -> Iterator[str]:
    """A key prefix of the caller's own on the local Redis (skipped when Redis is away, failed in CI)."""
    client = redis.Redis.from_url(REDIS, socket_connect_timeout=3)
    try:
        client.ping()
    except redis.RedisError as exc:
        message = f"Redis at {REDIS} is unreachable: {exc}"
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"{message}; CI must run the learner queue tests", pytrace=False)
        pytest.skip(message)
    prefix = f"tandem-test-{secrets.token_hex(6)}:"
    try:
        yield prefix
    finally:
        keys = list(client.scan_iter(match=f"{prefix}*", count=1000))
        if keys:
            client.delete(*keys)
        client.close()


def sent_tasks(prefix: str) -> list[SentTask]:
    """Every message in the learner queue under ``prefix``, oldest first."""
    client = redis.Redis.from_url(REDIS)
    try:
        raw = client.lrange(f"{prefix}{QUEUE}", 0, -1)
    finally:
        client.close()
    tasks = []
    for message in reversed(raw):  # kombu pushes on the left
        envelope = json.loads(message)
        _args, kwargs, _embed = json.loads(base64.b64decode(envelope["body"]))
        headers = envelope["headers"]
        tasks.append(SentTask(headers["id"], headers["task"], kwargs, headers.get("expires")))
    return tasks
