"""The sandbox under attack: every escape below must fail, every limit must stop the code, and the host
must not notice (no file written, no process left behind)."""

from __future__ import annotations

import asyncio
import socket
import threading
from pathlib import Path

import pytest

from tandem.sandbox import SLOT_UID_BASE, UID_COUNT, ExecutionResult, Sandbox, SandboxLimits, _pids_of

# Generous wall clocks: the machine running the suite may be loaded, and what is tested is the kind
# of ending, not the time it took.
LIMITS = SandboxLimits(cpu_s=2, wall_s=60, memory_bytes=256 << 20, processes=8, output_bytes=4096)


def run(code: str, limits: SandboxLimits = LIMITS) -> ExecutionResult:
    return asyncio.run(Sandbox(limits).run_python(code))


def sandbox_processes() -> list[int]:
    """Live PIDs of the sandbox slots' uids: none may outlive an execution (a zombie is dead already)."""
    return _pids_of(SLOT_UID_BASE, UID_COUNT)


def test_code_runs_and_its_output_comes_back() -> None:
    result = run("import sys\nprint('hello', 6 * 7)\nprint('warn', file=sys.stderr)")
    assert (result.reason, result.exit_code, result.stdout) == ("ok", 0, "hello 42\n")
    assert result.stderr == "warn\n"
    assert result.as_tool_result() == "hello 42\n[stderr]\nwarn"


def test_an_exception_is_reported() -> None:
    result = run("1 / 0")
    assert result.reason == "error" and result.exit_code == 1 and "ZeroDivisionError" in result.stderr
    assert result.as_tool_result().endswith("[the code raised an error]")


def test_no_network_not_even_the_hosts_loopback() -> None:
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        result = run(
            "import socket\n"
            f"for address in [('127.0.0.1', {port}), ('1.1.1.1', 53)]:\n"
            "    try:\n"
            "        socket.create_connection(address, timeout=3)\n"
            "        print('connected', address)\n"
            "    except OSError as exc:\n"
            "        print('refused', exc.errno)\n"
        )
    assert "connected" not in result.stdout and result.stdout.count("refused") == 2, result


def test_host_files_are_out_of_reach(tmp_path: Path) -> None:
    secret = tmp_path / "secret.txt"
    secret.write_text("the host's secret")
    code = (
        "import os\n"
        f"for path in [{str(secret)!r}, '/etc/shadow', '/root', '/proc/1/root/etc/passwd']:\n"
        "    try:\n"
        "        print(open(path).read() if os.path.isfile(path) else os.listdir(path))\n"
        "    except OSError as exc:\n"
        "        print('denied', type(exc).__name__)\n"
        "print(sorted(os.listdir('/')))\n"
    )
    result = run(code)
    assert "secret" not in result.stdout and result.stdout.count("denied") == 4, result
    assert result.stdout.splitlines()[-1] == "['bin', 'dev', 'lib', 'lib64', 'proc', 'tmp', 'usr', 'work']"


def test_writes_land_only_in_its_own_temp_dirs_and_vanish(tmp_path: Path) -> None:
    code = (
        "open('/work/note', 'w').write('kept here')\nprint(open('/work/note').read())\n"
        f"for path in ['/usr/evil', '/evil', '/proc/evil', {str(tmp_path / 'evil')!r}]:\n"
        "    try:\n"
        "        open(path, 'w').write('x')\n"
        "        print('wrote', path)\n"
        "    except OSError as exc:\n"
        "        print('denied', exc.errno)\n"
    )
    result = run(code)
    assert result.stdout.startswith("kept here\n") and "wrote" not in result.stdout, result
    assert not (tmp_path / "evil").exists() and not Path("/usr/evil").exists()
    assert "FileNotFoundError" in run("open('/work/note').read()").stderr  # a fresh sandbox each time


