"""The engine-groups config file's schema: pydantic models, SGLang's choices, and the flags tandem owns.

Choices and flag names were checked against SGLang 0.5.23 (`sglang/srt/arg_groups/choices.py`,
`fields/*.py`, and its real argument parser) and sglang-router 0.3.2 / smg 1.13.0 (`router_args.py`).
Loading and the cross-field rules are in launch_validation.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

Role = Literal["regular", "prefill", "decode"]

# sglang/srt/arg_groups/choices.py QUANTIZATION_CHOICES (0.5.23).
QUANTIZATION_CHOICES = (
    "awq", "fp8", "mxfp8", "gptq", "gptq_marlin", "awq_marlin", "bitsandbytes", "gguf", "modelopt",
    "modelopt_fp8", "modelopt_fp4", "nvfp4_online", "modelopt_mixed", "petit_nvfp4", "w8a8_int8", "w8a8_fp8",
    "moe_wna16", "w4afp8", "mxfp4", "auto-round", "auto-round-int8", "compressed-tensors", "modelslim",
    "mxfp_w4a8", "quark", "quark_int4fp8_moe", "quark_mxfp4", "mlx_q4", "mlx_q8", "unquant", "humming",
)  # fmt: skip
# fields/model.py kv_cache_dtype choices; only these three need no low-precision GPU kernels.
KvCacheDtype = Literal["auto", "fp8_e5m2", "fp8_e4m3", "mxfp8", "bf16", "bfloat16", "nvfp4", "fp4_mx_block16"]
CPU_KV_CACHE_DTYPES = ("auto", "bf16", "bfloat16")
# choices.py DISAGG_TRANSFER_BACKEND_CHOICES.
TransferBackend = Literal["mooncake", "nixl", "ascend", "fake", "mori", "mooncake_tcp"]
# fields/lora.py --lora-backend choices; only torch_native runs without GPU kernels.
LoraBackend = Literal["triton", "csgmv", "ascend", "torch_native", "triton_v2"]
# Builtin names of `--speculative-algorithm` (NEXTN is SGLang's alias of EAGLE for built-in MTP layers).
SpeculativeAlgorithm = Literal["EAGLE", "EAGLE3", "NEXTN", "STANDALONE", "NGRAM"]
NEEDS_DRAFT_MODEL = ("EAGLE", "EAGLE3", "STANDALONE")
# launch_router --policy choices: sglang-router 0.3.2 and smg 1.13.0.
ROUTER_POLICIES = {
    "sglang_router": ("random", "round_robin", "cache_aware", "power_of_two", "manual"),
    "smg": ("random", "round_robin", "passthrough", "cache_aware", "power_of_two", "least_load", "manual",
            "consistent_hashing", "prefix_hash"),
}  # fmt: skip

# Flags the builders set, each with the setting it comes from. extra_args may not repeat them (nor
# their aliases or abbreviations): argparse would silently take whichever comes last.
SGLANG_FLAGS = {
    "--model-path": "model_path", "--model": "model_path", "--host": "host", "--port": "base_port",
    "--tp-size": "tp_size", "--tensor-parallel-size": "tp_size", "--dp-size": "dp_size",
    "--data-parallel-size": "dp_size", "--device": "device", "--base-gpu-id": "gpus (as CUDA_VISIBLE_DEVICES)",
    "--quantization": "quantization", "--kv-cache-dtype": "kv_cache_dtype", "--context-length": "context_length",
    "--max-total-tokens": "max_total_tokens", "--mem-fraction-static": "mem_fraction_static",
    "--served-model-name": "served_model_name", "--weight-version": "weight_version",
    "--speculative-algorithm": "speculative.algorithm", "--speculative-draft-model-path": "speculative.draft_model_path",
    "--speculative-draft-model": "speculative.draft_model_path", "--speculative-num-steps": "speculative.num_steps",
    "--speculative-eagle-topk": "speculative.eagle_topk", "--speculative-num-draft-tokens": "speculative.num_draft_tokens",
    "--disaggregation-mode": "role", "--disaggregation-transfer-backend": "transfer_backend",
    "--disaggregation-bootstrap-port": "bootstrap_port", "--disaggregation-ib-device": "ib_device",
    "--enable-lora": "lora", "--max-lora-rank": "lora.max_rank", "--lora-target-modules": "lora.target_modules",
    "--max-loras-per-batch": "lora.max_loras_per_batch", "--lora-backend": "lora.backend",
    "--grammar-backend": "grammar_backend", "--constrained-json-disable-any-whitespace": "grammar_backend",
}  # fmt: skip
TANDEM_FLAGS = {"--model": "model_path", "--host": "host", "--port": "base_port", "--weight-version": "weight_version"}
ROUTER_FLAGS = {
    "--host": "host", "--port": "port", "--policy": "policy", "--prometheus-port": "prometheus_port",
    "--pd-disaggregation": "the groups' roles", "--prefill": "the prefill groups", "--decode": "the decode groups",
}  # fmt: skip


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class SpeculativeConfig(_Strict):
    algorithm: SpeculativeAlgorithm
    draft_model_path: str | None = None
    num_steps: int | None = Field(default=None, ge=1)
    eagle_topk: int | None = Field(default=None, ge=1)
    num_draft_tokens: int | None = Field(default=None, ge=1)


class LoraConfig(_Strict):
    """SGLang's multi-LoRA serving, for the per-user and per-cohort adapters (docs/adapters.md). The
    gateway loads and unloads adapters at run time and bounds how many stay resident
    (``TANDEM_ADAPTER_MAX_LOADED``); these are the server's limits."""

    max_rank: int = Field(default=16, ge=1)  # the largest adapter rank the server takes
    target_modules: list[str] = Field(default_factory=lambda: ["all"], min_length=1)
    max_loras_per_batch: int = Field(default=8, ge=1)  # distinct adapters in one running batch
    backend: LoraBackend | None = None  # --lora-backend; None: SGLang's (csgmv), torch_native on the CPU


