"""Plugins by dotted path: load once, check the signature at config time, call with the right form.

A plugin is named ``package.module:function`` (``package.module:Class.method`` works too) or, as in
slime's ``load_function``, ``package.module.function``. Every hook kind has an explicit entry in
``HOOKS`` giving the positional arguments it is called with, the keywords it is always or optionally
given, whether it must be ``async``, and what it returns. ``load_plugin`` checks a function against
that entry before the first round runs, so a wrong plugin fails at start-up with a message naming the
path and the expected signature, not halfway through a round.

slime's own import paths (``from slime.utils.types import Sample``, ``slime.utils.http_utils.post``,
``slime.rollout.sglang_rollout.GenerateState``, ...) resolve to ``learner/slime_compat``, tandem's
versions of them, put first on ``sys.path`` before a plugin is imported: slime users' plugin files
load unchanged.

Parameter names are not checked (slime's contract tests do): only what the call needs, i.e. that
the positional arguments bind, that required keyword-only parameters are none we do not pass, and
that always-passed keywords are accepted by name or by ``**kwargs``.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from types import MappingProxyType
from typing import Any

__all__ = [
    "HOOKS",
    "HookKind",
    "HookSpec",
    "Plugin",
    "PluginError",
    "load_function",
    "load_plugin",
    "load_plugins",
    "split_path",
    "use_slime_compat",
]


class PluginError(Exception):
    """A plugin that cannot be loaded, has the wrong signature, or returned the wrong shape."""


class HookKind(StrEnum):
    """Every extension point, by its configuration key."""

    REWARD = "reward"
    BATCHED_REWARD = "batched_reward"
    REWARD_POST_PROCESS = "reward_post_process"
    DYNAMIC_FILTER = "dynamic_filter"
    BUFFER_FILTER = "buffer_filter"
    CUSTOM_GENERATE = "custom_generate"
    ROLLOUT = "rollout"
    EVAL_ROLLOUT = "eval_rollout"
    CUSTOM_LOSS = "custom_loss"
    CUSTOM_TIS = "custom_tis"
    CUSTOM_ADVANTAGE = "custom_advantage"
    CUSTOM_PG_REDUCER = "custom_pg_reducer"
    EVAL = "eval"


@dataclass(frozen=True, slots=True)
class HookSpec:
    """How one kind of hook is called.

    Attributes:
        kind: the hook's key.
        positional: the arguments passed positionally, in order (names for messages only).
        keywords: keywords always passed; the function must accept each by name or ``**kwargs``.
        optional_keywords: keywords passed only when the function names them (slime passes
            ``evaluation`` to a custom generate function only when its signature has it).
        asynchronous: True: must be ``async def``; False: must not be; None: either.
        returns: the expected result, for messages.
        slime_flag: slime's flag for the same hook, for messages and docs.
    """

    kind: HookKind
    positional: tuple[str, ...]
    returns: str
    asynchronous: bool | None
    slime_flag: str
    keywords: tuple[str, ...] = ()
    optional_keywords: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        overlap = set(self.positional) & set(self.keywords + self.optional_keywords)
        if overlap:
            raise ValueError(f"{self.kind}: {sorted(overlap)} both positional and keyword")

    @property
    def signature(self) -> str:
        params = [*self.positional, *(f"{k}=..." for k in self.keywords + self.optional_keywords)]
        prefix = {True: "async ", False: "", None: "[async] "}[self.asynchronous]
        return f"{prefix}({', '.join(params)}) -> {self.returns}"


_SPECS = (
    HookSpec(HookKind.REWARD, ("args", "sample"), "float | dict", True, "--custom-rm-path"),
    HookSpec(
        HookKind.BATCHED_REWARD, ("args", "samples"), "list[float | dict]", True, "--custom-rm-path with --group-rm"
    ),
    HookSpec(
        HookKind.REWARD_POST_PROCESS,
        ("args", "samples"),
        "list[float] | (raw_rewards, rewards) | None (rewards set in place)",
        False,
        "--custom-reward-post-process-path",
    ),
    HookSpec(
        HookKind.DYNAMIC_FILTER,
        ("args", "samples"),
        "DynamicFilterOutput | bool",
        False,
        "--dynamic-sampling-filter-path",
    ),
    HookSpec(
        HookKind.BUFFER_FILTER,
        ("args", "rollout_id", "buffer", "num_samples"),
        "list[list[Sample]]",
        False,
        "--buffer-filter-path",
    ),
    HookSpec(
        HookKind.CUSTOM_GENERATE,
        ("args", "sample", "sampling_params"),
        "Sample | list[Sample]",
        True,
        "--custom-generate-function-path",
        optional_keywords=("evaluation",),
    ),
    HookSpec(
        HookKind.ROLLOUT,
        ("args", "rollout_id", "data_source"),
        "RolloutFnTrainOutput | list[list[Sample]]",
        None,
        "--rollout-function-path",
        keywords=("evaluation",),
    ),
    HookSpec(
        HookKind.EVAL_ROLLOUT,
        ("args", "rollout_id", "data_source"),
        "RolloutFnEvalOutput | dict",
        None,
        "--eval-function-path",
        keywords=("evaluation",),
    ),
    # The evaluation gate's metric: the reward function's contract, scoring a generated eval answer.
    HookSpec(HookKind.EVAL, ("args", "sample"), "float", True, "--custom-rm-path (as an eval metric)"),
    HookSpec(
        HookKind.CUSTOM_LOSS,
        ("args", "batch", "logits", "sum_of_sample_mean"),
        "(loss, metrics)",
        False,
        "--custom-loss-function-path",
    ),
    # slime's per-sample lists (response tokens only); pg_loss flat over them. Called with keywords.
    HookSpec(
        HookKind.CUSTOM_TIS,
        ("args",),
        "(pg_loss, loss_masks, metrics)",
        False,
        "--custom-tis-function-path",
        keywords=("pg_loss", "train_log_probs", "rollout_log_probs", "loss_masks", "total_lengths", "response_lengths"),
    ),
    # slime's rollout_data: per-sample lists (rewards, log_probs, ref_log_probs, kl, loss_masks, ...);
    # the function sets rollout_data["advantages"] and ["returns"] (one tensor per sample) in place.
    HookSpec(
        HookKind.CUSTOM_ADVANTAGE,
        ("args", "rollout_data"),
        "None (sets rollout_data['advantages'] and ['returns'])",
        False,
        "--custom-advantage-function-path",
    ),
    # Called per micro-batch; returns the reducer of pg_loss, over the responses' tokens end to end.
    HookSpec(
        HookKind.CUSTOM_PG_REDUCER,
        ("total_lengths", "response_lengths", "loss_masks", "calculate_per_token_loss"),
        "(values) -> scalar",
        False,
        "--custom-pg-loss-reducer-function-path",
    ),
)
HOOKS: Mapping[HookKind, HookSpec] = MappingProxyType({spec.kind: spec for spec in _SPECS})


@dataclass(frozen=True, slots=True)
class Plugin:
    """A loaded function that passed its kind's signature check."""

    kind: HookKind
    path: str
    fn: Callable[..., Any]
    is_async: bool
    accepted_optional: frozenset[str]

    @property
    def spec(self) -> HookSpec:
        return HOOKS[self.kind]

    def call(self, *args: Any, **kwargs: Any) -> Any:
        """Call the function, leaving out optional keywords it does not name."""
        passed = {
            k: v for k, v in kwargs.items() if k not in self.spec.optional_keywords or k in self.accepted_optional
        }
        return self.fn(*args, **passed)

    def error(self, problem: str) -> PluginError:
        """A PluginError about this plugin (for call wrappers that check results)."""
        return PluginError(f"{self.kind} plugin {self.path!r}: {problem}; expected {self.spec.signature}")


