"""The Megatron backend's parallel and memory settings, checked when they are made.

Pure data (no megatron-core import), so settings, ``TrainConfig`` and the training request can carry
it. Two checks: ``MegatronConfig`` itself refuses combinations that can never run (sizes that do not
divide the device count, sequence parallel without tensor parallel, CPU offload without the
distributed optimizer...); ``check_model`` refuses sizes that do not fit a given model (heads,
KV groups, layers, experts, vocabulary). Both report every problem at once.

Role overrides: ``roles`` maps a role (``actor``, ``critic``, ``reference``) to field overrides, so
a PPO critic or the frozen reference can use other memory settings than the actor (recompute, bf16,
micro-batch size, optimizer sharding and offload) while sharing the rest; the parallel layout is
shared, since every role lives in the same process groups. ``for_role`` resolves one, and every
role is checked when the config is made.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

__all__ = ["ROLES", "MegatronConfig", "Recompute", "Role", "check_model"]

Recompute = Literal["none", "selective", "full"]
Role = Literal["actor", "critic", "reference"]
ROLES: tuple[str, ...] = get_args(Role)
_PREFIX = "invalid megatron config: "
# Every role runs in the same processes and megatron process groups: a role may change how it uses
# memory (recompute, bf16, micro-batch size, optimizer sharding), not the layout.
_NOT_OVERRIDABLE = frozenset(
    {
        "roles",
        "devices",
        "tensor_parallel",
        "pipeline_parallel",
        "context_parallel",
        "expert_parallel",
        "sequence_parallel",
    }
)


@dataclass(frozen=True, slots=True)
class MegatronConfig:
    """How the Megatron backend lays a model out over ``devices`` processes (one per GPU).

    Data parallel size is ``devices / (tensor_parallel * pipeline_parallel * context_parallel)``;
    experts are split ``expert_parallel`` ways (times tensor parallel) within each pipeline stage.

    ``max_tokens_per_device``: the token cap of one micro-batch on one device (slime's
    ``--max-tokens-per-gpu``); None: the train config's ``max_tokens_per_micro_batch``.
    """

    tensor_parallel: int = 1
    pipeline_parallel: int = 1
    context_parallel: int = 1
    expert_parallel: int = 1
    sequence_parallel: bool = False
    distributed_optimizer: bool = False
    optimizer_cpu_offload: bool = False
    # Of the optimizer state, the share on the host with optimizer_cpu_offload (megatron's hybrid
    # optimizer steps the rest on the GPU): below 1 when the GPU has room, as the host step is slower.
    optimizer_offload_fraction: float = 1.0
    recompute: Recompute = "none"
    recompute_num_layers: int = 1  # with recompute="full": layers per recomputed chunk
    bf16: bool = False
    max_tokens_per_device: int | None = None
    devices: int = 1
    roles: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        errors = self._errors()
        for role, overrides in self.roles.items():
            if role not in ROLES:
                errors.append(f"unknown role {role!r} in roles (known: {', '.join(ROLES)})")
                continue
            unknown = sorted(set(overrides) - set(_overridable()))
            if unknown:
                errors.append(f"roles.{role}: cannot override {unknown} (overridable: {', '.join(_overridable())})")
                continue
            try:
                dataclasses.replace(self, **overrides, roles={})
            except ValueError as exc:
                errors.append(f"roles.{role}: {str(exc).removeprefix(_PREFIX)}")
        if errors:
            raise ValueError(_PREFIX + "; ".join(errors))

    def _errors(self) -> list[str]:
        errors = []
        sizes = {
            "tensor_parallel": self.tensor_parallel,
            "pipeline_parallel": self.pipeline_parallel,
            "context_parallel": self.context_parallel,
            "expert_parallel": self.expert_parallel,
            "devices": self.devices,
            "recompute_num_layers": self.recompute_num_layers,
        }
        too_small = [f"{name}={value}" for name, value in sizes.items() if not (isinstance(value, int) and value >= 1)]
        if too_small:
            return [f"sizes must be integers >= 1 ({', '.join(too_small)})"]
        model_parallel = self.tensor_parallel * self.pipeline_parallel * self.context_parallel
        if self.devices % model_parallel:
            errors.append(
                f"devices={self.devices} is not a multiple of tensor_parallel x pipeline_parallel x "
                f"context_parallel = {self.tensor_parallel} x {self.pipeline_parallel} x "
                f"{self.context_parallel} = {model_parallel}"
            )
        expert_group = self.expert_parallel * self.tensor_parallel * self.pipeline_parallel
        if self.devices % expert_group:
            errors.append(
                f"devices={self.devices} is not a multiple of expert_parallel x tensor_parallel x "
                f"pipeline_parallel = {expert_group} (experts are split within each pipeline stage)"
            )
        if self.sequence_parallel and self.tensor_parallel == 1:
            errors.append("sequence_parallel needs tensor_parallel > 1 (it splits the tensor-parallel activations)")
        if self.sequence_parallel and not any(importlib.util.find_spec(m) for m in ("transformer_engine", "apex")):
            errors.append(
                "sequence_parallel needs TransformerEngine or Apex: without them megatron-core's layer spec "
                "uses torch's RMSNorm, which refuses sequence parallel"
            )
        if self.optimizer_cpu_offload and not self.distributed_optimizer:
            errors.append("optimizer_cpu_offload needs distributed_optimizer (megatron offloads the sharded state)")
        if not 0.0 < self.optimizer_offload_fraction <= 1.0:
            errors.append(f"optimizer_offload_fraction must be in (0, 1], got {self.optimizer_offload_fraction}")
        if self.recompute not in get_args(Recompute):
            errors.append(f"recompute must be one of {get_args(Recompute)}, got {self.recompute!r}")
        if self.recompute != "full" and self.recompute_num_layers != 1:
            errors.append("recompute_num_layers applies only to recompute='full'")
        if self.max_tokens_per_device is not None and self.max_tokens_per_device < 1:
            errors.append(f"max_tokens_per_device must be >= 1, got {self.max_tokens_per_device}")
        return errors

    def custom_loss_refusal(self) -> str | None:
        """Why a CUSTOM_LOSS plugin cannot train with this layout; None when it can."""
        if self.context_parallel > 1:
            return (
                "a CUSTOM_LOSS plugin (custom_loss_path) cannot run with context_parallel > 1: its contract "
                "hands it the [T, V] logits of the whole packed row, and under context parallel each rank "
                "has the logits of its part of the row only (the built-in losses gather per-token log-probs "
                "and entropy instead)"
            )
        return None

    @property
    def data_parallel(self) -> int:
        return self.devices // (self.tensor_parallel * self.pipeline_parallel * self.context_parallel)

    def for_role(self, role: Role) -> MegatronConfig:
        """This config with ``role``'s overrides applied (the shared settings when it has none)."""
        if role not in ROLES:
            raise ValueError(f"unknown role {role!r} (known: {', '.join(ROLES)})")
        return dataclasses.replace(self, **self.roles.get(role, {}), roles={})

    def to_dict(self) -> dict[str, Any]:
        data = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        data["roles"] = {role: dict(overrides) for role, overrides in self.roles.items()}
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> MegatronConfig:
        """Build from plain data (settings, JSON), refusing unknown keys by name."""
        unknown = sorted(set(data) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise ValueError(f"invalid megatron config: unknown keys {unknown}")
        return cls(**data)


def _overridable() -> list[str]:
    return [f.name for f in dataclasses.fields(MegatronConfig) if f.name not in _NOT_OVERRIDABLE]


def check_model(config: MegatronConfig, hf_config: Any) -> None:
    """Refuse a layout that does not fit the model ``hf_config`` describes (a transformers config).

    Raises:
        ValueError: every mismatch, e.g. attention heads not divisible by tensor_parallel.
    """
    tp, pp, ep = config.tensor_parallel, config.pipeline_parallel, config.expert_parallel
    heads = hf_config.num_attention_heads
    groups = getattr(hf_config, "num_key_value_heads", None) or heads
    layers = hf_config.num_hidden_layers
    experts = getattr(hf_config, "num_experts", None) or getattr(hf_config, "n_routed_experts", None) or 0
    checks = [
        (heads % tp == 0, f"num_attention_heads={heads} is not divisible by tensor_parallel={tp}"),
        (groups % tp == 0, f"num_key_value_heads={groups} is not divisible by tensor_parallel={tp}"),
        (hf_config.vocab_size % tp == 0, f"vocab_size={hf_config.vocab_size} is not divisible by tensor_parallel={tp}"),
        (layers % pp == 0, f"num_hidden_layers={layers} is not divisible by pipeline_parallel={pp}"),
        (ep == 1 or experts > 0, f"expert_parallel={ep} needs a mixture-of-experts model"),
        (experts == 0 or experts % ep == 0, f"{experts} experts are not divisible by expert_parallel={ep}"),
    ]
    if getattr(hf_config, "kv_lora_rank", None):  # multi-latent attention splits its down-projections' rows too
        q_rank = hf_config.q_lora_rank or 0
        kv_rows = hf_config.kv_lora_rank + hf_config.qk_rope_head_dim
        checks += [
            (q_rank % tp == 0, f"q_lora_rank={q_rank} is not divisible by tensor_parallel={tp}"),
            (
                kv_rows % tp == 0,
                f"kv_lora_rank + qk_rope_head_dim = {kv_rows} is not divisible by tensor_parallel={tp}",
            ),
        ]
    errors = [message for ok, message in checks if not ok]
    if errors:
        raise ValueError(f"megatron layout does not fit the model: {'; '.join(errors)}")
