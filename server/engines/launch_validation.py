"""Loading and validating the engine-groups config.

Every problem is collected and raised together in one LaunchConfigError, so an operator fixes the file
in one pass; schema errors and rule errors come out side by side.
"""

from __future__ import annotations

import tomllib
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from server.engines.launch_config import (
    CPU_KV_CACHE_DTYPES,
    NEEDS_DRAFT_MODEL,
    ROUTER_FLAGS,
    ROUTER_POLICIES,
    SGLANG_FLAGS,
    TANDEM_FLAGS,
    GroupConfig,
    LaunchConfig,
    LaunchConfigError,
    RouterConfig,
    cpu_server_args,
)

M = TypeVar("M", bound=BaseModel)


def load_launch_config(path: str | Path, *, check_paths: bool = True) -> LaunchConfig:
    """Read and validate a TOML file.

    Raises:
        LaunchConfigError: unreadable file, invalid TOML, or one entry per invalid field or rule.
    """
    try:
        data = tomllib.loads(Path(path).read_text())
    except OSError as exc:
        raise LaunchConfigError([f"cannot read {path}: {exc.strerror}"]) from exc
    except tomllib.TOMLDecodeError as exc:
        raise LaunchConfigError([f"{path} is not valid TOML: {exc}"]) from exc
    return parse_launch_config(data, check_paths=check_paths)


def parse_launch_config(data: Mapping[str, Any], *, check_paths: bool = True) -> LaunchConfig:
    """Validate parsed TOML; ``check_paths=False`` skips the model folders' existence (for planning elsewhere)."""
    try:
        config = LaunchConfig.model_validate(data)
        errors: list[str] = []
    except ValidationError as exc:
        errors = _schema_errors(exc, data)
        # Keep checking what did parse, so rule errors are reported in the same pass.
        config = _salvage(data, exc)
    errors += check_config(config, check_paths=check_paths)
    if errors:
        raise LaunchConfigError(errors)
    return config


def check_config(config: LaunchConfig, *, check_paths: bool = True) -> list[str]:
    """The rule errors of a config whose fields are valid (empty when it can be launched)."""
    errors = [f"{_where(group)}: {message}" for group in config.groups for message in _group_errors(group, check_paths)]
    for rule in (_unique_names, _gpu_budget, _unique_ports, _disaggregation, _router_errors):
        errors += rule(config)
    return errors


def _where(group: GroupConfig) -> str:
    return f'group "{group.name}"'


def _schema_errors(exc: ValidationError, data: Mapping[str, Any]) -> list[str]:
    out = []
    for error in exc.errors():
        loc = list(error["loc"])
        if len(loc) >= 2 and loc[0] == "groups" and isinstance(loc[1], int):
            prefix, loc = _raw_group_label(data, loc[1]), loc[2:]
        else:
            prefix = ""
        field = ".".join(str(part) for part in loc)
        out.append(": ".join(part for part in (prefix, field, error["msg"]) if part))
    return out


def _raw_group_label(data: Mapping[str, Any], index: int) -> str:
    groups = data.get("groups")
    raw = groups[index] if isinstance(groups, list) and index < len(groups) else None
    name = raw.get("name") if isinstance(raw, dict) else None
    return f'group "{name}"' if isinstance(name, str) and name else f"groups[{index}]"


def _salvage(data: Mapping[str, Any], exc: ValidationError) -> LaunchConfig:
    """The invalid config with each bad field left out (so its default applies), for the rule checks."""
    locs = [error["loc"] for error in exc.errors()]

    def bad_fields(*prefix: Any) -> set[Any]:
        return {loc[len(prefix)] for loc in locs if loc[: len(prefix)] == prefix and len(loc) > len(prefix)}

    raw_groups = data.get("groups")
    groups = [_try(GroupConfig, raw, bad_fields("groups", index)) for index, raw in enumerate(_as_list(raw_groups))]
    return LaunchConfig.model_construct(
        gpus=None if "gpus" in bad_fields() else data.get("gpus"),
        groups=[group for group in groups if group is not None],
        router=_try(RouterConfig, data.get("router"), bad_fields("router")),
    )


def _as_list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else []


def _try(model: type[M], raw: Any, bad_fields: set[Any]) -> M | None:
    if not isinstance(raw, dict):
        return None
    try:
        return model.model_validate({key: value for key, value in raw.items() if key not in bad_fields})
    except ValidationError:
        return None


