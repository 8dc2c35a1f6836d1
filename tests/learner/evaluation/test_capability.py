"""The capability guard in the evaluation gate, measured on real checkpoints of the tiny model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from learner.evaluation import EvalConfig, EvalMethod, run_eval_child
from learner.evaluation.guard import GuardConfig
from learner.evaluation.stage import evaluate_candidate
from tests.fixtures.tiny_model import perturb_weights, tiny_model_path
from tests.learner.evaluation.test_scoring import EVAL_SET


def _evaluate(candidate: Path, eval_set: list, guard: GuardConfig | None = None) -> object:
    return evaluate_candidate(
        EvalConfig(guard=guard or GuardConfig()),
        eval_set,
        candidate=candidate,
        serving=tiny_model_path(),
        serving_version="v-serving",
        root=tiny_model_path(),
        num_threads=1,
    )


def test_the_same_weights_pass_every_check_with_zero_kl() -> None:
    evaluation = _evaluate(tiny_model_path(), EVAL_SET)
    assert evaluation.passed, evaluation.reason
    assert evaluation.reason.endswith("capability guard passed (8 checks)")
    checks = {check["name"]: check for check in evaluation.record["checks"]}
    assert checks["kl_to_root"]["value"] == 0.0  # the root scores the candidate's own samples alike
    assert checks["reference_loglik"]["value"] == checks["reference_loglik"]["serving"]
    assert all(check["passed"] for check in checks.values())
    measured = evaluation.record["capability"]["candidate"]
    assert measured["answers"] == 32 + 3  # the shipped set, and the eval set's three distinct prompts
    assert measured["examples"][0]["question"] == "What is the capital of France?"
    assert evaluation.metrics["guard/passed"] == 1.0


def test_a_broken_model_is_held_back_even_before_any_rating(tmp_path: Path) -> None:
    """No held-out ratings yet (the preference cannot be scored): the guard still judges."""
    broken = perturb_weights(tiny_model_path(), tmp_path / "broken", std=0.5, seed=3)
    evaluation = _evaluate(broken, [])
    assert not evaluation.passed
    assert evaluation.reason.startswith("held back by the capability guard: ")
    assert "preference not evaluated: the eval set is empty" in evaluation.reason
    failed = {check["name"] for check in evaluation.record["checks"] if not check["passed"]}
    assert {"reference_loglik", "kl_to_root"} <= failed
    assert evaluation.record["passed"] is False
    assert evaluation.metrics["guard/passed"] == 0.0


def test_an_operator_capability_set_replaces_the_shipped_one(tmp_path: Path) -> None:
    own = tmp_path / "capability.jsonl"
    lines = [
        {"messages": [{"role": "user", "content": "Say hi."}], "answers": [{"content": "Hi!", "reward": 1}]},
        {"messages": [{"role": "user", "content": "Count to 3."}], "answers": [{"content": "1, 2, 3", "reward": 1}]},
    ]
    own.write_text("".join(json.dumps(line) + "\n" for line in lines))
    guard = GuardConfig(set_path=own, user_prompts=0, max_tokens=4)
    scores = run_eval_child(
        {"candidate": tiny_model_path()}, [], EvalMethod(), num_threads=1, timeout_s=300, guard=guard, root=None
    )
    assert scores["candidate"]["capability"]["answers"] == 2
    assert scores["candidate"]["capability"]["length_mean"] <= 4


def test_a_bad_capability_set_fails_when_the_gate_is_configured(tmp_path: Path) -> None:
    bad = tmp_path / "capability.jsonl"
    bad.write_text('{"messages": [{"role": "user", "content": "no reference answer"}]}\n')
    with pytest.raises(ValueError, match="line 1"):
        EvalConfig(guard=GuardConfig(set_path=bad))
    EvalConfig(gate="off", guard=GuardConfig(set_path=bad))  # no gate: the set is never read
