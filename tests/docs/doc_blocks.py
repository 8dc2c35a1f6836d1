"""The shell and Python examples of README.md and docs/*.md, as fenced blocks with what to do with each.

A block runs as written against a live server unless the line right above its fence says otherwise:

    <!-- doc-test: not run: why -->   (a GPU, another host, a long-running process, ...): its syntax,
                                       imports and `tandem` commands are still checked
    <!-- doc-test: synopsis -->        a command summary: every `tandem` command in it must exist
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

ROOT = Path(__file__).resolve().parents[2]
LANGUAGES = {"bash": "bash", "sh": "bash", "python": "python"}
_FENCE = re.compile(r"^```(\w+)\n(.*?)^```", re.S | re.M)
_DIRECTIVE = re.compile(r"<!--\s*doc-test:\s*(not run|synopsis)\s*(?::\s*(.*?))?\s*-->\s*$")
_TANDEM = re.compile(r"(?:^|[\s;|&(])tandem\s+([a-z][a-z-]*)", re.M)

Mode = Literal["run", "not run", "synopsis"]


@dataclass(frozen=True, slots=True)
class DocBlock:
    path: Path
    line: int  # of the opening fence
    language: Literal["bash", "python"]
    code: str
    mode: Mode
    why: str = ""  # a not-run block's reason

    @property
    def name(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"

    def tandem_commands(self) -> list[str]:
        """The `tandem` subcommands the block uses (``tandem serve ...`` -> ``serve``)."""
        return sorted(set(_TANDEM.findall(self.code))) if self.language == "bash" else []


def doc_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def doc_blocks(path: Path) -> list[DocBlock]:
    """The file's bash and Python blocks, in order."""
    text = path.read_text()
    blocks = []
    for match in _FENCE.finditer(text):
        language = LANGUAGES.get(match.group(1))
        if language is None:
            continue
        above = text[: match.start()].rstrip("\n").rsplit("\n", 1)[-1]
        directive = _DIRECTIVE.search(above)
        mode: Mode = directive.group(1) if directive else "run"  # type: ignore[assignment]
        line = text.count("\n", 0, match.start()) + 1
        why = (directive.group(2) or "") if directive else ""
        blocks.append(DocBlock(path, line, language, match.group(2), mode, why))  # type: ignore[arg-type]
    return blocks


def all_doc_blocks() -> list[DocBlock]:
    return [block for path in doc_files() for block in doc_blocks(path)]
