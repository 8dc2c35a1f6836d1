"""Launch plans for managed engine groups: the exact argv and environment of every server and router.

Pure: nothing is started here. The supervisor calls ``plan`` and ``router_launch`` and spawns the
results; the gateway routes over ``serving_urls``. Config models are in launch_config, loading and rules in launch_validation.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

from server.engines.launch_config import GroupConfig, LaunchConfig, LaunchConfigError, cpu_server_args
from server.engines.launch_validation import load_launch_config, parse_launch_config

__all__ = [
    "LaunchConfig",
    "LaunchConfigError",
    "ServerLaunch",
    "load_launch_config",
    "parse_launch_config",
    "plan",
    "router_launch",
    "serving_urls",
]


@dataclass(frozen=True)
class ServerLaunch:
    """One process to start. ``env`` holds only the additions to the supervisor's own environment."""

    group: str
    index: int
    url: str
    argv: tuple[str, ...]
    env: dict[str, str] = field(default_factory=dict)
    role: Literal["regular", "prefill", "decode", "router"] = "regular"


def plan(config: LaunchConfig, *, python: str) -> list[ServerLaunch]:
    """Every server of every group, in file order; GPUs are handed out in that same order.

    ``config`` must have passed validation (``load_launch_config``), which checks that the GPUs fit.
    ``python`` runs the servers of groups that name no interpreter (``Settings.sglang_interpreter``).
    """
    launches = []
    next_gpu = 0
    for group in config.groups:
        for index in range(group.replicas):
            gpus = range(next_gpu, next_gpu + group.gpus_needed) if group.device == "cuda" else range(0)
            next_gpu += len(gpus)
            launches.append(_server_launch(group, index, gpus, python))
    return launches


def router_launch(config: LaunchConfig, *, python: str) -> ServerLaunch | None:
    """The PD-disaggregation router over all prefill and decode servers; None when nothing is split."""
    router = config.router
    if router is None or not config.disaggregated:
        return None
    argv = [router.python or python, "-m", f"{router.package}.launch_router", "--pd-disaggregation"]
    for group in config.groups:
        for index in range(group.replicas):
            url = _url(group.host, group.port(index))
            if group.role == "prefill":
                argv += ["--prefill", url, str(group.replica_bootstrap_port(index))]
            elif group.role == "decode":
                argv += ["--decode", url]
    argv += ["--host", router.host, "--port", str(router.port), "--policy", router.policy]
    argv += ["--prometheus-port", str(router.prometheus_port), *router.extra_args]
    return ServerLaunch("router", 0, _url(router.host, router.port), tuple(argv), dict(router.env), "router")


def serving_urls(config: LaunchConfig) -> list[str]:
    """What the gateway routes over: the router alone when disaggregated, else every server."""
    if config.router is not None and config.disaggregated:
        return [_url(config.router.host, config.router.port)]
    return [_url(group.host, group.port(index)) for group in config.groups for index in range(group.replicas)]


def _server_launch(group: GroupConfig, index: int, gpus: Sequence[int], python: str) -> ServerLaunch:
    port = group.port(index)
    if group.engine == "tandem":
        argv, env = _tandem_argv(group, port), _tandem_env(group)
    else:
        argv, env = _sglang_argv(group, index, port, group.python or python), _sglang_env(group)
    if gpus:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, gpus))
    env |= group.env  # the operator's variables win (CUDA_VISIBLE_DEVICES is rejected by validation)
    return ServerLaunch(group.name, index, _url(group.host, port), tuple(argv), env, group.role)


