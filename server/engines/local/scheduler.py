"""Which requests run: the waiting queue in priority order, fair admission and retraction between
tenants (``fair_share``), the decode batch's membership, and the count of requests in flight.

The event loop enqueues while the engine thread admits, so the waiting queue and the count are
guarded by the engine's condition (reentrant: callers may already hold it). The running list and
its KV batch are touched by the engine thread only.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable

from server.engines.base import EngineOverloaded
from server.engines.local.fair_share import next_to_admit, preemption_victim
from server.engines.local.kv import BatchKV, RowKV
from server.engines.local.sequence import Sequence


class Scheduler:
    def __init__(self, cond: threading.Condition, *, max_batch: int, max_queued: int, max_prefill_tokens: int) -> None:
        self._cond = cond
        self._max_batch = max_batch
        self._max_prefill_tokens = max_prefill_tokens
        self._max_queued = max_queued
        self._waiting: deque[Sequence] = deque()
        self._in_flight = 0
        # Row i of ``batch`` holds the KV of ``running[i]``.
        self.running: list[Sequence] = []
        self.batch = BatchKV()

    @property
    def in_flight(self) -> int:
        """Requests accepted and not yet finished (queued or running)."""
        return self._in_flight

    def has_work(self) -> bool:
        return bool(self._waiting or self.running)

    def submit(self, seq: Sequence) -> None:
        """Accept ``seq`` into the waiting queue, or refuse it when the engine holds too many."""
        with self._cond:
            if self._in_flight >= self._max_queued:
                raise EngineOverloaded()
            self._in_flight += 1
            self._enqueue(seq)
            self._cond.notify()

    def _enqueue(self, seq: Sequence) -> None:
        """Queue ``seq`` behind every waiting request of its priority or higher.

        Admission takes the queue from the front, so waiting lower-priority requests (rollouts) are
        admitted after it; running ones are preempted only for fairness between tenants.
        """
        waiting = self._waiting
        if not waiting or waiting[-1].priority >= seq.priority:  # the common case: all one priority
            waiting.append(seq)
            return
        position = next(i for i, queued in enumerate(waiting) if queued.priority < seq.priority)
        waiting.insert(position, seq)

    def schedule(self) -> list[Sequence]:
        """Retract one running request if a starved tenant waits, then take waiting requests into
        the free slots, up to ``max_prefill_tokens`` of prompt (and output, for a retracted one) a step
        but at least one; returns those to prefill (ones cancelled while queued are released).

        The token bound keeps the decode batch stepping between prefills: a wave of one tenant's
        requests admitted together would otherwise stall every running request, and a request of
        another tenant arriving meanwhile, for all of their prefills (SGLang's --max-prefill-tokens)."""
        with self._cond:
            victim = preemption_victim(self._waiting, self.running, self._max_batch)
            if victim is not None:
                self._retract(victim)
            admitted: list[Sequence] = []
            budget = self._max_prefill_tokens
            while self._waiting and len(self.running) + len(admitted) < self._max_batch:
                index = next_to_admit(self._waiting, [*self.running, *admitted])
                tokens = len(self._waiting[index].input_ids) + len(self._waiting[index].output_ids)
                if admitted and tokens > budget:
                    break
                budget -= tokens
                admitted.append(self._waiting[index])
                del self._waiting[index]
        for seq in admitted:
            if seq.cancelled:
                self.release()
        return [seq for seq in admitted if not seq.cancelled]

    def _retract(self, index: int) -> None:
        """Send one running request back to the front of its priority in the queue (under the lock);
        its KV is dropped and rebuilt from its prompt and output when it is admitted again."""
        seq = self.running.pop(index)
        self.batch.keep_rows([i for i in range(len(self.running) + 1) if i != index])
        position = next((i for i, queued in enumerate(self._waiting) if queued.priority <= seq.priority), None)
        self._waiting.insert(len(self._waiting) if position is None else position, seq)

    def add_running(self, seq: Sequence, row: RowKV) -> None:
        """Join a freshly prefilled request to the decode batch."""
        self.batch.append_row(row)
        self.running.append(seq)

    def drop_finished(self, on_finish: Callable[[Sequence, RowKV], None]) -> None:
        """Release the running requests that are done; ``on_finish`` sees the KV of each that finished
        (rather than being cancelled) before its row is dropped."""
        keep = []
        for index, seq in enumerate(self.running):
            if not seq.done:
                keep.append(index)
                continue
            if seq.finish is not None:
                on_finish(seq, self.batch.row(index))
            self.release()
        if len(keep) < len(self.running):
            self.batch.keep_rows(keep)
            self.running = [self.running[i] for i in keep]

    def release(self) -> None:
        """One request has left the engine for good."""
        with self._cond:
            self._in_flight -= 1

    def take_running(self) -> list[Sequence]:
        """Empty the decode batch and return who was in it (the caller finishes them)."""
        victims, self.running, self.batch = self.running, [], BatchKV()
        return victims

    def take_all(self) -> list[Sequence]:
        """Empty the batch and the queue and return every request (the caller finishes them)."""
        with self._cond:
            waiting = list(self._waiting)
            self._waiting.clear()
        return self.take_running() + waiting

    def retract_all(self) -> None:
        """Send every running request back to the front of the queue, KV dropped; each is
        re-prefilled (under whatever weights serve by then) when admitted again."""
        with self._cond:
            self._waiting.extendleft(reversed(self.running))
        self.running, self.batch = [], BatchKV()
