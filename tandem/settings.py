"""The one settings object: environment (``TANDEM_`` prefix), optional TOML file, CLI overrides.

Fields are grouped by the room that uses them (``settings.server.host``, ``settings.learner.steps``),
and every group field keeps its flat name as an alias: ``TANDEM_HOST``, ``TANDEM_LEARN_STEPS``,
``TANDEM_EVAL_MARGIN``, a flat key in the TOML file or ``Settings(host=...)`` all still work. A group
may also be given whole (``[learner]`` in TOML, ``Settings(learner={...})``).
"""

from __future__ import annotations

import importlib.util
import ipaddress
import json
import os
import sys
from pathlib import Path
from typing import Annotated, Any, Literal, get_origin

from pydantic import (
    AliasChoices,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    SecretStr,
    field_validator,
    model_validator,
)
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict, TomlConfigSettingsSource

DEFAULT_MODEL = "smollm2-135m-instruct"
SGLANG_VERSION = "0.5.23"  # what scripts/setup_sglang.sh installs
ENV_PREFIX = "TANDEM_"


def default_data_dir() -> Path:
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(base) / "tandem"


def default_sglang_venv() -> Path:
    return Path.home() / ".cache" / "tandem" / f"sglang-{SGLANG_VERSION}"


def flat(name: str, default: Any = ..., **kwargs: Any) -> Any:
    """A group field whose flat name (``TANDEM_<NAME>``, a top-level TOML key) differs from its own."""
    return Field(default, validation_alias=AliasChoices(name), serialization_alias=name, **kwargs)


def _comma_separated(value: object) -> object:
    return [item.strip() for item in value.split(",") if item.strip()] if isinstance(value, str) else value


CommaList = Annotated[list[str], BeforeValidator(_comma_separated)]  # a list, or its items comma-separated


