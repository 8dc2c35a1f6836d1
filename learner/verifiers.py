"""Verifier rewards for tool rollouts, as slime reward functions (``async def f(args, sample, **kwargs)``,
set as ``custom_rm_path``): the sample's final answer checked against its ``label``.

- ``exact_math_answer``: 1 when the answer's final number (the last ``\\boxed{...}`` if there is one,
  else the last number written) equals the label's, else 0.
- ``unit_tests_pass``: 1 when the answer's code (its last fenced Python block, else the whole answer)
  followed by the label (assert statements) runs cleanly in the sandbox, else 0.
"""

from __future__ import annotations

import functools
import math
import re
from typing import Any

from learner.sample import Sample
from tandem.sandbox import Sandbox

_BOXED = re.compile(r"\\boxed\{([^{}]*)\}")
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:[eE][-+]?\d+)?|-?\.\d+")
_CODE = re.compile(r"```(?:python|py)?\n(.*?)```", re.S)


def final_number(text: str) -> float | None:
    """The last ``\\boxed{}`` number of ``text``, else its last number; None when it has none."""
    boxed = _BOXED.findall(text)
    candidates = _NUMBER.findall(boxed[-1]) if boxed else _NUMBER.findall(text)
    if not candidates:
        return None
    try:
        return float(candidates[-1].replace(",", ""))
    except ValueError:
        return None


async def exact_math_answer(args: Any, sample: Sample, **kwargs: Any) -> float:
    got, want = final_number(sample.response), final_number(str(sample.label))
    if got is None or want is None:
        return 0.0
    return 1.0 if math.isclose(got, want, rel_tol=1e-9, abs_tol=1e-9) else 0.0


def answer_code(text: str) -> str:
    """The last fenced Python block of ``text``, else ``text`` itself."""
    blocks = _CODE.findall(text)
    return blocks[-1] if blocks else text


@functools.cache
def _sandbox() -> Sandbox:
    return Sandbox()


async def unit_tests_pass(args: Any, sample: Sample, **kwargs: Any) -> float:
    result = await _sandbox().run_python(f"{answer_code(sample.response)}\n\n{sample.label or ''}\n")
    return 1.0 if result.reason == "ok" else 0.0
