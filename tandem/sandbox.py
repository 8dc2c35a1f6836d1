"""Run untrusted Python in a fresh, isolated process: bubblewrap namespaces plus rlimits.

Each execution is a new ``bwrap`` process tree with every namespace unshared (no network: its
network namespace has only a down loopback; its own PIDs, IPC and hostname), a read-only view of
``/usr`` (the interpreter and its standard library) and nothing else of the host: no ``/etc``,
``/home``, ``/root`` or data directory, a private writable ``/work`` and ``/tmp`` on size-limited
tmpfs that vanish with it. When the caller is root, the tree runs as an unprivileged uid of its own
(from ``SLOT_UID_BASE``), so the process limit counts that execution only. Limits on CPU time,
address space, processes and file size are rlimits set before ``bwrap`` starts, the wall-clock
limit and the output limit are enforced here by killing the whole tree (its PID namespace dies with
its first process). What comes back: stdout, stderr (each cut at the output limit), the exit code
and why it ended.

Measured start-to-result for a trivial snippet: BENCHMARKS.md ("Sandbox").
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import shutil
import signal
import time
import weakref
from dataclasses import dataclass
from typing import Literal

EndReason = Literal["ok", "error", "timeout", "cpu_limit", "memory_limit", "output_limit"]
# As root each execution runs as a uid drawn at random from this range, which no account uses: two
# executions at once (in this process or another gateway's or learner's) practically never share one,
# and a uid is not reused while the host's init has yet to reap what its last execution left (bwrap's
# namespace init ends as a zombie, which counts against its uid's process limit until reaped).
SLOT_UID_BASE = 3_000_000
UID_COUNT = 1 << 20
READ_CHUNK = 65536
CLEAR_ATTEMPTS = 500  # 10 ms apart: at most 5 s for an execution's processes to go


class SandboxUnavailable(RuntimeError):
    """bubblewrap is not installed (scripts/setup.sh installs it), or cannot start here."""


@dataclass(frozen=True, slots=True)
class SandboxLimits:
    cpu_s: int = 5
    wall_s: float = 10.0
    memory_bytes: int = 512 << 20  # address space: the interpreter itself takes about 30 MiB
    processes: int = 16
    output_bytes: int = 64 << 10  # stdout and stderr each
    disk_bytes: int = 16 << 20  # each of /work and /tmp; also the largest file


@dataclass(frozen=True, slots=True)
class ExecutionResult:
    stdout: str
    stderr: str
    exit_code: int | None  # None when it was killed
    reason: EndReason
    wall_s: float

    def as_tool_result(self) -> str:
        """The text a model reads back: the output, and how the run ended when not normally."""
        parts = [self.stdout.rstrip()]
        if self.stderr.strip():
            parts.append(f"[stderr]\n{self.stderr.rstrip()}")
        if self.reason != "ok":
            parts.append(f"[{_REASON_TEXT[self.reason]}]")
        return "\n".join(p for p in parts if p)


_REASON_TEXT: dict[EndReason, str] = {
    "ok": "ok",
    "error": "the code raised an error",
    "timeout": "killed: wall-clock time limit",
    "cpu_limit": "killed: CPU time limit",
    "memory_limit": "stopped: memory limit",
    "output_limit": "killed: output limit",
}


def sandbox_python() -> str:
    """The interpreter the sandbox runs: the system's, under the read-only ``/usr``."""
    for candidate in ("/usr/bin/python3", "/usr/local/bin/python3"):
        if os.access(candidate, os.X_OK):
            return candidate
    raise SandboxUnavailable("no python3 under /usr for the sandbox")