def split_path(path: str) -> tuple[str, str]:
    """``'pkg.mod:fn'`` or slime's ``'pkg.mod.fn'`` -> ``('pkg.mod', 'fn')``; the attribute may be dotted.

    Raises:
        PluginError: an empty part, spaces, or more than one ``:``.
    """
    if not path or path != path.strip() or " " in path:
        raise PluginError(f"plugin path {path!r}: expected 'package.module:function'")
    if path.count(":") > 1:
        raise PluginError(f"plugin path {path!r}: more than one ':'")
    if ":" in path:
        module, _, attr = path.partition(":")
    else:
        module, _, attr = path.rpartition(".")
    if not module or not attr or "" in module.split(".") or "" in attr.split("."):
        raise PluginError(f"plugin path {path!r}: expected 'package.module:function' or 'package.module.function'")
    return module, attr


SLIME_COMPAT = Path(__file__).with_name("slime_compat")


def use_slime_compat() -> None:
    """Put tandem's ``slime`` modules first on ``sys.path`` (once), ahead of any installed slime,
    whose ``Sample`` the learner could not take."""
    if str(SLIME_COMPAT) not in sys.path:
        sys.path.insert(0, str(SLIME_COMPAT))


@functools.cache
def load_function(path: str) -> Any:
    """The object at ``path``, imported once (failures are not cached, so a fixed module loads).

    Raises:
        PluginError: the module cannot be imported or has no such attribute.
    """
    module_name, attr = split_path(path)
    use_slime_compat()
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # user code: any import-time error is a config error to report
        raise PluginError(f"plugin path {path!r}: cannot import {module_name!r}: {type(exc).__name__}: {exc}") from exc
    obj: Any = module
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError as exc:
            raise PluginError(f"plugin path {path!r}: {module_name!r} has no attribute {attr!r}") from exc
    return obj


