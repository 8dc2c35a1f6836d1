"""Scoring checkpoints in a child process: the serving engines' weights are never touched.

A checkpoint is a model folder, or a PEFT adapter folder (scored over the base its config names).

Each checkpoint is loaded from disk with transformers (float32, the learner's device: the CPU, as
training), scored (``learner.evaluation.scoring``) and freed before the next, so at most one extra
model is in memory at a time. A crash or hang fails the evaluation, not the process that asked.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import sys
import time
import traceback
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from learner.child_process import run_child, write_outcome
from learner.evaluation.config import EvalMethod
from learner.sample import Sample

__all__ = ["EvalFailed", "run_eval_child"]


class EvalFailed(RuntimeError):
    """The evaluation child crashed, timed out or raised (the eval function's error included)."""


def run_eval_child(
    checkpoints: Mapping[str, Path],
    eval_set: Sequence[Sample],
    method: EvalMethod,
    *,
    num_threads: int | None,
    timeout_s: float,
) -> dict[str, dict[str, float]]:
    """Every checkpoint's scores (``scoring.score_model``) by name, plus ``seconds`` each took.

    Raises:
        EvalFailed: the child failed; its error says why.
    """
    request = {
        "checkpoints": {name: str(path) for name, path in checkpoints.items()},
        "eval_set": [s.to_dict() for s in eval_set],
        "method": dataclasses.asdict(method),
        "num_threads": num_threads,
    }
    run = run_child("learner.evaluation.child", json.dumps(request), timeout_s=timeout_s, what="evaluation")
    if run.outcome is None:
        raise EvalFailed(run.error or "the evaluation child reported nothing")
    if run.outcome.get("error"):
        raise EvalFailed(run.outcome["error"])
    return dict(run.outcome["scores"])


def _score_all(request: dict[str, Any]) -> dict[str, dict[str, float]]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from learner.evaluation.scoring import score_model

    if request["num_threads"] is not None:
        torch.set_num_threads(request["num_threads"])
    eval_set = [Sample.from_dict(s) for s in request["eval_set"]]
    method = EvalMethod(**request["method"])
    scores = {}
    for name, path in request["checkpoints"].items():
        started = time.perf_counter()
        base = _adapter_base(Path(path))
        model: torch.nn.Module = AutoModelForCausalLM.from_pretrained(base or path, dtype=torch.float32)
        if base is not None:
            from peft import PeftModel

            model = PeftModel.from_pretrained(model, path)
        tokenizer = AutoTokenizer.from_pretrained(base or path)
        # A PeftModel forwards and generates as its base does.
        scored = score_model(model, tokenizer, eval_set, method)  # type: ignore[arg-type]
        scores[name] = scored | {"seconds": time.perf_counter() - started}
        del model
        gc.collect()
    return scores


def _adapter_base(path: Path) -> str | None:
    """For a PEFT adapter folder, the base checkpoint it was trained over (its config names it)."""
    config = path / "adapter_config.json"
    return str(json.loads(config.read_text())["base_model_name_or_path"]) if config.is_file() else None


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        sys.stderr.write("usage: python -m learner.evaluation.child REQUEST.json\n")
        return 2
    request_path = Path(argv[1])
    try:
        outcome: dict[str, Any] = {"scores": _score_all(json.loads(request_path.read_text()))}
    except Exception as exc:  # user code (the eval function) included: reported, never a traceback alone
        outcome = {"error": f"{type(exc).__name__}: {exc}\n{''.join(traceback.format_exception(exc))}"}
    write_outcome(request_path, outcome)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