class _Group(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", validate_by_name=True, validate_by_alias=True)


class ServerSettings(_Group):
    """The gateway: where it listens, who may call it, how much one caller may use."""

    host: str = "127.0.0.1"
    port: int = Field(8000, ge=1, le=65535)
    admin_key: SecretStr | None = None
    internal_admin_key: SecretStr | None = Field(
        None,
        description="set by `tandem serve` when no admin key is configured: its learner child's key and the "
        "dashboard link's login, for this run only",
    )
    max_body_bytes: int = Field(4 << 20, ge=1024)
    request_timeout_s: float = Field(600.0, gt=0)
    rollout_max_concurrency: int = Field(
        1, ge=1, description="learner rollout sequences generating at once (POST /admin/rollouts); users go first"
    )
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
    # Tools the gateway runs itself for the tenants an operator enabled them for (docs/agents.md).
    tools: CommaList = Field(
        default_factory=list,
        description="'python' (the sandbox) and dotted paths of tool functions, comma-separated",
    )
    tool_max_steps: int = Field(
        8, ge=1, le=64, description="turns of tool calls the gateway runs per request; the next calls go back"
    )

    @field_validator("admin_key")
    @classmethod
    def _admin_key_not_empty(cls, value: SecretStr | None) -> SecretStr | None:
        if value is not None and not value.get_secret_value().strip():
            raise ValueError("TANDEM_ADMIN_KEY is set but empty: give it a key, or unset it")
        return value

    @model_validator(mode="after")
    def _stale_keys_outlive_fresh_ones(self) -> ServerSettings:
        if self.auth_key_stale_s < self.auth_key_ttl_s:
            raise ValueError("auth_key_stale_s must be at least auth_key_ttl_s")
        return self

    @property
    def binds_loopback(self) -> bool:
        if self.host == "localhost":
            return True
        try:
            return ipaddress.ip_address(self.host).is_loopback
        except ValueError:
            return False


class EngineSettings(_Group):
    """What serves: the model, the in-process engine or SGLang servers, and their sizes."""

    model: str = DEFAULT_MODEL
    served_model_name: str = ""
    kind: Literal["local", "sglang"] = flat("engine", "local")
    urls: CommaList = flat("engine_urls", default_factory=list)
    config: Path | None = flat("engine_config", None, description="TOML file of managed engine server groups")
    start_timeout_s: float = flat(
        "engine_start_timeout_s", 300.0, gt=0, description="how long serve waits for a first replica"
    )
    sglang_venv: Path = Field(default_factory=default_sglang_venv, description="where setup_sglang.sh installs SGLang")
    sglang_python: str = Field("", description="interpreter of managed SGLang servers; default: the venv's")
    device: str = "cpu"
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    torch_threads: int = Field(0, ge=0, description="0 = torch's default")
    max_batch_size: int = Field(16, ge=1)
    max_queued_requests: int = Field(256, ge=1)
    max_prefill_tokens: int = Field(
        128, ge=1, description="local engine: prompt tokens prefilled between two decode steps (at least one request)"
    )
    prefix_cache_bytes: int = Field(256 << 20, ge=0, description="0 disables session prefix reuse")
    packed_linears: bool = Field(
        True,
        description="local engine on the CPU: oneDNN-packed weight copies (faster decode, linear weights held twice)",
    )
    linear_weights: Literal["float", "int8"] = Field(
        "float",
        description="local engine on the CPU: int8 = weight-only int8 linears (about 1.9x batch-1 decode, answers change slightly)",
    )
    tool_parser: Literal["auto", "hermes", "llama3_json"] = Field(
        "auto",
        description="how tool calls are read from the model's text; auto: from the chat template (docs/tools.md)",
    )

    @property
    def sglang_interpreter(self) -> str:
        """What runs managed SGLang servers whose group names no python: the venv's when installed."""
        if self.sglang_python:
            return self.sglang_python
        installed = self.sglang_venv / "bin" / "python"
        return str(installed) if installed.exists() else sys.executable


class RoutingSettings(_Group):
    """How requests spread over replicas, and when a replica counts as failed."""

    policy: Literal["affinity", "least_loaded", "round_robin"] = flat("routing", "affinity")
    load_factor: float = flat(
        "routing_load_factor", 0.25, gt=0, description="a replica may hold (1 + this) x the average load"
    )
    load_floor: int = flat(
        "routing_load_floor", 8, ge=0, description="...and always this many requests before sessions move"
    )
    health_interval_s: float = Field(5.0, gt=0)
    health_timeout_s: float = Field(0.0, ge=0, description="0 = the interval")
    healthy_after: int = Field(2, ge=1, description="passed probes before an ejected replica takes traffic")
    stall_timeout_s: float = flat(
        "engine_stall_timeout_s", 60.0, gt=0, description="silence from a replica that counts as failure"
    )


class StorageSettings(_Group):
    """Where data lives: the data folder, the database, the journal in front of it, checkpoints."""

    data_dir: Path = Field(default_factory=default_data_dir)
    database_url: str = ""
    statement_timeout_s: float = flat(
        "database_statement_timeout_s", 30.0, ge=0, description="PostgreSQL statement_timeout of the gateway; 0: none"
    )
    journal_fsync: Literal["interval", "always"] = "interval"
    journal_fsync_interval_s: float = Field(0.05, gt=0)
    log_flush_interval_s: float = Field(0.25, gt=0, description="journal -> database batching; lookups flush first")
    log_batch_size: int = Field(256, ge=1)
    checkpoint_dir: Path | None = Field(None, description="where rounds write checkpoints; default: data dir")

    @property
    def resolved_database_url(self) -> str:
        return self.database_url or f"sqlite:///{self.data_dir / 'tandem.db'}"

    @property
    def resolved_checkpoint_dir(self) -> Path:
        return self.checkpoint_dir or self.data_dir / "checkpoints"

    @property
    def journal_dir(self) -> Path:
        return self.data_dir / "journal"

    @property
    def model_cache_dir(self) -> Path:
        return self.data_dir / "models"


def _learn(name: str, default: Any = ..., **kwargs: Any) -> Any:
    return flat(f"learn_{name}", default, **kwargs)


def _eval(name: str, default: Any = ..., **kwargs: Any) -> Any:
    return flat(f"eval_{name}", default, **kwargs)


class LearnerSettings(_Group):
    """The learner pool (docs/learner-pool.md) and the rounds it runs (``TANDEM_LEARN_*``)."""

    mode: Literal["embedded", "off"] = flat(
        "learner", "embedded", description="embedded: `tandem serve` runs one learner worker (with beat) as its child"
    )
    redis_url: str = Field("", description="Celery broker and results; empty: SQLite files in the data dir")
    redis_key_prefix: str = Field("", description="prefix of every Redis key, to share one Redis between deployments")
    celery_visibility_timeout_s: float = Field(
        7200.0, gt=0, description="an unacknowledged task is redelivered after this; keep it above the longest round"
    )
    check_interval_s: float = _learn(
        "check_interval_s", 10.0, gt=0, description="how often beat asks if a round is due"
    )
    min_feedback: int = _learn("min_feedback", 8, ge=1, description="new rated answers that make a round due")
    min_interval_s: float = _learn("min_interval_s", 60.0, ge=0, description="at least this long between rounds")
    scope: Literal["base", "personal"] = _learn(
        "scope",
        "base",
        description="base: a round trains the shared model; personal: every user's and cohort's LoRA adapter "
        "with enough new ratings [TANDEM_ADAPTER_*] (docs/adapters.md)",
    )
    learning_rate: float = _learn("learning_rate", 1e-6, gt=0)
    steps: int = _learn("steps", 1, ge=1)
    threads: int = _learn("threads", 0, ge=0, description="torch CPU threads for training; 0 = torch's default")
    train_timeout_s: float = _learn("train_timeout_s", 3600.0, gt=0)
    reward: Literal["feedback", "reward_model", "judge", "custom"] = _learn(
        "reward",
        "feedback",
        description="feedback: train on rated answers; the others score rollouts (docs/rewards.md)",
    )
    reward_path: str | None = _learn("reward_path", None, description="custom reward, 'package.module:function'")
    baseline: Literal["user", "global"] = _learn("baseline", "user", description="what a lone rating is compared with")
    samples_per_prompt: int = _learn("samples_per_prompt", 4, ge=1, le=64, description="rollouts per rated prompt")
    rollout_max_tokens: int = _learn("rollout_max_tokens", 128, ge=1)
    save_batch_dir: Path | None = _learn("save_batch_dir", None, description="save each round's batch (tandem replay)")
    kl_coef: float = _learn("kl_coef", 0.0, ge=0, description="KL loss to the lineage's first model (0: off)")
    kl_type: Literal["k1", "k2", "k3", "low_var_kl"] = _learn("kl_type", "low_var_kl")
    canary_share: float = _learn(
        "canary_share",
        0.0,
        ge=0,
        lt=1,
        description="a new base version serves this share of sessions first, from part of the engine pool (0: none)",
    )
    optimizer_offload: bool = _learn(
        "optimizer_offload", False, description="keep AdamW's state on the host (torch backend): less device memory"
    )
    qat: Literal["off", "int4"] = _learn(
        "qat",
        "off",
        description="int4: train through fake INT4 weights (torch backend); pair with rollout_weights=int4",
    )
    qat_group_size: Literal[32, 64, 128] = _learn("qat_group_size", 128, description="INT4 group size of qat")
    rollout_weights: Literal["same", "fp8", "int4"] = _learn(
        "rollout_weights",
        "same",
        description="fp8 / int4: serve each new version as a quantized copy (training stays in full precision)",
    )
    drift_guard: Literal["on", "off"] = _learn(
        "drift_guard", "on", description="stop a drifting round, pause its schedule"
    )
    drift_max_kl: float = _learn("drift_max_kl", 1.0, gt=0, description="KL to the lineage root per batch token")
    drift_min_entropy_ratio: float = _learn("drift_min_entropy_ratio", 0.25, ge=0, lt=1)
    drift_grad_spike: float = _learn("drift_grad_spike", 20.0, gt=1, description="x the round's median grad norm")
    drift_max_length_change: float = _learn("drift_max_length_change", 3.0, gt=1)
    max_user_share: float = _learn("max_user_share", 0.25, gt=0, le=1, description="one user's weight in a base round")
    min_agreement: float = _learn("min_agreement", 0.5, ge=0, le=1, description="below: a user is down-weighted")
    min_shared_prompts: int = _learn("min_shared_prompts", 5, ge=1, description="before agreement is judged")
    disagreeing_weight: float = _learn("disagreeing_weight", 0.25, ge=0, le=1)
    custom_loss_path: str | None = _learn("custom_loss_path", None, description="a loss replacing the built-in")
    # slime's algorithm and plugin flags (docs/slime.md maps each to its slime name)
    advantage_estimator: Literal[
        "grpo", "gspo", "cispo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "ppo"
    ] = _learn("advantage_estimator", "grpo", description="slime's --advantage-estimator")
    normalize_advantages: bool = _learn("normalize_advantages", False, description="slime's --normalize-advantages")
    reward_kl_coef: float = _learn("reward_kl_coef", 0.0, ge=0, description="KL in the reward (slime's --kl-coef)")
    gamma: float = _learn("gamma", 1.0, ge=0, le=1, description="REINFORCE++'s and PPO's discount (slime's --gamma)")
    lambd: float = _learn("lambd", 1.0, ge=0, le=1, description="PPO's GAE lambda (slime's --lambd)")
    value_clip: float = _learn("value_clip", 0.2, gt=0, description="PPO's value clip (slime's --value-clip)")
    critic_lr: float = _learn("critic_lr", 1e-3, gt=0, description="PPO's value head learning rate")
    use_opd: bool = _learn("use_opd", False, description="on-policy distillation from samples' teacher log-probs")
    opd_kl_coef: float = _learn("opd_kl_coef", 1.0, ge=0, description="slime's --opd-kl-coef")
    reward_key: str | None = _learn("reward_key", None, description="the scalar of a dict reward (slime's)")
    reward_batched: bool = _learn("reward_batched", False, description="the reward plugin scores a group (--group-rm)")
    custom_generate_path: str | None = _learn("custom_generate_path", None, description="slime's generate plugin")
    rollout_path: str | None = _learn("rollout_path", None, description="slime's --rollout-function-path")
    routing_replay: bool = _learn(
        "routing_replay",
        False,
        description="MoE models: rollouts record their routed experts and training replays them (R3; torch backend)",
    )
    eval_rollout_path: str | None = _learn("eval_rollout_path", None, description="slime's --eval-function-path")
    dynamic_filter_path: str | None = _learn("dynamic_filter_path", None, description="slime's dynamic filter")
    buffer_filter_path: str | None = _learn("buffer_filter_path", None, description="slime's --buffer-filter-path")
    reward_post_process_path: str | None = _learn(
        "reward_post_process_path", None, description="slime's reward post-process"
    )
    custom_advantage_path: str | None = _learn("custom_advantage_path", None, description="slime's advantage function")
    custom_pg_reducer_path: str | None = _learn("custom_pg_reducer_path", None, description="slime's pg-loss reducer")
    backend: Literal["torch", "megatron"] = _learn("backend", "torch", description="trainer backend (docs/megatron.md)")
    max_tokens_per_device: int = _learn("max_tokens_per_device", 4096, ge=1, description="micro-batch token cap")
    megatron: dict[str, Any] = _learn(
        "megatron",
        default_factory=dict,
        description='megatron layout as JSON, e.g. {"tensor_parallel": 2, "recompute": "full"} (docs/megatron.md)',
    )
    round_heartbeat_s: float = Field(30.0, gt=0)
    round_stale_timeout_s: float = Field(300.0, gt=0, description="a running round silent this long is failed")

    @model_validator(mode="after")
    def _stale_after_missed_beats(self) -> LearnerSettings:
        if self.round_stale_timeout_s <= 2 * self.round_heartbeat_s:
            raise ValueError("round_stale_timeout_s must exceed two round heartbeats (round_heartbeat_s)")
        return self


class EvaluationSettings(_Group):
    """The evaluation gate before a new version is promoted (docs/evaluation.md; ``TANDEM_EVAL_*``)."""

    gate: Literal["on", "off"] = _eval("gate", "on", description="off: no evaluation, no holdout, always roll out")
    margin: float = _eval("margin", 0.05, ge=0, description="promote when candidate >= serving score - this")
    prompts: Path | None = _eval("prompts", None, description="JSONL eval prompts; unset: held-out rated traffic")
    holdout_fraction: float = _eval("holdout_fraction", 0.1, ge=0, lt=1, description="prompts never trained on")
    max_samples: int = _eval("max_samples", 64, ge=1, description="latest held-out rated answers evaluated")
    fn_path: str | None = _eval("fn_path", None, description="eval function 'module:function'; unset: loglik margin")
    temperature: float = _eval("temperature", 0.7, ge=0)
    top_p: float = _eval("top_p", 1.0, gt=0, le=1)
    max_tokens: int = _eval("max_tokens", 128, ge=1)
    samples_per_prompt: int = _eval("samples_per_prompt", 1, ge=1, le=64)
    seed: int = _eval("seed", 0)
    every_steps: int = _eval("every_steps", 0, ge=0, description="also evaluate every N optimizer steps")
    timeout_s: float = _eval("timeout_s", 1800.0, gt=0)
    guard: Literal["on", "off"] = _eval("guard", "on", description="the capability guard (docs/evaluation.md)")
    guard_set: Path | None = _eval("guard_set", None, description="capability set JSONL; unset: the shipped one")
    guard_user_prompts: int = _eval("guard_user_prompts", 8, ge=0, description="held-out prompts answered too")
    guard_max_tokens: int = _eval("guard_max_tokens", 48, ge=1, description="tokens per guard answer")
    guard_max_loglik_drop: float = _eval("guard_max_loglik_drop", 0.3, ge=0, description="reference answers, per token")
    guard_max_kl: float = _eval("guard_max_kl", 0.2, ge=0, description="KL to the lineage root, per sampled token")
    guard_min_length_ratio: float = _eval("guard_min_length_ratio", 0.5, ge=0)
    guard_max_length_ratio: float = _eval("guard_max_length_ratio", 2.5, ge=0)
    guard_max_distinct_2_drop: float = _eval("guard_max_distinct_2_drop", 0.15, ge=0)
    guard_max_loop_rise: float = _eval("guard_max_loop_rise", 0.15, ge=0)
    guard_max_echo_rise: float = _eval("guard_max_echo_rise", 0.1, ge=0)
    guard_max_empty_rise: float = _eval("guard_max_empty_rise", 0.05, ge=0)


class ObservabilitySettings(_Group):
    """Logs and round metrics."""

    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"
    log_format: Literal["auto", "json", "console"] = Field(
        "auto", description="auto: readable lines on a terminal, JSON otherwise (a file, a pipe, a log shipper)"
    )
    tensorboard_dir: Path | None = Field(None, description="round metrics event files; default: data_dir/tensorboard")
    wandb_project: str = Field("", description="W&B project for round metrics; empty: W&B off")
    wandb_mode: Literal["online", "offline", "disabled"] = "online"

    @field_validator("wandb_project")
    @classmethod
    def _wandb_installed(cls, value: str) -> str:
        if value and importlib.util.find_spec("wandb") is None:
            raise ValueError("wandb_project is set but wandb is not installed: pip install 'tandem[wandb]'")
        return value


def _adapter(name: str, default: Any = ..., **kwargs: Any) -> Any:
    return flat(f"adapter_{name}", default, **kwargs)


class AdapterSettings(_Group):
    """Per-user and per-cohort LoRA adapters (``TANDEM_ADAPTER_*``, docs/adapters.md)."""

    enabled: bool = _adapter("enabled", True, description="serve each user's, cohort's or tenant's adapter")
    disabled_tenants: list[str] = _adapter(
        "disabled_tenants", default_factory=list, description="tenants served by the base alone"
    )
    refresh_s: float = _adapter(
        "refresh_s",
        5.0,
        gt=0,
        description="how often a gateway rereads which adapters serve (its own changes: at once)",
    )
    cache_bytes: int = _adapter("cache_bytes", 256 << 20, ge=0, description="local engine: resident adapters' bytes")
    max_loaded: int = _adapter("max_loaded", 8, ge=1, description="SGLang: adapters resident per replica")
    rank: int = _adapter("rank", 16, ge=1)
    alpha: int = _adapter("alpha", 32, ge=1)
    dropout: float = _adapter("dropout", 0.0, ge=0, lt=1)
    target_modules: list[str] = _adapter(
        "target_modules",
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    )
    min_ratings: int = _adapter("min_ratings", 8, ge=1, description="new ratings of a scope before it trains")
    learning_rate: float = _adapter("learning_rate", 1e-3, gt=0)
    steps: int = _adapter("steps", 4, ge=1, description="optimizer steps per scope per round")
    scopes_per_pass: int = _adapter(
        "scopes_per_pass", 8, ge=1, description="adapters trained together in one pass (1: one child per scope)"
    )
    # Canary rollouts (docs/adapters.md): a new adapter first serves a share of its scope's sessions.
    canary_share: float = _adapter(
        "canary_share", 0.0, ge=0, lt=1, description="share of a scope's sessions a new adapter serves first (0: none)"
    )
    canary_min_ratings: int = _adapter("canary_min_ratings", 20, ge=1, description="rated answers per side first")
    canary_margin: float = _adapter(
        "canary_margin", 0.05, ge=0, lt=1, description="thumbs-up rate the canary may trail the control by"
    )
    canary_confidence: float = _adapter(
        "canary_confidence", 0.95, gt=0.5, lt=1, description="posterior probability a decision needs"
    )
    canary_max_duration_s: float = _adapter(
        "canary_max_duration_s", 86400.0, gt=0, description="undecided after this long: rolled back"
    )
    canary_check_s: float = _adapter("canary_check_s", 30.0, gt=0, description="how often a gateway judges canaries")


GROUPS: dict[str, type[_Group]] = {
    "server": ServerSettings,
    "engine": EngineSettings,
    "routing": RoutingSettings,
    "storage": StorageSettings,
    "learner": LearnerSettings,
    "evaluation": EvaluationSettings,
    "observability": ObservabilitySettings,
    "adapters": AdapterSettings,
}


def _flat_name(name: str, info: FieldInfo) -> str:
    return info.serialization_alias or name


FLAT_NAMES: dict[str, str] = {
    _flat_name(name, info): group for group, model in GROUPS.items() for name, info in model.model_fields.items()
}
"""Every flat setting name (``TANDEM_<NAME>`` lower-cased) -> the group that holds it."""


def _nest(data: dict[str, Any], into: dict[str, Any] | None = None) -> dict[str, Any]:
    """Flat names into their groups, merged over ``into``; a whole group (a dict or model under a
    group's name: "engine" is also a flat name, of a string) merges as it is."""
    nested = dict(into or {})
    for key, value in data.items():
        if key in GROUPS and isinstance(value, dict | BaseModel):
            given = value.model_dump(by_alias=True) if isinstance(value, BaseModel) else value
            nested[key] = {**nested.get(key, {}), **given}
        elif key in FLAT_NAMES:
            group = FLAT_NAMES[key]
            nested[group] = {**nested.get(group, {}), key: value}
        else:
            nested[key] = value  # refused by extra="forbid": an unknown setting
    return nested


class _FlatEnvironment(PydanticBaseSettingsSource):
    """``TANDEM_<FLAT NAME>`` variables (case-insensitive), as flat names; JSON for dict and list fields."""

    def get_field_value(self, field: FieldInfo, field_name: str) -> tuple[Any, str, bool]:
        return None, field_name, False  # unused: __call__ reads every variable at once

    def __call__(self) -> dict[str, Any]:
        environ = {key.upper(): value for key, value in os.environ.items()}
        found: dict[str, Any] = {}
        for model in GROUPS.values():
            for name, info in model.model_fields.items():
                key = _flat_name(name, info)
                raw = environ.get(ENV_PREFIX + key.upper())
                if raw is not None:
                    found[key] = _decode(raw, info, ENV_PREFIX + key.upper())
        return found


def _decode(raw: str, info: FieldInfo, variable: str) -> Any:
    origin = get_origin(info.annotation) or info.annotation
    if origin is dict:
        try:
            return json.loads(raw)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{variable} must be a JSON object: {exc}") from exc
    if origin is list:
        try:
            return json.loads(raw)
        except json.JSONDecodeError:
            return raw  # a comma-separated list, split by the field's validator
    return raw


class Settings(BaseSettings):
    """Everything tandem reads from its environment, validated once at start-up, in groups."""

    model_config = SettingsConfigDict(toml_file=os.environ.get("TANDEM_CONFIG"), extra="forbid", frozen=True)

    server: ServerSettings = Field(default_factory=ServerSettings)
    engine: EngineSettings = Field(default_factory=EngineSettings)
    routing: RoutingSettings = Field(default_factory=RoutingSettings)
    storage: StorageSettings = Field(default_factory=StorageSettings)
    learner: LearnerSettings = Field(default_factory=LearnerSettings)
    evaluation: EvaluationSettings = Field(default_factory=EvaluationSettings)
    observability: ObservabilitySettings = Field(default_factory=ObservabilitySettings)
    adapters: AdapterSettings = Field(default_factory=AdapterSettings)

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        return init_settings, _FlatEnvironment(settings_cls), TomlConfigSettingsSource(settings_cls)

    @model_validator(mode="before")
    @classmethod
    def _group_flat_names(cls, data: Any) -> Any:
        return _nest(data) if isinstance(data, dict) else data

    # ---- derived values that span groups ----

    @property
    def resolved_database_url(self) -> str:
        return self.storage.resolved_database_url

    @property
    def resolved_tensorboard_dir(self) -> Path:
        return self.observability.tensorboard_dir or self.storage.data_dir / "tensorboard"

    @property
    def local_server_url(self) -> str:
        """The gateway's URL from this machine (a wildcard bind is reached on loopback)."""
        host = self.server.host
        host = "127.0.0.1" if host in ("", "0.0.0.0") else "[::1]" if host == "::" else host
        if ":" in host and not host.startswith("["):
            host = f"[{host}]"
        return f"http://{host}:{self.server.port}"

    def with_overrides(self, **overrides: object) -> Settings:
        """A copy with the flags that were given, by flat name (None means not given)."""
        given = {k: v for k, v in overrides.items() if v is not None}
        return self.model_validate(_nest(given, into=self.model_dump(by_alias=True))) if given else self