def _group_errors(group: GroupConfig, check_paths: bool) -> Iterator[str]:
    checks: tuple[Callable[[GroupConfig], Iterator[str]], ...] = (
        _parallel_errors, _role_errors, _speculative_errors, _cpu_errors, _tandem_errors, _extra_arg_errors,
    )  # fmt: skip
    for check in checks:
        yield from check(group)
    if check_paths:
        yield from _path_errors(group)


def _parallel_errors(group: GroupConfig) -> Iterator[str]:
    if group.device != "cuda" or group.engine != "sglang" or group.gpus_per_replica is None:
        return
    product = group.tp_size * (group.dp_size or 1)
    if product != group.gpus_per_replica:
        yield (
            f"gpus_per_replica: {group.gpus_per_replica} != tp_size {group.tp_size} x dp_size {group.dp_size or 1}"
            f" = {product}; SGLang uses exactly tp_size x dp_size GPUs"
        )


def _role_errors(group: GroupConfig) -> Iterator[str]:
    if group.role != "prefill" and group.bootstrap_port is not None:
        yield "bootstrap_port: only prefill servers run a bootstrap server"
    if group.role == "regular":
        for field in ("transfer_backend", "ib_device"):
            if getattr(group, field) is not None:
                yield f"{field}: only used by prefill/decode groups (role is regular)"
    elif group.transfer_backend is None:
        yield f"transfer_backend: a {group.role} group needs a KV transfer backend (mooncake, nixl, ...)"


def _speculative_errors(group: GroupConfig) -> Iterator[str]:
    spec = group.speculative
    if spec is None:
        return
    if spec.algorithm in NEEDS_DRAFT_MODEL and spec.draft_model_path is None:
        yield f"speculative.draft_model_path: {spec.algorithm} needs a draft model"
    if spec.algorithm == "NGRAM" and spec.draft_model_path is not None:
        yield "speculative.draft_model_path: NGRAM drafts from the context and takes no draft model"


def _cpu_errors(group: GroupConfig) -> Iterator[str]:
    if group.device != "cpu":
        return
    why = "needs GPUs (device is cpu)"
    if group.gpus_per_replica is not None:
        yield "gpus_per_replica: a cpu group uses no GPUs"
    if group.tp_size > 1:
        yield f"tp_size: tensor parallelism {why}"
    if group.quantization is not None:
        yield f"quantization: {group.quantization} {why}: the CPU path has no quantized kernels"
    if group.kv_cache_dtype not in (None, *CPU_KV_CACHE_DTYPES):
        yield f"kv_cache_dtype: {group.kv_cache_dtype} {why}; use auto or bf16"
    if group.role != "regular":
        yield f"role: prefill/decode disaggregation {why}"
    if group.speculative is not None:
        yield f"speculative: speculative decoding {why}"
    if group.lora is not None and group.lora.backend not in (None, "torch_native"):
        yield f"lora.backend: {group.lora.backend} {why}; torch_native runs on the CPU"


def _tandem_errors(group: GroupConfig) -> Iterator[str]:
    if group.engine != "tandem":
        return
    sglang_only = ("dp_size", "quantization", "kv_cache_dtype", "speculative", "max_total_tokens",
                   "mem_fraction_static", "context_length", "bootstrap_port", "transfer_backend", "ib_device",
                   "lora")  # fmt: skip
    for field in sglang_only:
        if getattr(group, field) is not None:
            yield f"{field}: SGLang-only option; the tandem engine does not take it"
    if group.tp_size != 1:
        yield "tp_size: the tandem engine runs on one device; tensor parallelism is SGLang-only"
    if group.gpus_per_replica not in (None, 1):
        yield "gpus_per_replica: the tandem engine uses one GPU per replica"
    if group.role != "regular":
        yield "role: prefill/decode disaggregation is SGLang-only"


def _extra_arg_errors(group: GroupConfig) -> Iterator[str]:
    owned = dict(TANDEM_FLAGS) if group.engine == "tandem" else dict(SGLANG_FLAGS)
    if group.engine == "sglang" and group.device == "cpu":
        # A field of its own (max_total_tokens, ...) is the better hint than the CPU defaults.
        owned = dict.fromkeys(_flags(cpu_server_args()), "device = cpu") | owned
    yield from (f"extra_args: {message}" for message in duplicate_flag_errors(group.extra_args, owned))
    if "CUDA_VISIBLE_DEVICES" in group.env:
        yield "env: CUDA_VISIBLE_DEVICES is assigned from gpus; do not set it"


