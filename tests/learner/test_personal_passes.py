"""How a personal round lays its scopes out for training: together in passes of ``scopes_per_pass``,
a scope whose stored adapter has other settings alone, and every scope of a failed pass again one
child each, so one scope's failure stays its own (real training children, tiny model)."""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from pathlib import Path

import pytest
from peft import LoraConfig, get_peft_model

from learner.personal_round import PersonalRoundConfig, Scope, _PersonalRound, _Prepared
from learner.round_config import RoundConfig
from learner.training import TrainingRequest
from learner.training_request import AdapterSpec
from tests.fixtures.tiny_model import tiny_model_path
from tests.learner.trainers.conftest import load_tiny, random_samples

SPEC = AdapterSpec(rank=4, alpha=8, target_modules=("q_proj", "v_proj"))


def personal_round(tmp_path: Path, scopes_per_pass: int) -> _PersonalRound:
    base = RoundConfig(server_url="http://unused", admin_key="-", database_url="sqlite://", checkpoint_dir=tmp_path)
    config = PersonalRoundConfig(base, adapter=SPEC, scopes_per_pass=scopes_per_pass)
    return _PersonalRound(config, server=None, sessions=None, serving={})  # type: ignore[arg-type]  # train() needs neither


def prepared(tmp_path: Path, name: str, *, advantage: float = 1.0, init_dir: Path | None = None) -> _Prepared:
    samples = random_samples(3, seed=len(name))
    item = _Prepared(Scope("t", "user", name, (name,)), None, f"ad-{name}", samples, 0, time.perf_counter())
    item.request = TrainingRequest(
        base_model_dir=tiny_model_path(),
        out_dir=tmp_path / name,
        samples=tuple(samples),
        advantages=(advantage,) * len(samples),
        num_steps=1,
        learning_rate=1e-2,
        num_threads=1,
        timeout_s=120,
        adapter=replace(SPEC, init_dir=init_dir),
    )
    return item


def test_a_failed_pass_trains_its_scopes_one_by_one_and_the_failure_stays_with_its_scope(tmp_path: Path) -> None:
    # Advantages of 1e38 overflow the loss: that scope diverges, in the pass and alone.
    ready = [prepared(tmp_path, "ann"), prepared(tmp_path, "bob", advantage=1e38), prepared(tmp_path, "cy")]
    results = {p.scope.name: outcome for p, outcome in personal_round(tmp_path, 8).train(ready)}
    assert {name: o.status for name, o in results.items()} == {"ann": "succeeded", "bob": "failed", "cy": "succeeded"}
    assert results["bob"].failure == "diverged"


@pytest.mark.parametrize("scopes_per_pass", [1, 2])
def test_scopes_train_in_passes_of_the_configured_size(
    tmp_path: Path, scopes_per_pass: int, caplog: pytest.LogCaptureFixture
) -> None:
    # A stored adapter of another rank cannot share a pass: that scope trains alone, continued from it.
    other = tmp_path / "rank-2"
    get_peft_model(load_tiny(tiny_model_path()), LoraConfig(r=2, target_modules=["q_proj"])).save_pretrained(other)
    ready = [prepared(tmp_path, n) for n in ("a", "b", "c")] + [prepared(tmp_path, "d", init_dir=other)]
    with caplog.at_level(logging.INFO, logger="learner.personal_round"):
        outcomes = list(personal_round(tmp_path, scopes_per_pass).train(ready))
    assert sorted(p.scope.name for p, _ in outcomes) == ["a", "b", "c", "d"]
    assert all(o.status == "succeeded" for _, o in outcomes), [o.error for _, o in outcomes]
    # Passes of two: a and b together; c is left alone (a pass of one is one child), and d too.
    passes = [r.getMessage() for r in caplog.records if "in one pass" in r.getMessage()]
    assert passes == (["personal round: training a, b in one pass"] if scopes_per_pass == 2 else [])
