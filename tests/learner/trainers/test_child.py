"""Training in a child process: success exports a new checkpoint; every kind of failure is reported.

The child runs start together (a thread each): each pays Python's and torch's import time.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from learner.trainers import weights_sha256
from learner.trainers.drift import DriftConfig
from learner.training import TrainingOutcome, TrainingRequest, run_training_child
from server.engines.local.weights import read_state_dict
from tests.learner.fault_plugins import CRASH, HANG
from tests.learner.trainers.conftest import random_samples


@pytest.fixture(scope="module")
def outcomes(
    base_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, tuple[TrainingRequest, TrainingOutcome]]:
    out = tmp_path_factory.mktemp("checkpoints")
    base = TrainingRequest(
        base_model_dir=base_dir,
        out_dir=out / "ok",
        samples=tuple(random_samples(6)),
        num_steps=2,
        learning_rate=1e-2,
        num_threads=1,
        timeout_s=120,
    )
    requests = {
        "ok": base,
        "exit": replace(base, out_dir=out / "exit", config=replace(base.config, custom_loss_path=CRASH)),
        "missing": replace(base, out_dir=out / "missing", base_model_dir=out / "no-such-model"),
        "nan": replace(base, out_dir=out / "nan", learning_rate=1e30, num_steps=3),
        "watched": replace(base, out_dir=out / "watched", drift=DriftConfig()),
        "drifting": replace(base, out_dir=out / "drifting", drift=DriftConfig(max_kl=1e-4)),
        "timeout": replace(
            base, out_dir=out / "timeout", config=replace(base.config, custom_loss_path=HANG), timeout_s=4
        ),
    }
    with ThreadPoolExecutor(len(requests)) as pool:
        futures = {name: pool.submit(run_training_child, request) for name, request in requests.items()}
        return {name: (requests[name], future.result()) for name, future in futures.items()}


def test_success_exports_a_checkpoint_whose_weights_moved(outcomes: dict, base_dir: Path) -> None:
    request, outcome = outcomes["ok"]
    assert outcome.status == "succeeded" and outcome.error is None
    assert outcome.checkpoint is not None and outcome.checkpoint.path == request.out_dir
    assert outcome.checkpoint.sha256 == weights_sha256(request.out_dir)
    assert len(outcome.metrics) == 2 and {"loss", "pg_loss", "grad_norm"} <= set(outcome.metrics[0])
    new, old = read_state_dict(request.out_dir), read_state_dict(base_dir)
    assert new.keys() == old.keys() and {t.dtype for t in new.values()} == {torch.bfloat16}
    assert any(not torch.equal(new[name], old[name]) for name in old)


def test_a_hard_crash_fails_the_run(outcomes: dict) -> None:
    request, outcome = outcomes["exit"]
    assert outcome.status == "failed" and outcome.failure == "crashed" and outcome.checkpoint is None
    assert "exited with code 3" in outcome.error
    assert not request.out_dir.exists()


def test_a_missing_model_folder_fails_with_the_childs_error(outcomes: dict) -> None:
    request, outcome = outcomes["missing"]
    assert outcome.status == "failed" and outcome.failure == "error"
    assert "no-such-model" in outcome.error
    assert not request.out_dir.exists()


def test_divergence_fails_with_training_diverged_and_no_checkpoint(outcomes: dict) -> None:
    request, outcome = outcomes["nan"]
    assert outcome.status == "failed" and outcome.failure == "diverged" and outcome.checkpoint is None
    assert outcome.error.startswith("TrainingDiverged")
    assert not request.out_dir.exists() and list(request.out_dir.parent.glob(".nan*")) == []


def test_a_hung_child_is_killed_at_its_timeout(outcomes: dict) -> None:
    request, outcome = outcomes["timeout"]
    assert outcome.status == "failed" and outcome.failure == "timeout" and "4 s timeout" in outcome.error
    assert not request.out_dir.exists()


def test_request_round_trips_through_json_and_is_validated(outcomes: dict) -> None:
    request, _ = outcomes["ok"]
    again = TrainingRequest.from_json(request.to_json())
    assert again.config == request.config and again.out_dir == request.out_dir
    assert [s.to_dict() for s in again.samples] == [s.to_dict() for s in request.samples]
    with pytest.raises(ValueError, match=r"no samples.*num_steps"):
        replace(request, samples=(), num_steps=0)
    with pytest.raises(ValueError, match="failed run"):
        TrainingOutcome("failed")


def test_the_drift_guard_probes_every_step_and_lets_a_moderate_round_export(outcomes: dict) -> None:
    _, outcome = outcomes["watched"]
    assert outcome.status == "succeeded", outcome.error
    first, second = outcome.metrics
    assert 0 < first["drift/kl_to_root"] < second["drift/kl_to_root"] < 1.0  # steps move away from the root
    assert 0.5 < second["drift/entropy_ratio"] < 1.5


def test_a_round_past_a_drift_bound_stops_before_export(outcomes: dict) -> None:
    request, outcome = outcomes["drifting"]
    assert outcome.status == "failed" and outcome.failure == "drifted" and outcome.checkpoint is None
    assert outcome.error.startswith("PolicyDrifted: step 1: KL to the lineage root ")
    assert "> 0.0001 per token" in outcome.error
    assert not request.out_dir.exists()
