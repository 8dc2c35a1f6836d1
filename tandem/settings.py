"""The one settings object: environment (``TANDEM_`` prefix), optional TOML file, CLI overrides."""

from __future__ import annotations

import importlib.util
import ipaddress
import os
import sys
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict, TomlConfigSettingsSource

DEFAULT_MODEL = "smollm2-135m-instruct"
SGLANG_VERSION = "0.5.23"  # what scripts/setup_sglang.sh installs


def default_data_dir() -> Path:
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(base) / "tandem"


def default_sglang_venv() -> Path:
    return Path.home() / ".cache" / "tandem" / f"sglang-{SGLANG_VERSION}"


class Settings(BaseSettings):
    """Everything tandem reads from its environment, validated once at start-up."""

    model_config = SettingsConfigDict(
        env_prefix="TANDEM_", toml_file=os.environ.get("TANDEM_CONFIG"), extra="forbid", frozen=True
    )

    host: str = "127.0.0.1"
    port: int = Field(8000, ge=1, le=65535)
    data_dir: Path = Field(default_factory=default_data_dir)
    database_url: str = ""
    admin_key: SecretStr | None = None

    model: str = DEFAULT_MODEL
    served_model_name: str = ""
    engine: Literal["local", "sglang"] = "local"
    engine_urls: list[str] = Field(default_factory=list)
    engine_config: Path | None = Field(None, description="TOML file of managed engine server groups")
    routing: Literal["affinity", "least_loaded", "round_robin"] = "affinity"
    routing_load_factor: float = Field(0.25, gt=0, description="a replica may hold (1 + this) x the average load")
    routing_load_floor: int = Field(8, ge=0, description="...and always this many requests before sessions move")
    health_interval_s: float = Field(5.0, gt=0)
    health_timeout_s: float = Field(0.0, ge=0, description="0 = the interval")
    healthy_after: int = Field(2, ge=1, description="passed probes before an ejected replica takes traffic")
    engine_stall_timeout_s: float = Field(60.0, gt=0, description="silence from a replica that counts as failure")
    engine_start_timeout_s: float = Field(300.0, gt=0, description="how long serve waits for a first replica")
    sglang_venv: Path = Field(default_factory=default_sglang_venv, description="where setup_sglang.sh installs SGLang")
    sglang_python: str = Field("", description="interpreter of managed SGLang servers; default: the venv's")
    device: str = "cpu"
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    torch_threads: int = Field(0, ge=0, description="0 = torch's default")

    max_batch_size: int = Field(16, ge=1)
    max_queued_requests: int = Field(256, ge=1)
    rollout_max_concurrency: int = Field(
        1, ge=1, description="learner rollout sequences generating at once (POST /admin/rollouts); users go first"
    )
    prefix_cache_bytes: int = Field(256 << 20, ge=0, description="0 disables session prefix reuse")
    max_body_bytes: int = Field(4 << 20, ge=1024)
    request_timeout_s: float = Field(600.0, gt=0)

    # API keys (docs/security.md): how long the gateway trusts what the database said about a key.
    auth_key_ttl_s: float = Field(30.0, gt=0, description="a verified key is rechecked in the background after this")
    auth_key_stale_s: float = Field(
        900.0, gt=0, description="a verified key keeps serving this long while the database does not answer"
    )
    auth_lookup_timeout_s: float = Field(2.0, gt=0, description="a key lookup slower than this answers 503")
    auth_failures_per_minute: int = Field(30, ge=1, description="failed authentications allowed per client address")
    # Request limits of a tenant without limits of its own (PUT /admin/tenants/{id}/limits); 0: none.
    tenant_max_concurrent_requests: int = Field(
        64, ge=0, description="requests of one tenant in progress at once on a gateway (the engine queue is shared)"
    )
    tenant_requests_per_minute: int = Field(0, ge=0)
    tenant_tokens_per_minute: int = Field(0, ge=0, description="prompt tokens plus max_tokens x n, per minute")
    database_statement_timeout_s: float = Field(
        30.0, ge=0, description="PostgreSQL statement_timeout of the gateway's queries; 0: none"
    )

    journal_fsync: Literal["interval", "always"] = "interval"
    journal_fsync_interval_s: float = Field(0.05, gt=0)
    log_flush_interval_s: float = Field(0.25, gt=0, description="journal -> database batching; lookups flush first")
    log_batch_size: int = Field(256, ge=1)

    tensorboard_dir: Path | None = Field(None, description="round metrics event files; default: data_dir/tensorboard")
    wandb_project: str = Field("", description="W&B project for round metrics; empty: W&B off")
    wandb_mode: Literal["online", "offline", "disabled"] = "online"

    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"
    log_format: Literal["json", "console"] = "json"

    # Learner pool (docs/learner-pool.md): Celery over Redis, or an embedded SQLite broker.
    learner: Literal["embedded", "off"] = Field(
        "embedded", description="embedded: `tandem serve` runs one learner worker (with beat) as its child"
    )
    redis_url: str = Field("", description="Celery broker and results; empty: SQLite files in the data dir")
    redis_key_prefix: str = Field("", description="prefix of every Redis key, to share one Redis between deployments")
    celery_visibility_timeout_s: float = Field(
        7200.0, gt=0, description="an unacknowledged task is redelivered after this; keep it above the longest round"
    )
    learn_check_interval_s: float = Field(10.0, gt=0, description="how often beat asks whether a round is due")
    learn_min_feedback: int = Field(8, ge=1, description="new rated answers since the watermark that make a round due")
    learn_min_interval_s: float = Field(60.0, ge=0, description="at least this long between scheduled round starts")
    learn_learning_rate: float = Field(1e-6, gt=0)
    learn_steps: int = Field(1, ge=1)
    learn_threads: int = Field(0, ge=0, description="torch CPU threads for training; 0 = torch's default")
    learn_train_timeout_s: float = Field(3600.0, gt=0)
    learn_reward: Literal["feedback", "reward_model", "judge", "custom"] = Field(
        "feedback", description="feedback: train on rated answers; the others score fresh rollouts (docs/rewards.md)"
    )
    learn_reward_path: str | None = Field(None, description="custom reward function, 'package.module:function'")
    learn_baseline: Literal["user", "global"] = Field("user", description="what a lone rating is compared with")
    learn_samples_per_prompt: int = Field(4, ge=1, le=64, description="rollouts per rated prompt (not feedback)")
    learn_rollout_max_tokens: int = Field(128, ge=1)
    learn_save_batch_dir: Path | None = Field(None, description="save each round's batch here (tandem replay)")
    learn_kl_coef: float = Field(0.0, ge=0, description="KL loss to the lineage's first model (0: off)")
    learn_kl_type: Literal["k1", "k2", "k3", "low_var_kl"] = "low_var_kl"
    learn_custom_loss_path: str | None = Field(None, description="a loss replacing the built-in, 'module:function'")
    learn_backend: Literal["torch", "megatron"] = Field("torch", description="trainer backend (docs/megatron.md)")
    learn_max_tokens_per_device: int = Field(4096, ge=1, description="token cap of one training micro-batch")
    learn_megatron: dict[str, Any] = Field(
        default_factory=dict,
        description='megatron layout as JSON, e.g. {"tensor_parallel": 2, "recompute": "full"} (docs/megatron.md)',
    )
    # Evaluation before promotion (docs/evaluation.md).
    eval_gate: Literal["on", "off"] = Field("on", description="off: no evaluation, no holdout, always roll out")
    eval_margin: float = Field(0.05, ge=0, description="promote when candidate score >= serving score - this")
    eval_prompts: Path | None = Field(None, description="JSONL eval prompts; unset: held-out rated traffic")
    eval_holdout_fraction: float = Field(0.1, ge=0, lt=1, description="share of prompts never trained on")
    eval_max_samples: int = Field(64, ge=1, description="latest held-out rated answers evaluated")
    eval_fn_path: str | None = Field(None, description="eval function 'module:function'; unset: loglik margin")
    eval_temperature: float = Field(0.7, ge=0)
    eval_top_p: float = Field(1.0, gt=0, le=1)
    eval_max_tokens: int = Field(128, ge=1)
    eval_samples_per_prompt: int = Field(1, ge=1, le=64)
    eval_seed: int = 0
    eval_every_steps: int = Field(0, ge=0, description="also evaluate during training every N optimizer steps")
    eval_timeout_s: float = Field(1800.0, gt=0)
    checkpoint_dir: Path | None = Field(None, description="where rounds write checkpoints; default: data dir")
    round_heartbeat_s: float = Field(30.0, gt=0)
    round_stale_timeout_s: float = Field(300.0, gt=0, description="a running round silent this long is failed")
    internal_admin_key: SecretStr | None = Field(
        None, description="set by `tandem serve` for its own learner child when no admin key is configured"
    )

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        return init_settings, env_settings, TomlConfigSettingsSource(settings_cls)

    @field_validator("admin_key")
    @classmethod
    def _admin_key_not_empty(cls, value: SecretStr | None) -> SecretStr | None:
        if value is not None and not value.get_secret_value().strip():
            raise ValueError("TANDEM_ADMIN_KEY is set but empty: give it a key, or unset it")
        return value

    @model_validator(mode="after")
    def _stale_keys_outlive_fresh_ones(self) -> Settings:
        if self.auth_key_stale_s < self.auth_key_ttl_s:
            raise ValueError("auth_key_stale_s must be at least auth_key_ttl_s")
        return self

    @field_validator("engine_urls", mode="before")
    @classmethod
    def _split_urls(cls, value: object) -> object:
        if isinstance(value, str):
            return [u.strip() for u in value.split(",") if u.strip()]
        return value

    @model_validator(mode="after")
    def _stale_after_missed_beats(self) -> Settings:
        if self.round_stale_timeout_s <= 2 * self.round_heartbeat_s:
            raise ValueError("round_stale_timeout_s must exceed two round heartbeats (round_heartbeat_s)")
        return self

    @field_validator("wandb_project")
    @classmethod
    def _wandb_installed(cls, value: str) -> str:
        if value and importlib.util.find_spec("wandb") is None:
            raise ValueError("wandb_project is set but wandb is not installed: pip install 'tandem[wandb]'")
        return value

    @property
    def resolved_tensorboard_dir(self) -> Path:
        return self.tensorboard_dir or self.data_dir / "tensorboard"

    @property
    def resolved_database_url(self) -> str:
        return self.database_url or f"sqlite:///{self.data_dir / 'tandem.db'}"

    @property
    def resolved_checkpoint_dir(self) -> Path:
        return self.checkpoint_dir or self.data_dir / "checkpoints"

    @property
    def local_server_url(self) -> str:
        """The gateway's URL from this machine (a wildcard bind is reached on loopback)."""
        host = "127.0.0.1" if self.host in ("", "0.0.0.0") else "[::1]" if self.host == "::" else self.host
        if ":" in host and not host.startswith("["):
            host = f"[{host}]"
        return f"http://{host}:{self.port}"

    @property
    def sglang_interpreter(self) -> str:
        """What runs managed SGLang servers whose group names no python: the venv's when installed."""
        if self.sglang_python:
            return self.sglang_python
        installed = self.sglang_venv / "bin" / "python"
        return str(installed) if installed.exists() else sys.executable

    @property
    def journal_dir(self) -> Path:
        return self.data_dir / "journal"

    @property
    def model_cache_dir(self) -> Path:
        return self.data_dir / "models"

    @property
    def binds_loopback(self) -> bool:
        if self.host == "localhost":
            return True
        try:
            return ipaddress.ip_address(self.host).is_loopback
        except ValueError:
            return False

    def with_overrides(self, **overrides: object) -> Settings:
        """A copy with the CLI flags that were given (None means not given)."""
        given = {k: v for k, v in overrides.items() if v is not None}
        return self.model_validate({**self.model_dump(), **given}) if given else self
