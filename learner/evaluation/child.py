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
from learner.evaluation.eval_set import read_eval_prompts
from learner.evaluation.guard import GuardConfig
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
    guard: GuardConfig | None = None,
    root: Path | None = None,
) -> dict[str, dict[str, Any]]:
    """Every checkpoint's measurements by name, plus ``seconds`` each took.

    Each has the preference scores (``scoring.score_model``) when ``method`` can score ``eval_set``;
    with ``guard``, also ``capability`` (``capability.measure``, on the guard's capability set and
    ``eval_set``'s prompts), where the checkpoint named ``candidate`` gets ``kl_to_root``: its samples
    scored by ``root``. Checkpoints load in the given order, one at a time.

    Raises:
        EvalFailed: the child failed; its error says why.
    """
    request = {
        "checkpoints": {name: str(path) for name, path in checkpoints.items()},
        "eval_set": [s.to_dict() for s in eval_set],
        "method": dataclasses.asdict(method),
        "num_threads": num_threads,
        "guard": None if guard is None else {**dataclasses.asdict(guard), "set_path": str(guard.capability_set)},
        "root": None if root is None else str(root),
    }
    run = run_child("learner.evaluation.child", json.dumps(request), timeout_s=timeout_s, what="evaluation")
    if run.outcome is None:
        raise EvalFailed(run.error or "the evaluation child reported nothing")
    if run.outcome.get("error"):
        raise EvalFailed(run.outcome["error"])
    return dict(run.outcome["scores"])


def _score_all(request: dict[str, Any]) -> dict[str, dict[str, Any]]:
    import torch

    from learner.evaluation.capability import kl_to_root, measure
    from learner.evaluation.scoring import score_model, unscorable

    if request["num_threads"] is not None:
        torch.set_num_threads(request["num_threads"])
    eval_set = [Sample.from_dict(s) for s in request["eval_set"]]
    method = EvalMethod(**request["method"])
    guard = (
        None
        if request["guard"] is None
        else GuardConfig(**request["guard"] | {"set_path": Path(request["guard"]["set_path"])})
    )
    capability = [] if guard is None else read_eval_prompts(guard.capability_set, needs_answers=True)
    root, kl_samples = request["root"], None
    scores: dict[str, dict[str, Any]] = {}
    for name, path in request["checkpoints"].items():
        started = time.perf_counter()
        model, tokenizer = _load(Path(path))
        # A PeftModel forwards and generates as its base does.
        scored: dict[str, Any] = {}
        if unscorable(eval_set, method) is None:
            scored |= score_model(model, tokenizer, eval_set, method)  # type: ignore[arg-type]
        scores[name] = scored
        if guard is not None:
            scored["capability"], samples = measure(model, tokenizer, capability, eval_set, guard)  # type: ignore[arg-type]
            kl_samples = samples if name == "candidate" else kl_samples
            if path == root and kl_samples is not None:  # the root is loaded now: no second load
                scores["candidate"]["capability"]["kl_to_root"] = kl_to_root(model, kl_samples)  # type: ignore[arg-type]
        scored["seconds"] = time.perf_counter() - started
        del model
        gc.collect()
    if kl_samples is not None and root is not None and root not in request["checkpoints"].values():
        model, _ = _load(Path(root))
        scores["candidate"]["capability"]["kl_to_root"] = kl_to_root(model, kl_samples)  # type: ignore[arg-type]
    return scores


def _load(path: Path) -> tuple[Any, Any]:
    """A checkpoint in float32 with its tokenizer: a model folder, or an adapter over its base."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    base = _adapter_base(path)
    model: torch.nn.Module = AutoModelForCausalLM.from_pretrained(base or path, dtype=torch.float32)
    if base is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, path)
    return model, AutoTokenizer.from_pretrained(base or path)


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
