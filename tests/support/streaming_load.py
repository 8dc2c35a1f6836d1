"""Streaming chat clients looping in threads while a test changes weights; every failure is counted."""

from __future__ import annotations

import threading
import time

from openai import NOT_GIVEN, OpenAI

__all__ = ["StreamingLoad"]


class StreamingLoad:
    """Streaming clients looping until stopped; counts completed and failed requests.

    With ``user``, every request names that end user (so their adapter serves it); ``adapters`` and
    ``adapters_after_mark`` collect the X-Tandem-Adapter header of each completed request (None: the
    base alone), all of them and those begun after the swap."""

    def __init__(self, client: OpenAI, model: str, clients: int = 3, user: str | None = None) -> None:
        self.client, self.model = client, model
        self.user = user
        self.completed, self.failures = 0, []
        self.fingerprints: set[str] = set()
        self.adapters: set[str | None] = set()
        self.adapters_after_mark: set[str | None] = set()
        self.completed_after_mark = 0
        self._mark = float("inf")
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._loop, args=(i,), daemon=True) for i in range(clients)]

    def _loop(self, worker: int) -> None:
        while not self._stop.is_set():
            begun = time.monotonic()
            try:
                raw = self.client.chat.completions.with_raw_response.create(
                    model=self.model,
                    messages=[{"role": "user", "content": f"count to ten, client {worker}"}],
                    max_tokens=16,
                    stream=True,
                    user=self.user if self.user is not None else NOT_GIVEN,
                )
                adapter = raw.headers.get("x-tandem-adapter")
                chunks = list(raw.parse())
                finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
                if finish not in (["stop"], ["length"]):
                    raise AssertionError(f"stream ended without a finish reason: {finish}")
                with self._lock:
                    self.completed += 1
                    self.completed_after_mark += begun > self._mark
                    self.adapters.add(adapter)
                    if begun > self._mark:
                        self.adapters_after_mark.add(adapter)
                    self.fingerprints.update(c.system_fingerprint for c in chunks if c.system_fingerprint)
            except Exception as exc:  # every failure is counted, none may happen
                with self._lock:
                    self.failures.append(repr(exc))

    def __enter__(self) -> StreamingLoad:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        # A few more requests that start after the swap, so the load covers the new version too
        # (requests under way during the swap may finish afterwards on the old one).
        with self._lock:
            self._mark = time.monotonic()
        target = len(self._threads)
        while self.completed_after_mark < target and not self.failures and any(t.is_alive() for t in self._threads):
            self._stop.wait(0.05)
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=120)