class GroupConfig(_Strict):
    name: str = Field(min_length=1)
    engine: Literal["sglang", "tandem"] = "sglang"
    model_path: str = Field(min_length=1)
    replicas: int = Field(default=1, ge=1)
    device: Literal["cuda", "cpu"] = "cuda"
    gpus_per_replica: int | None = Field(default=None, ge=1)
    tp_size: int = Field(default=1, ge=1)
    dp_size: int | None = Field(default=None, ge=1)
    host: str = Field(default="127.0.0.1", min_length=1)
    base_port: int = Field(default=30000, ge=1, le=65535)
    port_stride: int = Field(default=1, ge=1)
    python: str | None = None
    extra_args: list[str] = Field(default_factory=list)
    env: dict[str, str] = Field(default_factory=dict)
    role: Role = "regular"
    bootstrap_port: int | None = Field(default=None, ge=1, le=65535)
    transfer_backend: TransferBackend | None = None
    ib_device: str | None = None
    quantization: str | None = None
    kv_cache_dtype: KvCacheDtype | None = None
    # What enforces json_schema (tool_choice, response_format). llguidance, as in the local engine:
    # xgrammar, SGLang's default, let a small model write broken UTF-8 inside JSON strings.
    grammar_backend: Literal["llguidance", "xgrammar", "outlines", "none"] = "llguidance"
    speculative: SpeculativeConfig | None = None
    max_total_tokens: int | None = Field(default=None, ge=1)
    mem_fraction_static: float | None = Field(default=None, gt=0, lt=1)
    context_length: int | None = Field(default=None, ge=1)
    weight_version: str | None = None
    served_model_name: str | None = None
    lora: LoraConfig | None = None

    @field_validator("quantization")
    @classmethod
    def _known_quantization(cls, value: str | None) -> str | None:
        if value is not None and value not in QUANTIZATION_CHOICES:
            raise ValueError(f"unknown method {value!r}; SGLang 0.5.23 knows {', '.join(QUANTIZATION_CHOICES)}")
        return value

    @property
    def gpus_needed(self) -> int:
        """GPUs per replica: the explicit count, else tensor x data parallel size."""
        return self.gpus_per_replica or self.tp_size * (self.dp_size or 1)

    def port(self, index: int) -> int:
        return self.base_port + index * self.port_stride

    def replica_bootstrap_port(self, index: int) -> int:
        # 8998 is SGLang's --disaggregation-bootstrap-port default; each replica needs its own.
        return (self.bootstrap_port or 8998) + index * self.port_stride


class RouterConfig(_Strict):
    package: Literal["sglang_router", "smg"] = "sglang_router"
    python: str | None = None
    host: str = Field(default="127.0.0.1", min_length=1)
    port: int = Field(ge=1, le=65535)
    policy: str = "cache_aware"
    # Both routers bind a Prometheus port (default 29000); passed explicitly so it is port-checked.
    prometheus_port: int = Field(default=29000, ge=1, le=65535)
    extra_args: list[str] = Field(default_factory=list)
    env: dict[str, str] = Field(default_factory=dict)


class LaunchConfig(_Strict):
    gpus: int | None = Field(default=None, ge=0)
    groups: list[GroupConfig] = Field(min_length=1)
    router: RouterConfig | None = None

    @property
    def disaggregated(self) -> bool:
        return any(group.role != "regular" for group in self.groups)


class LaunchConfigError(ValueError):
    """Every problem found in an engine-groups config, one line each."""

    def __init__(self, errors: Sequence[str]) -> None:
        self.errors = list(errors)
        lines = "\n".join(f"  - {error}" for error in self.errors)
        super().__init__(f"{len(self.errors)} problem(s) in the engine groups config:\n{lines}")


def cpu_server_args() -> list[str]:
    # Imported lazily: the CPU module is only needed when a cpu group exists.
    from server.engines.sglang_cpu.environment import CPU_SERVER_ARGS

    return list(CPU_SERVER_ARGS)
