"""Round metrics: real train_step metrics read back from TensorBoard's event files at each round's step."""

from __future__ import annotations

import importlib.util
import logging
from pathlib import Path

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from learner.round_metrics import RoundMetricsConfig, round_scalars, write_round_metrics
from learner.trainers import TrainConfig, train_step
from tandem.settings import Settings
from tests.fixtures.tiny_model import tiny_model_path
from tests.learner.trainers.conftest import load_tiny, random_samples

STAGES = {"collect": 0.01, "reward": 0.02, "train": 3.5, "export": 0.25, "swap": 1.75}


def read_scalars(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
    events = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})  # 0: keep every event
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def round_metrics(seed: int) -> dict[str, object]:
    """What a round stores on its row: reward stats, one real train_step's metrics, and non-numbers."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = load_tiny(tiny_model_path())
        train = train_step(
            model, torch.optim.SGD(model.parameters(), lr=1e-2), random_samples(6, seed=seed), TrainConfig()
        )
    finally:
        torch.set_num_threads(threads)
    return {
        "reward_mean": 0.25 + seed,
        "reward_std": 0.5,
        "reward_count": 6,
        **train,
        "round_id": "r-1",  # strings, nested dicts, None and flags are not plotted
        "seconds": dict(STAGES),
        "note": None,
        "converged": True,
    }


def test_rounds_are_scalars_under_slime_names_at_their_steps(tmp_path: Path) -> None:
    config = RoundMetricsConfig(tensorboard_dir=tmp_path)
    rounds = {1: round_metrics(0), 2: round_metrics(1)}
    for step, metrics in rounds.items():
        written = write_round_metrics(config, model="tiny", step=step, metrics=metrics, seconds=STAGES)
        assert written == round_scalars(metrics, STAGES)

    scalars = read_scalars(tmp_path / "tiny")
    expected_tags = {
        "rollout/reward_mean",
        "rollout/reward_std",
        "rollout/reward_count",
        "rollout/response_length_mean",
        "rollout/response_length_max",
        "train/loss",
        "train/pg_loss",
        "train/pg_clipfrac",
        "train/ppo_kl",
        "train/entropy_loss",
        "train/grad_norm",
        "perf/tokens_per_sec",
        *(f"time/{stage}_s" for stage in STAGES),
    }
    assert set(scalars) == expected_tags
    for tag, points in scalars.items():
        assert [step for step, _ in points] == [1, 2], tag
    for step, metrics in rounds.items():
        for name, value in round_scalars(metrics, STAGES).items():
            assert scalars[name][step - 1][1] == pytest.approx(value, rel=1e-6), name  # stored as float32
    assert scalars["rollout/reward_mean"] == [(1, 0.25), (2, 1.25)]
    assert scalars["time/swap_s"] == [(1, 1.75), (2, 1.75)]
    # The real step's numbers, not placeholders: entropy of a random 2048-token model, lengths 2..8.
    assert all(5 < value < 7.7 for _, value in scalars["train/entropy_loss"])
    assert all(2 <= value <= 8 for _, value in scalars["rollout/response_length_mean"])
    assert all(value > 0 for _, value in scalars["train/grad_norm"] + scalars["perf/tokens_per_sec"])


def test_a_model_name_with_slashes_is_one_folder(tmp_path: Path) -> None:
    write_round_metrics(RoundMetricsConfig(tensorboard_dir=tmp_path), model="org/Model 1", step=7, metrics={"loss": 1})
    assert [p.name for p in tmp_path.iterdir()] == ["org_Model_1"]
    assert read_scalars(tmp_path / "org_Model_1") == {"train/loss": [(7, 1.0)]}


def test_unknown_and_grouped_names(tmp_path: Path) -> None:
    metrics = {"samples": 3, "baseline_mean": 0.1, "perf/x": 2.5, "mystery": 1, "loss": float("nan"), "value_loss": 0.5}
    scalars = round_scalars(metrics, {"swap": 4})
    assert scalars.keys() == {
        "rollout/samples",
        "rollout/baseline_mean",
        "perf/x",
        "round/mystery",
        "train/loss",
        "train/value_loss",
        "time/swap_s",
    }


def test_a_failing_sink_warns_and_does_not_raise(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    blocked = tmp_path / "not-a-folder"
    blocked.write_text("a file where the log folder should be")
    with caplog.at_level(logging.WARNING, logger="learner.round_metrics"):
        written = write_round_metrics(
            RoundMetricsConfig(tensorboard_dir=blocked), model="tiny", step=1, metrics={"loss": 0.5}
        )
    assert written == {"train/loss": 0.5}
    assert [r.getMessage() for r in caplog.records] == ["round metrics: TensorBoard write failed"]
    assert blocked.read_text() == "a file where the log folder should be"


def test_nothing_numeric_writes_nothing(tmp_path: Path) -> None:
    assert (
        write_round_metrics(RoundMetricsConfig(tensorboard_dir=tmp_path), model="m", step=1, metrics={"a": "b"}) == {}
    )
    assert list(tmp_path.iterdir()) == []


@pytest.mark.skipif(importlib.util.find_spec("wandb") is not None, reason="wandb is installed here")
def test_wandb_configured_without_the_package_is_a_config_error(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match=r"pip install 'tandem\[wandb\]'"):
        RoundMetricsConfig(wandb_project="tandem")
    monkeypatch.setenv("TANDEM_WANDB_PROJECT", "tandem")
    with pytest.raises(ValueError, match=r"pip install 'tandem\[wandb\]'"):
        Settings()


def test_config_from_settings(tmp_path: Path) -> None:
    config = RoundMetricsConfig.from_settings(Settings(data_dir=tmp_path))
    assert config == RoundMetricsConfig(tensorboard_dir=tmp_path / "tensorboard", wandb_dir=tmp_path / "wandb")
    assert RoundMetricsConfig.from_settings(
        Settings(data_dir=tmp_path, tensorboard_dir=tmp_path / "tb")
    ).tensorboard_dir == (tmp_path / "tb")
