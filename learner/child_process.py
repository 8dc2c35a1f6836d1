"""A Python child process that reads one JSON request and writes one JSON outcome (training, evaluation).

The parent writes the request into a scratch folder and runs ``python -m MODULE REQUEST``; the child
writes ``outcome.json`` next to the request (``write_outcome``: written then renamed, so the parent
never reads half of one). The parent trusts only that file: a child killed by a signal, exiting
non-zero or out of time never wrote one, and its output's tail becomes the error. A crash, OOM kill
or hang there fails that one job and nothing else.

``processes > 1`` runs that many copies as the ranks of one ``torch.distributed`` world (the
multi-GPU trainer): rank 0 reports the outcome, the other ranks only succeed (exit 0) or fail. The
run is decided by whichever comes first: rank 0 ending (its outcome, or its crash), or another rank
failing (its exit and output: the others usually fail only because it left their collectives).
Rank 0 reports success only after a collective every rank joined, so a rank failing after that
cannot have spoiled the result. Every rank runs in one process group that is killed when the run is
decided or times out, so no rank outlives the call.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

__all__ = ["RENDEZVOUS_ENV", "ChildRun", "run_child", "write_outcome"]

# The file where rank 0 publishes the port of its torch.distributed store (``learner.megatron.runtime``):
# the port is bound by the process that serves it, so no other process can take it in between.
RENDEZVOUS_ENV = "TANDEM_RENDEZVOUS_FILE"
_STDERR_TAIL = 4000
_POLL_S = 0.05


@dataclass(frozen=True, slots=True)
class ChildRun:
    """The child's outcome, or why there is none (``failure``, ``error``)."""

    outcome: dict[str, Any] | None
    error: str | None = None
    failure: Literal["crashed", "timeout"] | None = None


@dataclass(frozen=True, slots=True)
class _Rank:
    rank: int
    process: subprocess.Popen[bytes]
    log: Path


def run_child(module: str, request_json: str, *, timeout_s: float, what: str, processes: int = 1) -> ChildRun:
    """Run ``python -m module REQUEST.json`` and read the outcome it wrote; never raises for a failed child.

    Args:
        module: the child's module; its ``main`` reads the request path from ``argv[1]``.
        request_json: the request, as the child parses it.
        timeout_s: every process is killed after this long.
        what: names the job in errors ("training", "evaluation").
        processes: ranks of one torch.distributed world (env ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
            ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR`` and ``RENDEZVOUS_ENV``); 1: a lone process, no env.

    Raises:
        ValueError: ``processes`` < 1.
    """
    if processes < 1:
        raise ValueError(f"processes must be >= 1, got {processes}")
    scratch = Path(tempfile.mkdtemp(prefix=f"tandem-{what}-"))
    try:
        request_path = scratch / "request.json"
        request_path.write_text(request_json)
        ranks = _start(module, request_path, processes)
        try:
            decider = _wait_for_decision(ranks, timeout_s)
        finally:
            _kill(ranks)
        if decider is None:
            return ChildRun(None, error=f"{what} exceeded its {timeout_s:g} s timeout", failure="timeout")
        outcome_path = scratch / "outcome.json"
        code = decider.process.returncode
        if decider.rank == 0 and code == 0 and outcome_path.exists():
            return ChildRun(json.loads(outcome_path.read_text()))
        detail = _tail(decider.log)
        error = _describe_exit(what, code, decider.rank, processes) + (f"; stderr:\n{detail}" if detail else "")
        return ChildRun(None, error=error, failure="crashed")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _start(module: str, request_path: Path, processes: int) -> list[_Rank]:
    ranks: list[_Rank] = []
    try:
        for rank in range(processes):
            log = request_path.with_name(f"rank{rank}.log")
            env = None if processes == 1 else os.environ | _rank_env(rank, processes, request_path)
            with log.open("wb") as out:  # a file, not a pipe nobody drains: a chatty child would block
                process = subprocess.Popen(
                    [sys.executable, "-m", module, str(request_path)],
                    stdin=subprocess.DEVNULL,
                    stdout=out,
                    stderr=out,
                    # The caller's process group: a worker killed with its group takes every rank with it.
                    env=env,
                )
            ranks.append(_Rank(rank, process, log))
    except BaseException:
        _kill(ranks)
        raise
    return ranks


def _rank_env(rank: int, processes: int, request_path: Path) -> dict[str, str]:
    return {
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "WORLD_SIZE": str(processes),
        "LOCAL_WORLD_SIZE": str(processes),
        "MASTER_ADDR": "127.0.0.1",
        RENDEZVOUS_ENV: str(request_path.with_name("rendezvous")),
    }


def _wait_for_decision(ranks: list[_Rank], timeout_s: float) -> _Rank | None:
    """The rank whose ending decides the run: rank 0 once it ends, or the first other rank to fail;
    None when the timeout comes first. Nothing is reaped here (see ``_kill``)."""
    deadline = time.monotonic() + timeout_s
    while True:
        codes = [_exit_code(r.process.pid) for r in ranks]
        if codes[0] is not None:  # checked first: on a tie, rank 0's report wins
            return ranks[0]
        failed = next((r for r, code in zip(ranks, codes, strict=True) if code not in (None, 0)), None)
        if failed is not None:
            return failed
        if time.monotonic() >= deadline:
            return None
        time.sleep(_POLL_S)


def _exit_code(pid: int) -> int | None:
    """The child's exit code (negative: the signal that killed it), None while it runs; not reaped."""
    info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    if info is None:
        return None
    return info.si_status if info.si_code == os.CLD_EXITED else -info.si_status


def _kill(ranks: list[_Rank]) -> None:
    """Kill every rank, then reap them (no rank is reaped before all are killed: an unreaped pid cannot
    be reused, so no other process is ever signalled)."""
    for rank in ranks:
        with contextlib.suppress(ProcessLookupError):  # it already exited
            rank.process.send_signal(signal.SIGKILL)
    for rank in ranks:
        rank.process.wait()


def write_outcome(request_path: Path, outcome: dict[str, Any]) -> None:
    """The child's side: ``outcome.json`` next to the request, whole or not at all."""
    partial = request_path.with_name("outcome.json.partial")
    partial.write_text(json.dumps(outcome))
    os.replace(partial, request_path.with_name("outcome.json"))


def _describe_exit(what: str, returncode: int, rank: int, processes: int) -> str:
    process = f"the {what} process" + ("" if processes == 1 else f" of rank {rank} (of {processes})")
    if returncode < 0:
        return f"{process} was killed by {signal.Signals(-returncode).name}"
    return f"{process} exited with code {returncode}" + ("" if rank else " without reporting an outcome")


def _tail(path: Path) -> str:
    text = path.read_text(errors="replace") if path.exists() else ""
    return text[-_STDERR_TAIL:].strip()