def test_a_fork_bomb_is_contained() -> None:
    before = sandbox_processes()
    result = run(
        "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n",
        SandboxLimits(cpu_s=1, wall_s=20, processes=8),
    )
    assert result.reason in ("cpu_limit", "timeout"), result
    assert sandbox_processes() == before == []
    assert run("print('still fine')").stdout == "still fine\n"


def test_the_process_limit_stops_forking() -> None:
    result = run(
        "import os, time\n"
        "children = 0\n"
        "for _ in range(50):\n"
        "    try:\n"
        "        if os.fork() == 0:\n"
        "            time.sleep(30)\n"
        "            os._exit(0)\n"
        "        children += 1\n"
        "    except OSError:\n"
        "        break\n"
        "print(children)\n",
        SandboxLimits(wall_s=60, processes=8),
    )
    assert int(result.stdout) < 8, result
    assert sandbox_processes() == []  # the sleeping children went with the sandbox


def test_a_memory_hog_is_stopped() -> None:
    result = run("chunks = []\nwhile True:\n    chunks.append(bytearray(16 << 20))\n")
    assert result.reason == "memory_limit" and "MemoryError" in result.stderr, result


def test_an_infinite_loop_hits_the_cpu_limit() -> None:
    result = run("while True:\n    pass\n", SandboxLimits(cpu_s=1, wall_s=60))
    assert result.reason == "cpu_limit" and result.exit_code is not None, result


def test_sleeping_forever_hits_the_wall_clock() -> None:
    result = run("import time\ntime.sleep(600)\n", SandboxLimits(wall_s=1.0))
    assert result.reason == "timeout" and result.exit_code is None and result.wall_s < 30, result
    assert sandbox_processes() == []


def test_huge_output_is_cut_and_the_code_killed() -> None:
    result = run("import sys\nwhile True:\n    sys.stdout.write('x' * 65536)\n")
    assert result.reason == "output_limit" and len(result.stdout) == LIMITS.output_bytes, result
    assert sandbox_processes() == []


def test_a_huge_file_is_refused() -> None:
    result = run("open('/work/big', 'wb').write(b'x' * (64 << 20))\n", SandboxLimits(disk_bytes=1 << 20))
    assert result.reason == "error" and "File too large" in result.stderr, result


def test_the_host_is_unaffected_while_sandboxes_run() -> None:
    """Four sandboxes spinning at once: this process still gets its own work done promptly."""
    sandbox = Sandbox(SandboxLimits(cpu_s=2, wall_s=60), slots=4)
    ticks: list[int] = []
    stop = threading.Event()

    def tick() -> None:
        while not stop.wait(0.05):
            ticks.append(1)

    ticker = threading.Thread(target=tick)
    ticker.start()

    async def spin() -> list[ExecutionResult]:
        return list(await asyncio.gather(*(sandbox.run_python("while True: pass") for _ in range(4))))

    try:
        results = asyncio.run(spin())
    finally:
        stop.set()
        ticker.join()
    assert all(r.reason == "cpu_limit" for r in results)
    assert len(ticks) > 5  # the host thread kept running beside them
    assert sandbox_processes() == []


@pytest.mark.parametrize("slots", [1, 3])
def test_executions_queue_for_a_free_slot(slots: int) -> None:
    sandbox = Sandbox(SandboxLimits(wall_s=60), slots=slots)

    async def many() -> list[ExecutionResult]:
        return list(await asyncio.gather(*(sandbox.run_python(f"print({i})") for i in range(6))))

    assert [r.stdout for r in asyncio.run(many())] == [f"{i}\n" for i in range(6)]


def test_one_sandbox_serves_one_event_loop_after_another() -> None:
    sandbox = Sandbox(SandboxLimits(wall_s=60), slots=1)

    async def two() -> list[ExecutionResult]:  # two at once on one slot: the second waits
        return list(await asyncio.gather(sandbox.run_python("print(1)"), sandbox.run_python("print(2)")))

    for _ in range(2):  # a learner round is one asyncio.run; the next round is another loop
        assert [r.stdout for r in asyncio.run(two())] == ["1\n", "2\n"]
