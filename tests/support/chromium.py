"""Headless Chromium for browser tests: Debian's /usr/bin/chromium driven by playwright.

playwright never downloads a browser here (scripts/setup.sh installs Debian's). Without Chromium the
browser tests skip on a developer machine and fail under CI=true.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import NoReturn

import pytest
from playwright.sync_api import Browser, sync_playwright

ARTIFACTS = Path(__file__).resolve().parents[2] / "test-artifacts"


def _missing(what: str) -> NoReturn:
    message = f"{what}; run scripts/setup.sh (it installs Debian's chromium)"
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"{message}: CI must run the browser tests", pytrace=False)
    pytest.skip(message)


@contextmanager
def chromium() -> Iterator[Browser]:
    """A headless ``playwright.sync_api.Browser`` on the system Chromium."""
    executable = shutil.which("chromium")
    if executable is None:
        _missing("Chromium is not installed (no `chromium` on PATH)")
    with sync_playwright() as playwright:
        # --no-sandbox: CI runs as root, where Chromium's sandbox refuses to start.
        browser = playwright.chromium.launch(executable_path=executable, headless=True, args=["--no-sandbox"])
        try:
            yield browser
        finally:
            browser.close()


def artifact_dir(name: str) -> Path:
    """``test-artifacts/<name>/`` (gitignored); a later run overwrites the files of the same name."""
    path = ARTIFACTS / name
    path.mkdir(parents=True, exist_ok=True)
    return path
