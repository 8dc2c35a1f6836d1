"""A Python child process that reads one JSON request and writes one JSON outcome (training, evaluation).

The parent writes the request into a scratch folder and runs ``python -m MODULE REQUEST``; the child
writes ``outcome.json`` next to the request (``write_outcome``: written then renamed, so the parent
never reads half of one). The parent trusts only that file: a child killed by a signal, exiting
non-zero or out of time never wrote one, and its stderr tail becomes the error. A crash, OOM kill or
hang there fails that one job and nothing else.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

__all__ = ["ChildRun", "run_child", "write_outcome"]

_STDERR_TAIL = 4000


@dataclass(frozen=True, slots=True)
class ChildRun:
    """The child's outcome, or why there is none (``failure``, ``error``)."""

    outcome: dict[str, Any] | None
    error: str | None = None
    failure: Literal["crashed", "timeout"] | None = None


def run_child(module: str, request_json: str, *, timeout_s: float, what: str) -> ChildRun:
    """Run ``python -m module REQUEST.json`` and read the outcome it wrote; never raises for a failed child.

    Args:
        module: the child's module; its ``main`` reads the request path from ``argv[1]``.
        request_json: the request, as the child parses it.
        timeout_s: the child is killed after this long.
        what: names the job in errors ("training", "evaluation").
    """
    scratch = Path(tempfile.mkdtemp(prefix=f"tandem-{what}-"))
    try:
        request_path, stderr_path = scratch / "request.json", scratch / "stderr.log"
        request_path.write_text(request_json)
        with stderr_path.open("wb") as stderr:
            try:
                completed = subprocess.run(
                    [sys.executable, "-m", module, str(request_path)],
                    stdin=subprocess.DEVNULL,
                    stdout=stderr,
                    stderr=stderr,
                    timeout=timeout_s,
                    check=False,
                )
            except subprocess.TimeoutExpired:  # subprocess.run has killed the child
                return ChildRun(None, error=f"{what} exceeded its {timeout_s:g} s timeout", failure="timeout")
        outcome_path = scratch / "outcome.json"
        if completed.returncode != 0 or not outcome_path.exists():
            detail = _tail(stderr_path)
            error = _describe_exit(what, completed.returncode) + (f"; stderr:\n{detail}" if detail else "")
            return ChildRun(None, error=error, failure="crashed")
        return ChildRun(json.loads(outcome_path.read_text()))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def write_outcome(request_path: Path, outcome: dict[str, Any]) -> None:
    """The child's side: ``outcome.json`` next to the request, whole or not at all."""
    partial = request_path.with_name("outcome.json.partial")
    partial.write_text(json.dumps(outcome))
    os.replace(partial, request_path.with_name("outcome.json"))


def _describe_exit(what: str, returncode: int) -> str:
    if returncode < 0:
        return f"the {what} process was killed by {signal.Signals(-returncode).name}"
    return f"the {what} process exited with code {returncode} without reporting an outcome"


def _tail(path: Path) -> str:
    text = path.read_text(errors="replace") if path.exists() else ""
    return text[-_STDERR_TAIL:].strip()