def _is_async(fn: Callable[..., Any]) -> bool:
    # an object with ``async def __call__`` is async too, though iscoroutinefunction says no
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(type(fn).__call__)


def _signature_problems(sig: inspect.Signature, spec: HookSpec) -> list[str]:
    params = list(sig.parameters.values())
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    has_var_positional = any(p.kind is p.VAR_POSITIONAL for p in params)
    has_var_keyword = any(p.kind is p.VAR_KEYWORD for p in params)
    by_keyword = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    n = len(spec.positional)
    passed = set(spec.keywords) | set(spec.optional_keywords)
    problems = []
    if len(positional) < n and not has_var_positional:
        problems.append(f"takes {len(positional)} positional parameters, is called with {n}")
    # parameters after the first n are filled only by the keywords we pass, or by their defaults
    for p in [*positional[n:], *(p for p in params if p.kind is p.KEYWORD_ONLY)]:
        if p.default is p.empty and p.name not in passed:
            problems.append(f"requires {p.name!r}, which is never passed")
    for p in positional[:n]:
        if p.name in passed:
            problems.append(f"its positional parameter {p.name!r} would also be passed by keyword")
    for name in spec.keywords:
        if name not in by_keyword and not has_var_keyword:
            problems.append(f"does not accept the keyword {name!r}")
    return problems


def _check(obj: Any, path: str, spec: HookSpec) -> Plugin:
    def fail(problem: str) -> PluginError:
        return PluginError(f"{spec.kind} plugin {path!r}: {problem}; expected {spec.signature}")

    if not callable(obj):
        raise fail(f"is a {type(obj).__name__}, not callable")
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError) as exc:
        raise fail(f"its signature cannot be read ({exc})") from exc
    is_async = _is_async(obj)
    if spec.asynchronous is True and not is_async:
        raise fail("must be 'async def'")
    if spec.asynchronous is False and is_async:
        raise fail("must be a plain function, not 'async def' (its coroutine would never be awaited)")
    problems = _signature_problems(sig, spec)
    if problems:
        raise fail("; ".join(problems))
    names = set(sig.parameters)
    accepted = frozenset(k for k in spec.optional_keywords if k in names)
    return Plugin(kind=spec.kind, path=path, fn=obj, is_async=is_async, accepted_optional=accepted)


@functools.cache
def load_plugin(path: str, kind: HookKind | str) -> Plugin:
    """Load ``path`` and check it against the ``kind`` hook's signature (cached per path and kind).

    Raises:
        PluginError: unknown kind, unloadable path, not callable, async-ness or signature mismatch.
    """
    try:
        hook = HookKind(kind)
    except ValueError as exc:
        known = ", ".join(k.value for k in HookKind)
        raise PluginError(f"unknown hook kind {kind!r}; known: {known}") from exc
    spec = HOOKS[hook]
    try:
        obj = load_function(path)
    except PluginError as exc:
        raise PluginError(f"{hook} {exc}; expected {spec.signature}") from exc.__cause__
    return _check(obj, path, spec)


def load_plugins(paths: Mapping[HookKind | str, str | None]) -> dict[HookKind, Plugin]:
    """Load every configured hook (None: not configured), reporting all problems at once.

    Raises:
        PluginError: one error listing every plugin that failed, one per line.
    """
    loaded: dict[HookKind, Plugin] = {}
    errors: list[str] = []
    for kind, path in paths.items():
        if path is None:
            continue
        try:
            plugin = load_plugin(path, kind)
        except PluginError as exc:
            errors.append(str(exc))
        else:
            loaded[plugin.kind] = plugin
    if errors:
        raise PluginError(f"{len(errors)} plugin(s) failed to load:\n" + "\n".join(errors))
    return loaded