def duplicate_flag_errors(extra_args: Sequence[str], owned: Mapping[str, str]) -> list[str]:
    """One message per extra argument that repeats a flag the builder sets (``--port``, ``--port=1``, or an
    abbreviation such as ``--mem-frac``, which SGLang's and the router's argparse accept)."""
    errors = []
    for flag in _flags(extra_args):
        target = flag if flag in owned else next((name for name in owned if name.startswith(flag)), None)
        if target is not None:
            spelled = flag if flag == target else f"{flag} (abbreviates {target})"
            errors.append(f"{spelled} is set by tandem from {owned[target]}; remove it")
    return errors


def _flags(args: Sequence[str]) -> list[str]:
    return [name for arg in args if arg.startswith("--") and len(name := arg.split("=", 1)[0]) > 2]


def _path_errors(group: GroupConfig) -> Iterator[str]:
    paths = {"model_path": group.model_path}
    if group.speculative is not None and group.speculative.draft_model_path is not None:
        paths["speculative.draft_model_path"] = group.speculative.draft_model_path
    for field, path in paths.items():
        if not Path(path).expanduser().is_dir():
            yield f"{field}: {path} is not a directory (hub ids are not downloaded; point at a local folder)"


def _unique_names(config: LaunchConfig) -> list[str]:
    names = [group.name for group in config.groups]
    return [
        f'group "{name}": name: used by {names.count(name)} groups'
        for name in sorted(set(names))
        if names.count(name) > 1
    ]


def _gpu_budget(config: LaunchConfig) -> list[str]:
    cuda = [group for group in config.groups if group.device == "cuda"]
    if not cuda:
        return []
    wanted = sum(group.gpus_needed * group.replicas for group in cuda)
    if config.gpus is None:
        names = ", ".join(f'"{group.name}"' for group in cuda)
        return [f"gpus: set the node's GPU count (top-level gpus = N); cuda groups {names} need {wanted}"]
    if wanted > config.gpus:
        parts = ", ".join(f'"{g.name}" {g.replicas} x {g.gpus_needed}' for g in cuda)
        return [f"gpus: the groups need {wanted} GPUs ({parts}) but the node has {config.gpus}"]
    return []


def _unique_ports(config: LaunchConfig) -> list[str]:
    owners: dict[int, list[str]] = {}
    for port, owner in _ports(config):
        owners.setdefault(port, []).append(owner)
    errors = [
        f"port {port} is used by {' and '.join(names)}" for port, names in sorted(owners.items()) if len(names) > 1
    ]
    errors += [f"port {port} ({names[0]}) is out of range 1-65535" for port, names in owners.items() if port > 65535]
    return errors


def _ports(config: LaunchConfig) -> Iterator[tuple[int, str]]:
    for group in config.groups:
        for index in range(group.replicas):
            yield group.port(index), f"{_where(group)} replica {index}"
            if group.role == "prefill":
                yield group.replica_bootstrap_port(index), f"{_where(group)} replica {index} bootstrap"
    if config.router is not None:
        yield config.router.port, "the router"
        yield config.router.prometheus_port, "the router's prometheus_port"


def _disaggregation(config: LaunchConfig) -> list[str]:
    split = [group for group in config.groups if group.role != "regular"]
    if not split:
        return []
    roles = {group.role for group in split}
    errors = [f"role: {have} groups need at least one {need} group" for have, need in
              (("prefill", "decode"), ("decode", "prefill")) if have in roles and need not in roles]  # fmt: skip
    if len(split) < len(config.groups):
        errors.append(
            "role: regular groups cannot be mixed with prefill/decode groups (the gateway uses the router only)"
        )
    for field in ("model_path", "transfer_backend"):
        values = {getattr(group, field) for group in split} - {None}  # a missing backend is reported per group
        if len(values) > 1:
            found = ", ".join(f'"{group.name}" {getattr(group, field)}' for group in split)
            errors.append(f"{field}: prefill and decode groups must share one {field} ({found})")
    if config.router is None:
        errors.append("router: prefill/decode groups need a [router] section")
    return errors


def _router_errors(config: LaunchConfig) -> list[str]:
    router = config.router
    if router is None:
        return []
    errors = []
    if not config.disaggregated:
        errors.append("router: only used for prefill/decode disaggregation; no group has role prefill or decode")
    choices = ROUTER_POLICIES[router.package]
    if router.policy not in choices:
        errors.append(f"router.policy: {router.policy!r} is not one of {router.package}'s {', '.join(choices)}")
    errors += [f"router.extra_args: {message}" for message in duplicate_flag_errors(router.extra_args, ROUTER_FLAGS)]
    return errors