class Sandbox:
    """At most ``slots`` executions at once; as root, each runs as a uid of its own."""

    def __init__(self, limits: SandboxLimits | None = None, *, slots: int = 4, python: str | None = None) -> None:
        bwrap, prlimit = shutil.which("bwrap"), shutil.which("prlimit")
        if bwrap is None or prlimit is None:
            raise SandboxUnavailable(
                "bubblewrap (bwrap) or prlimit (util-linux) is not installed: run scripts/setup.sh, "
                "or apt-get install bubblewrap util-linux"
            )
        self.limits = limits or SandboxLimits()
        self._bwrap, self._prlimit = bwrap, prlimit
        self._python = python or sandbox_python()
        self._slot_count = slots
        # One bound per event loop: a Sandbox kept across asyncio.run calls (one per learner round)
        # must not reuse a semaphore bound to a loop that is gone.
        self._slots: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Semaphore] = (
            weakref.WeakKeyDictionary()
        )
        self._random = random.SystemRandom()

    def argv(self, code: str) -> list[str]:
        disk = str(self.limits.disk_bytes)
        return [
            self._bwrap,
            *("--unshare-all", "--die-with-parent", "--new-session"),
            *("--ro-bind", "/usr", "/usr"),
            *("--symlink", "usr/lib", "/lib", "--symlink", "usr/lib64", "/lib64", "--symlink", "usr/bin", "/bin"),
            *("--proc", "/proc", "--dev", "/dev"),
            *("--size", disk, "--tmpfs", "/tmp", "--size", disk, "--tmpfs", "/work", "--chdir", "/work"),
            *("--clearenv", "--setenv", "PATH", "/usr/bin:/bin", "--setenv", "HOME", "/work"),
            *("--setenv", "PYTHONDONTWRITEBYTECODE", "1", "--setenv", "PYTHONIOENCODING", "utf-8"),
            *("--remount-ro", "/"),  # bwrap's own root: only /work and /tmp stay writable
            "--",
            *(self._python, "-I", "-c", code),
        ]

    async def run_python(self, code: str) -> ExecutionResult:
        loop = asyncio.get_running_loop()
        slots = self._slots.get(loop)
        if slots is None:
            slots = self._slots[loop] = asyncio.Semaphore(self._slot_count)
        async with slots:
            uid = SLOT_UID_BASE + self._random.randrange(UID_COUNT)
            try:
                return await self._run(code, uid)
            finally:
                if os.geteuid() == 0:
                    await _clear_uid(uid)

    async def _run(self, code: str, uid: int) -> ExecutionResult:
        limits = self.limits
        started = time.perf_counter()
        as_root = os.geteuid() == 0
        own_uid = {"user": uid, "group": uid, "extra_groups": []} if as_root else {}
        try:
            process = await asyncio.create_subprocess_exec(
                self._prlimit,
                *_rlimits(limits, processes=as_root),
                *self.argv(code),
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                start_new_session=True,  # its own process group: killed as one
                **own_uid,  # type: ignore[arg-type]
            )
        except OSError as exc:
            raise SandboxUnavailable(f"the sandbox could not start: {exc}") from exc
        assert process.stdout is not None and process.stderr is not None
        over = asyncio.Event()
        readers = [
            asyncio.create_task(_read_capped(stream, limits.output_bytes, over))
            for stream in (process.stdout, process.stderr)
        ]
        waiting = asyncio.ensure_future(process.wait())
        overflow = asyncio.ensure_future(over.wait())
        try:
            done, _ = await asyncio.wait(
                {waiting, overflow}, timeout=limits.wall_s, return_when=asyncio.FIRST_COMPLETED
            )
        finally:
            overflow.cancel()
            if process.returncode is None:
                _kill_tree(process.pid)
            await process.wait()
        stdout, stderr = [await reader for reader in readers]
        wall_s = time.perf_counter() - started
        reason = _reason(process.returncode, waiting in done, over.is_set(), stderr)
        exit_code = process.returncode if process.returncode is not None and process.returncode >= 0 else None
        return ExecutionResult(stdout, stderr, exit_code, reason, wall_s)


def _reason(code: int | None, exited: bool, over: bool, stderr: str) -> EndReason:
    if over:
        return "output_limit"
    if not exited:
        return "timeout"
    if code in (-signal.SIGXCPU, -signal.SIGKILL, 128 + signal.SIGXCPU, 128 + signal.SIGKILL):
        return "cpu_limit"  # the kernel's answer to RLIMIT_CPU: SIGXCPU at the soft limit, SIGKILL at the hard
    if code == 0:
        return "ok"
    return "memory_limit" if "MemoryError" in stderr else "error"


def _rlimits(limits: SandboxLimits, *, processes: bool) -> list[str]:
    """``prlimit`` (util-linux) sets the limits and then runs bwrap: no Python runs between fork and
    exec (a ``preexec_fn`` could deadlock in a process with threads)."""
    args = [
        f"--cpu={limits.cpu_s}:{limits.cpu_s + 1}",  # SIGXCPU at the soft limit, SIGKILL a second later
        f"--as={limits.memory_bytes}",
        f"--fsize={limits.disk_bytes}",
        "--core=0",
    ]
    # RLIMIT_NPROC counts every process and thread of the real uid and never binds root: it is set only
    # where the execution has a uid of its own (as root). Under another user it would count the
    # gateway's threads too, so there the PID namespace and the CPU and wall-clock limits bound forks.
    if processes:
        args.append(f"--nproc={limits.processes}")
    return [*args, "--"]


async def _clear_uid(uid: int) -> None:
    """Kill whatever still runs as ``uid`` and wait until it is gone (the PID namespace's teardown is
    asynchronous): nothing outlives its execution. Zombies are dead already and not waited for."""
    for _ in range(CLEAR_ATTEMPTS):
        pids = _pids_of(uid)
        if not pids:
            return
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        await asyncio.sleep(0.01)


def _pids_of(uid: int, count: int = 1) -> list[int]:
    """The live (not zombie) processes of the uids ``uid`` .. ``uid + count - 1``."""
    pids = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            with contextlib.suppress(FileNotFoundError, ProcessLookupError):
                if uid <= entry.stat().st_uid < uid + count and _state(entry.path) != "Z":
                    pids.append(int(entry.name))
    return pids


def _state(proc_dir: str) -> str:
    with open(f"{proc_dir}/stat") as stat:
        return stat.read().rpartition(")")[2].split()[0]  # the field after the (command name)


def _kill_tree(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):  # bwrap and everything inside: its session is its own group
        os.killpg(pid, signal.SIGKILL)


async def _read_capped(stream: asyncio.StreamReader, cap: int, over: asyncio.Event) -> str:
    """The stream's text, at most ``cap`` bytes; reading more sets ``over`` (the caller kills). The rest
    is read and dropped until the end: an unread pipe would keep the process's exit from being seen."""
    data = bytearray()
    while chunk := await stream.read(READ_CHUNK):
        room = cap - len(data)
        data += chunk[: max(room, 0)]
        if len(chunk) > room:
            over.set()
    return data.decode(errors="replace")
