"""Evaluation settings: checked when the round is configured, not halfway through one."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from learner.evaluation import EvalConfig, EvalMethod, EvalSetError
from learner.plugins import PluginError
from learner.round_settings import eval_config
from tandem.settings import Settings

FNS = "tests.learner.evaluation.eval_fns"


def test_every_problem_is_reported_at_once() -> None:
    with pytest.raises(ValueError, match=r"gate must be one of.*margin must be >= 0.*holdout_fraction") as info:
        EvalConfig(gate="maybe", margin=-1, holdout_fraction=1.0)  # type: ignore[arg-type]
    assert "invalid eval config" in str(info.value)
    with pytest.raises(ValueError, match=r"temperature must be >= 0.*top_p must be in"):
        EvalMethod(temperature=-0.1, top_p=0)


def test_an_eval_function_is_loaded_and_checked_like_a_reward_function() -> None:
    assert EvalMethod(fn_path=f"{FNS}:response_length").generates
    with pytest.raises(PluginError, match=r"eval plugin .*not_async.*must be 'async def'"):
        EvalMethod(fn_path=f"{FNS}:not_async")
    with pytest.raises(PluginError, match="has no attribute 'missing'"):
        EvalMethod(fn_path=f"{FNS}:missing")


def test_a_prompts_file_is_checked_against_the_method(tmp_path: Path) -> None:
    path = tmp_path / "eval.jsonl"
    path.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    with pytest.raises(EvalSetError, match="line 1: no 'answers'"):
        EvalConfig(prompts_path=path)  # the built-in method needs rated answers
    config = EvalConfig(prompts_path=path, method=EvalMethod(fn_path=f"{FNS}:response_length"))
    assert not config.holds_out  # a prompts file replaces the holdout: all rated traffic trains


def test_holdout_only_with_the_gate_on_and_no_prompts_file() -> None:
    assert EvalConfig().holds_out
    assert not EvalConfig(gate="off").holds_out
    assert not EvalConfig(holdout_fraction=0.0).holds_out
    assert EvalConfig(gate="off").summary()["holdout_fraction"] == 0.0


def test_settings_reach_the_eval_config(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TANDEM_EVAL_GATE", "off")
    monkeypatch.setenv("TANDEM_EVAL_MARGIN", "0.5")
    monkeypatch.setenv("TANDEM_EVAL_FN_PATH", f"{FNS}:response_length")
    monkeypatch.setenv("TANDEM_EVAL_SAMPLES_PER_PROMPT", "3")
    monkeypatch.setenv("TANDEM_EVAL_EVERY_STEPS", "2")
    config = eval_config(Settings())
    assert (config.gate, config.margin, config.every_steps) == ("off", 0.5, 2)
    assert config.method == EvalMethod(fn_path=f"{FNS}:response_length", samples_per_prompt=3)
    monkeypatch.setenv("TANDEM_EVAL_HOLDOUT_FRACTION", "1")
    with pytest.raises(ValueError, match="eval_holdout_fraction"):
        Settings()
