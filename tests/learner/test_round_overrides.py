"""learner.round_overrides: a schedule's round settings are Settings' learn_* knobs, checked as a worker
will build the round from them."""

from __future__ import annotations

from pathlib import Path

import pytest

from learner.round_overrides import ROUND_SETTINGS, RoundSettingsError, check_round_settings, with_round_settings
from learner.round_settings import round_config
from tandem.settings import Settings


@pytest.fixture
def settings(tmp_path: Path) -> Settings:
    return Settings(data_dir=tmp_path)


def test_the_keys_are_the_learners_round_knobs() -> None:
    assert {"learning_rate", "steps", "reward", "reward_path", "samples_per_prompt", "kl_coef", "kl_type"} <= set(
        ROUND_SETTINGS
    )
    assert {"baseline", "rollout_max_tokens", "custom_loss_path", "scope"} <= set(ROUND_SETTINGS)
    # When rounds run and what the worker machine has are not a round's settings.
    assert not {"check_interval_s", "min_feedback", "min_interval_s", "threads"} & set(ROUND_SETTINGS)


def test_overrides_reach_the_round_config_and_are_stored_as_json(settings: Settings) -> None:
    overrides = {"learning_rate": "3e-6", "steps": 2, "reward": "judge", "samples_per_prompt": 8, "kl_coef": 0.1}
    stored = check_round_settings(settings, overrides)
    assert stored == {"learning_rate": 3e-6, "steps": 2, "reward": "judge", "samples_per_prompt": 8, "kl_coef": 0.1}
    config = round_config(
        with_round_settings(settings, stored), server_url="http://127.0.0.1:1", admin_key="k", trigger="schedule"
    )
    assert (config.learning_rate, config.num_steps, config.reward) == (3e-6, 2, "judge")
    assert config.rollout.n_samples_per_prompt == 8 and config.train_config.loss.kl_loss_coef == 0.1
    assert with_round_settings(settings, {}) is settings


def test_slimes_algorithm_and_plugin_settings_reach_the_round(settings: Settings) -> None:
    plugins = "tests.slime_plugins"
    overrides = {
        "advantage_estimator": "reinforce_plus_plus",
        "reward_kl_coef": 0.05,
        "gamma": 0.9,
        "use_opd": True,
        "opd_kl_coef": 0.5,
        "reward_key": "score",
        "reward": "custom",
        "reward_path": f"{plugins}.tool_generate.reward_func",
        "custom_generate_path": f"{plugins}.tool_generate.generate",
        "dynamic_filter_path": f"{plugins}.filters_and_loss.keep_varied",
        "buffer_filter_path": f"{plugins}.filters_and_loss.pop_first",
        "eval_rollout_path": f"{plugins}.rollout_fn.generate_rollout",
    }
    applied = with_round_settings(settings, check_round_settings(settings, overrides))
    config = round_config(applied, server_url="http://127.0.0.1:1", admin_key="k", trigger="schedule")
    train = config.train_config
    assert (train.advantage_estimator, train.kl_coef, train.gamma, train.reward_key) == (
        "reinforce_plus_plus",
        0.05,
        0.9,
        "score",
    )
    assert train.use_opd and train.opd_kl_coef == 0.5 and train.token_level and train.whitens
    assert config.rollout.custom_generate_path == overrides["custom_generate_path"]
    assert (config.dynamic_filter_path, config.buffer_filter_path, config.eval_rollout_path) == (
        overrides["dynamic_filter_path"],
        overrides["buffer_filter_path"],
        overrides["eval_rollout_path"],
    )
    with pytest.raises(RoundSettingsError, match="exclude each other"):
        check_round_settings(settings, {"reward_kl_coef": 0.1, "kl_coef": 0.1})


@pytest.mark.parametrize(
    ("overrides", "param"),
    [
        ({"lerning_rate": 1e-5}, "round_settings.lerning_rate"),
        ({"min_feedback": 3}, "round_settings.min_feedback"),
        ({"learning_rate": 0}, "round_settings.learning_rate"),
        ({"learning_rate": "fast"}, "round_settings.learning_rate"),
        ({"steps": 1, "samples_per_prompt": 65}, "round_settings.samples_per_prompt"),
        ({"kl_type": "k9"}, "round_settings.kl_type"),
        ({"scope": "everyone"}, "round_settings.scope"),  # base or personal
        ({"reward": "custom"}, "round_settings"),  # a custom reward needs its reward_path
        ({"reward": "custom", "reward_path": "no_such_module:score"}, "round_settings"),
    ],
)
def test_bad_overrides_name_what_to_fix(settings: Settings, overrides: dict[str, object], param: str) -> None:
    with pytest.raises(RoundSettingsError) as caught:
        check_round_settings(settings, overrides)
    assert caught.value.param == param, caught.value.message
