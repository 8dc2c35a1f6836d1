"""Log lines a person can read on a terminal, JSON for machines: ``TANDEM_LOG_FORMAT=auto`` (the default)
picks by whether stderr is a terminal; ``json`` and ``console`` force one."""

from __future__ import annotations

import io
import json
import logging
import os
import pty
import subprocess
import sys

from tandem.logging import ConsoleFormatter, JsonFormatter, formatter_for
from tandem.settings import Settings

RECORD = logging.LogRecord("tandem.test", logging.INFO, __file__, 1, "serving", None, None)


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_auto_is_readable_on_a_terminal_and_json_elsewhere() -> None:
    assert Settings().observability.log_format == "auto"
    assert isinstance(formatter_for("auto", Terminal()), ConsoleFormatter)
    assert isinstance(formatter_for("auto", io.StringIO()), JsonFormatter)
    assert isinstance(formatter_for("json", Terminal()), JsonFormatter)
    assert isinstance(formatter_for("console", io.StringIO()), ConsoleFormatter)
    assert json.loads(formatter_for("auto", io.StringIO()).format(RECORD))["msg"] == "serving"


def test_a_process_on_a_real_terminal_writes_readable_lines() -> None:
    script = "from tandem.logging import configure_logging; import logging; configure_logging(); logging.getLogger('tandem.x').info('hello')"
    controller, terminal = pty.openpty()
    child = subprocess.run([sys.executable, "-c", script], stderr=terminal, timeout=60, check=True)
    os.close(terminal)
    written = os.read(controller, 4096).decode()
    os.close(controller)
    assert child.returncode == 0 and "INFO" in written and "tandem.x: hello" in written, written
    piped = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True)
    assert json.loads(piped.stderr.strip())["msg"] == "hello"
