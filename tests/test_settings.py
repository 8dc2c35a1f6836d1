"""Settings in groups, with every flat TANDEM_* name still working (environment, TOML, keywords)."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from tandem.settings import FLAT_NAMES, GROUPS, Settings


def test_every_flat_name_lands_in_one_group() -> None:
    assert len(FLAT_NAMES) == sum(len(model.model_fields) for model in GROUPS.values())
    assert {"host", "engine", "routing", "learner", "learn_steps", "eval_margin", "log_level"} <= set(FLAT_NAMES)


def test_environment_names_are_the_flat_ones(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TANDEM_PORT", "9001")
    monkeypatch.setenv("TANDEM_ENGINE", "sglang")
    monkeypatch.setenv("TANDEM_ENGINE_URLS", "http://a:1, http://b:2")
    monkeypatch.setenv("TANDEM_ROUTING", "least_loaded")
    monkeypatch.setenv("TANDEM_LEARNER", "off")
    monkeypatch.setenv("tandem_learn_steps", "3")  # case-insensitive, as before
    monkeypatch.setenv("TANDEM_LEARN_MEGATRON", '{"tensor_parallel": 2}')
    monkeypatch.setenv("TANDEM_EVAL_MARGIN", "0.5")
    monkeypatch.setenv("TANDEM_DATABASE_STATEMENT_TIMEOUT_S", "7")
    settings = Settings()
    assert settings.server.port == 9001
    assert (settings.engine.kind, settings.engine.urls) == ("sglang", ["http://a:1", "http://b:2"])
    assert settings.routing.policy == "least_loaded" and settings.learner.mode == "off"
    assert settings.learner.steps == 3 and settings.learner.megatron == {"tensor_parallel": 2}
    assert settings.evaluation.margin == 0.5 and settings.storage.statement_timeout_s == 7
    monkeypatch.setenv("TANDEM_LEARN_MEGATRON", "{not json")
    with pytest.raises(ValueError, match="TANDEM_LEARN_MEGATRON must be a JSON object"):
        Settings()


def test_a_toml_file_may_be_flat_or_grouped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "tandem.toml"
    path.write_text('host = "0.0.0.0"\nlearn_steps = 4\n[evaluation]\nmargin = 0.2\n')
    monkeypatch.setitem(Settings.model_config, "toml_file", path)
    settings = Settings()
    assert settings.server.host == "0.0.0.0" and settings.learner.steps == 4 and settings.evaluation.margin == 0.2


def test_keywords_overrides_and_refusals() -> None:
    settings = Settings(host="::", admin_key="k", learner={"steps": 5}, learn_learning_rate=0.1)
    assert settings.local_server_url == "http://[::1]:8000"
    assert (settings.learner.steps, settings.learner.learning_rate) == (5, 0.1)
    moved = settings.with_overrides(engine="sglang", port=9000, learn_steps=None)
    assert (moved.engine.kind, moved.server.port, moved.learner.steps) == ("sglang", 9000, 5)
    assert moved.server.admin_key is not None and moved.server.admin_key.get_secret_value() == "k"
    with pytest.raises(ValidationError, match="Extra inputs are not permitted"):
        Settings(learn_stepz=2)
    with pytest.raises(ValidationError, match="auth_key_stale_s must be at least auth_key_ttl_s"):
        Settings(auth_key_ttl_s=60, auth_key_stale_s=30)