def _url(host: str, port: int) -> str:
    # A wildcard bind is reachable on loopback; IPv6 literals need brackets in a URL.
    connect = {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(host, host)
    return f"http://[{connect}]:{port}" if ":" in connect else f"http://{connect}:{port}"


def _option(flag: str, value: object | None) -> list[str]:
    return [] if value is None else [flag, str(value)]


def _tandem_argv(group: GroupConfig, port: int) -> list[str]:
    python = group.python or sys.executable  # the tandem engine runs in tandem's own venv
    argv = [python, "-m", "tandem.cli", "engine", "--model", group.model_path, "--port", str(port)]
    return [*argv, "--host", group.host, *_option("--weight-version", group.weight_version), *group.extra_args]


def _tandem_env(group: GroupConfig) -> dict[str, str]:
    env: dict[str, str] = {"TANDEM_DEVICE": group.device}
    if group.served_model_name is not None:
        env["TANDEM_SERVED_MODEL_NAME"] = group.served_model_name
    return env


def _sglang_env(group: GroupConfig) -> dict[str, str]:
    if group.device != "cpu":
        return {}
    from server.engines.sglang_cpu.environment import cpu_environment

    return dict(cpu_environment({}))


def _sglang_argv(group: GroupConfig, index: int, port: int, python: str) -> list[str]:
    argv = [python, "-m", "sglang.launch_server", "--model-path", group.model_path]
    argv += ["--host", group.host, "--port", str(port), "--tp-size", str(group.tp_size), *_grammar_args(group)]
    argv += _option("--dp-size", group.dp_size)
    tuning = [
        *_option("--quantization", group.quantization),
        *_option("--kv-cache-dtype", group.kv_cache_dtype),
        *_option("--context-length", group.context_length),
        *_option("--max-total-tokens", group.max_total_tokens),
        *_option("--mem-fraction-static", group.mem_fraction_static),
    ]
    if group.device == "cpu":
        # The group's own memory settings replace the CPU defaults rather than repeat the flag.
        argv += _without_flags(cpu_server_args(), {arg for arg in tuning if arg.startswith("--")})
    argv += tuning
    argv += _option("--served-model-name", group.served_model_name)
    argv += _option("--weight-version", group.weight_version)
    return [
        *argv,
        *_speculative_args(group),
        *_lora_args(group),
        *_disaggregation_args(group, index),
        *group.extra_args,
    ]


def _grammar_args(group: GroupConfig) -> list[str]:
    """JSON as the local engine writes it: compact, since with any whitespace allowed a weak model pads
    the JSON until max_tokens cuts it off."""
    if group.grammar_backend == "none":
        return ["--grammar-backend", "none"]
    return ["--grammar-backend", group.grammar_backend, "--constrained-json-disable-any-whitespace"]


def _lora_args(group: GroupConfig) -> list[str]:
    lora = group.lora
    if lora is None:
        return []
    # On the CPU only torch_native runs (the others are Triton GPU kernels); the stand-in folder's
    # sitecustomize makes its pinned-memory staging a no-op there (sglang_cpu/sitecustomize.py).
    backend = lora.backend or ("torch_native" if group.device == "cpu" else None)
    return [
        "--enable-lora",
        "--max-lora-rank", str(lora.max_rank),
        "--lora-target-modules", *lora.target_modules,
        "--max-loras-per-batch", str(lora.max_loras_per_batch),
        *_option("--lora-backend", backend),
    ]  # fmt: skip


def _speculative_args(group: GroupConfig) -> list[str]:
    spec = group.speculative
    if spec is None:
        return []
    return [
        *_option("--speculative-algorithm", spec.algorithm),
        *_option("--speculative-draft-model-path", spec.draft_model_path),
        *_option("--speculative-num-steps", spec.num_steps),
        *_option("--speculative-eagle-topk", spec.eagle_topk),
        *_option("--speculative-num-draft-tokens", spec.num_draft_tokens),
    ]


def _disaggregation_args(group: GroupConfig, index: int) -> list[str]:
    if group.role == "regular":
        return []
    args = ["--disaggregation-mode", group.role, *_option("--disaggregation-transfer-backend", group.transfer_backend)]
    if group.role == "prefill":
        args += ["--disaggregation-bootstrap-port", str(group.replica_bootstrap_port(index))]
    return [*args, *_option("--disaggregation-ib-device", group.ib_device)]


def _without_flags(args: Sequence[str], flags: set[str]) -> list[str]:
    """``args`` minus each of ``flags`` and its value (the next item unless it is itself a flag)."""
    out: list[str] = []
    skip_value = False
    for arg in args:
        if skip_value and not arg.startswith("--"):
            skip_value = False
            continue
        skip_value = False
        if arg.split("=", 1)[0] in flags:
            skip_value = "=" not in arg
            continue
        out.append(arg)
    return out
