"""Plugin loading and contracts: valid, invalid and legacy reference plugins through the same assertions.

Point the contract at your own plugin with ``TANDEM_CONTRACT_<KIND>=package.module:function``
(``<KIND>`` one of ``HookKind`` in upper case, e.g. ``TANDEM_CONTRACT_REWARD``), then run
``pytest tests/learner/test_plugins.py -k contract``.
"""

from __future__ import annotations

import functools
import importlib
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from learner.batching import DynamicFilterOutput, call_buffer_filter, call_dynamic_filter
from learner.plugins import HOOKS, HookKind, Plugin, PluginError, load_function, load_plugin, load_plugins, split_path
from learner.rewards import call_reward_post_process, score_samples
from learner.sample import Sample
from tests.learner import plugins_examples

EXAMPLES = "tests.learner.plugins_examples"


@dataclass
class Args:
    reward_key: str | None = None


def examples(name: str) -> str:
    return f"{EXAMPLES}:{name}"


def group(drop: bool = False) -> list[Sample]:
    return [
        Sample(
            prompt_token_ids=[1, 2],
            response_token_ids=[3] * (i + 1),
            group_index=0,
            index=i,
            reward=float(i),
            metadata={"drop": drop},
        )
        for i in range(3)
    ]


# what every plugin of a kind must do when called the way the learner calls it


async def invoke_reward(plugin: Plugin) -> None:
    samples = [Sample(prompt_token_ids=[1], response_token_ids=[2, 3], index=i) for i in range(3)]
    rewards = await score_samples(plugin, Args(), samples, max_concurrency=2)
    assert len(rewards) == len(samples)
    for sample, reward in zip(samples, rewards, strict=True):
        assert sample.reward is reward or sample.reward == reward
        assert isinstance(reward, float | dict)


async def invoke_post_process(plugin: Plugin) -> None:
    samples = group()
    raw, rewards = call_reward_post_process(plugin, Args(), samples)
    assert len(raw) == len(rewards) == len(samples)
    assert all(isinstance(r, float) for r in raw + rewards)


async def invoke_dynamic_filter(plugin: Plugin) -> None:
    output = call_dynamic_filter(plugin, Args(), group())
    assert isinstance(output, DynamicFilterOutput)
    assert isinstance(output.keep, bool)


async def invoke_buffer_filter(plugin: Plugin) -> None:
    samples = group()
    selected = call_buffer_filter(plugin, Args(), 0, [samples])
    assert all(any(s is given for given in samples) for g in selected for s in g)


async def invoke_generate(plugin: Plugin) -> None:
    sample = Sample(prompt_token_ids=[1, 2], index=0)
    result = await plugin.call(Args(), sample, {"temperature": 1.0}, evaluation=True)
    produced = result if isinstance(result, list) else [result]
    assert produced and all(isinstance(s, Sample) for s in produced)
    for s in produced:
        s.validate()


async def invoke_rollout(plugin: Plugin, evaluation: bool) -> None:
    result = plugin.call(Args(), 3, None, evaluation=evaluation)
    if plugin.is_async:
        result = await result
    assert isinstance(result, list | dict) or hasattr(result, "samples") or hasattr(result, "data")


async def invoke_signature_only(plugin: Plugin) -> None:
    assert callable(plugin.fn)


INVOKE = {
    HookKind.REWARD: invoke_reward,
    HookKind.BATCHED_REWARD: invoke_reward,
    HookKind.REWARD_POST_PROCESS: invoke_post_process,
    HookKind.DYNAMIC_FILTER: invoke_dynamic_filter,
    HookKind.BUFFER_FILTER: invoke_buffer_filter,
    HookKind.CUSTOM_GENERATE: invoke_generate,
    HookKind.ROLLOUT: functools.partial(invoke_rollout, evaluation=False),
    HookKind.EVAL_ROLLOUT: functools.partial(invoke_rollout, evaluation=True),
    HookKind.CUSTOM_LOSS: invoke_signature_only,
    HookKind.CUSTOM_TIS: invoke_signature_only,  # run in tests/learner/trainers/test_train_step.py
    HookKind.CUSTOM_ADVANTAGE: invoke_signature_only,  # run in tests/learner/trainers/test_token_level.py
    HookKind.CUSTOM_PG_REDUCER: invoke_signature_only,  # run in tests/learner/trainers/test_token_level.py
    HookKind.EVAL: invoke_reward,
}


@dataclass(frozen=True)
class Case:
    kind: HookKind
    path: str
    fails_at: str | None = None  # None: valid; "load": at config time; "call": when invoked
    match: str = ""

    @property
    def id(self) -> str:
        return f"{self.kind}-{self.path.rpartition(':')[2] or self.path}"


CASES = [
    Case(HookKind.REWARD, examples("reward_length")),
    Case(HookKind.REWARD, examples("reward_dict")),
    Case(HookKind.REWARD, examples("reward_callable")),
    Case(HookKind.REWARD, f"{EXAMPLES}.reward_length"),  # slime's dotted form
    Case(HookKind.REWARD, examples("reward_sync"), "load", "must be 'async def'"),
    Case(HookKind.REWARD, examples("reward_three_params"), "load", "requires 'judge', which is never passed"),
    Case(HookKind.REWARD, examples("reward_keyword_only"), "load", "requires 'judge'"),
    Case(HookKind.REWARD, examples("reward_one_param"), "load", "takes 1 positional parameters, is called with 2"),
    Case(HookKind.REWARD, examples("REWARD_CONSTANT"), "load", "is a float, not callable"),
    Case(HookKind.REWARD, examples("no_such_function"), "load", "has no attribute 'no_such_function'"),
    Case(HookKind.REWARD, "tests.learner.no_such_module:f", "load", "cannot import 'tests.learner.no_such_module'"),
    Case(HookKind.REWARD, examples("reward_returns_text"), "call", "not a finite number or dict"),
    Case(HookKind.REWARD, examples("reward_returns_bool"), "call", "not a finite number or dict"),
    Case(HookKind.BATCHED_REWARD, examples("batched_reward")),
    Case(HookKind.BATCHED_REWARD, examples("batched_reward_short"), "call", "returned 1 rewards for 3 samples"),
    Case(HookKind.REWARD_POST_PROCESS, examples("post_process_list")),
    Case(HookKind.REWARD_POST_PROCESS, examples("post_process_in_place")),
    Case(HookKind.REWARD_POST_PROCESS, examples("post_process_slime")),  # legacy (raw, rewards)
    Case(HookKind.REWARD_POST_PROCESS, examples("post_process_wrong_length"), "call", "returned 1 rewards for 3"),
    Case(HookKind.REWARD_POST_PROCESS, examples("post_process_async"), "load", "not 'async def'"),
    Case(HookKind.DYNAMIC_FILTER, examples("filter_drop_flagged")),
    Case(HookKind.DYNAMIC_FILTER, examples("filter_legacy_bool")),  # legacy bare bool
    Case(HookKind.DYNAMIC_FILTER, "learner.batching:check_reward_nonzero_std"),
    Case(HookKind.DYNAMIC_FILTER, "learner.batching.check_reward_nonzero_std_with_fallback"),
    Case(HookKind.DYNAMIC_FILTER, examples("filter_returns_none"), "call", "not a DynamicFilterOutput or bool"),
    Case(HookKind.DYNAMIC_FILTER, examples("filter_async"), "load", "never be awaited"),
    Case(HookKind.BUFFER_FILTER, examples("buffer_keep_rated")),
    Case(HookKind.BUFFER_FILTER, examples("buffer_invents"), "call", "not one of the given samples"),
    Case(HookKind.CUSTOM_GENERATE, examples("generate")),
    Case(HookKind.CUSTOM_GENERATE, examples("generate_with_evaluation")),
    Case(HookKind.CUSTOM_GENERATE, examples("generate_sync"), "load", "must be 'async def'"),
    Case(HookKind.ROLLOUT, examples("rollout")),
    Case(HookKind.ROLLOUT, examples("rollout_async")),
    Case(HookKind.ROLLOUT, examples("rollout_without_evaluation"), "load", "does not accept the keyword 'evaluation'"),
    Case(HookKind.EVAL_ROLLOUT, examples("rollout")),
    Case(HookKind.CUSTOM_LOSS, examples("custom_loss")),
    Case(HookKind.EVAL, examples("reward_length")),
    Case(HookKind.EVAL, examples("reward_sync"), "load", "must be 'async def'"),
    Case(HookKind.CUSTOM_LOSS, examples("custom_loss_three_params"), "load", "takes 3 positional parameters"),
    Case(HookKind.CUSTOM_TIS, examples("tis_vanilla")),
    Case(HookKind.CUSTOM_TIS, examples("custom_loss_three_params"), "load", "does not accept the keyword"),
    Case(HookKind.CUSTOM_ADVANTAGE, examples("advantages_broadcast")),
    Case(HookKind.CUSTOM_ADVANTAGE, examples("tis_vanilla"), "load", "takes 1 positional parameters"),
    Case(HookKind.CUSTOM_PG_REDUCER, examples("pg_reducer_sample_mean")),
    Case(HookKind.CUSTOM_PG_REDUCER, examples("custom_loss_three_params"), "load", "is called with 4"),
]

USER_CASES = [
    Case(kind, os.environ[f"TANDEM_CONTRACT_{kind.name}"])
    for kind in HookKind
    if os.environ.get(f"TANDEM_CONTRACT_{kind.name}")
]


@pytest.mark.parametrize("case", CASES + USER_CASES, ids=lambda c: c.id)
async def test_plugin_contract(case: Case) -> None:
    if case.fails_at == "load":
        with pytest.raises(PluginError, match=case.match) as caught:
            load_plugin(case.path, case.kind)
        message = str(caught.value)
        assert case.path in message and HOOKS[case.kind].signature in message  # says what and what was expected
        return
    plugin = load_plugin(case.path, case.kind)
    assert plugin.kind is case.kind and plugin.path == case.path
    if case.fails_at == "call":
        with pytest.raises(PluginError, match=case.match):
            await INVOKE[case.kind](plugin)
    else:
        await INVOKE[case.kind](plugin)


def test_every_hook_kind_has_a_spec_and_a_contract() -> None:
    assert set(HOOKS) == set(HookKind) == set(INVOKE)
    assert all(HOOKS[kind].kind is kind for kind in HookKind)
    assert {case.kind for case in CASES} == set(HookKind)


# paths and loading


@pytest.mark.parametrize(
    ("path", "expected"),
    [
        ("pkg.mod:fn", ("pkg.mod", "fn")),
        ("pkg.mod.fn", ("pkg.mod", "fn")),
        ("mod:Class.method", ("mod", "Class.method")),
        ("mod:fn", ("mod", "fn")),
    ],
)
def test_split_path_accepts_both_forms(path: str, expected: tuple[str, str]) -> None:
    assert split_path(path) == expected


@pytest.mark.parametrize("path", ["", "fn", "pkg.mod:", ":fn", "a:b:c", "pkg..mod:fn", " pkg.mod:fn", "pkg.mod:f n"])
def test_split_path_rejects_malformed(path: str) -> None:
    with pytest.raises(PluginError, match="plugin path"):
        split_path(path)


def test_both_forms_load_the_same_function_once() -> None:
    before = load_function.cache_info().hits
    colon = load_function(examples("reward_length"))
    again = load_function(examples("reward_length"))
    dotted = load_function(f"{EXAMPLES}.reward_length")
    assert colon is again is dotted is plugins_examples.reward_length
    assert load_function.cache_info().hits >= before + 1
    assert load_plugin(examples("reward_length"), "reward") is load_plugin(examples("reward_length"), HookKind.REWARD)


def test_nested_attribute_path() -> None:
    fn = load_function(examples("RewardCallable.__call__"))
    assert fn is plugins_examples.RewardCallable.__call__


def test_a_failed_load_is_not_cached(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(tmp_path))
    path = "tandem_user_plugin_late:reward"
    with pytest.raises(PluginError, match="cannot import"):
        load_plugin(path, HookKind.REWARD)
    (tmp_path / "tandem_user_plugin_late.py").write_text("async def reward(args, sample):\n    return 1.0\n")
    importlib.invalidate_caches()
    try:
        assert load_plugin(path, HookKind.REWARD).is_async
    finally:
        sys.modules.pop("tandem_user_plugin_late", None)


def test_an_import_error_inside_the_plugin_module_is_reported(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "tandem_user_plugin_broken.py").write_text("raise RuntimeError('config file missing')\n")
    importlib.invalidate_caches()
    with pytest.raises(PluginError, match="RuntimeError: config file missing"):
        load_function("tandem_user_plugin_broken:reward")


def test_unknown_kind_lists_the_known_ones() -> None:
    with pytest.raises(PluginError, match="unknown hook kind 'rewards'; known: reward, batched_reward"):
        load_plugin(examples("reward_length"), "rewards")


def test_load_plugins_reports_every_problem_at_once() -> None:
    with pytest.raises(PluginError) as caught:
        load_plugins(
            {
                HookKind.REWARD: examples("reward_sync"),
                "dynamic_filter": examples("filter_async"),
                HookKind.BUFFER_FILTER: examples("buffer_keep_rated"),
                HookKind.CUSTOM_LOSS: None,
            }
        )
    lines = str(caught.value).splitlines()
    assert lines[0] == "2 plugin(s) failed to load:"
    assert "reward_sync" in lines[1] and "filter_async" in lines[2]


def test_load_plugins_returns_the_configured_ones() -> None:
    loaded = load_plugins({"reward": examples("reward_length"), HookKind.CUSTOM_LOSS: None})
    assert set(loaded) == {HookKind.REWARD}
    assert loaded[HookKind.REWARD].fn is plugins_examples.reward_length


# signatures


async def test_evaluation_is_passed_only_to_generate_functions_that_name_it() -> None:
    plain = load_plugin(examples("generate"), HookKind.CUSTOM_GENERATE)
    named = load_plugin(examples("generate_with_evaluation"), HookKind.CUSTOM_GENERATE)
    assert plain.accepted_optional == frozenset()
    assert named.accepted_optional == {"evaluation"}
    sample = await named.call(Args(), Sample(prompt_token_ids=[1]), {}, evaluation=True)
    assert sample.metadata["evaluation"] is True
    await plain.call(Args(), Sample(prompt_token_ids=[1]), {}, evaluation=True)  # would raise TypeError if passed


def rollout_kwargs(args: Any, rollout_id: int, data_source: Any, **kwargs: Any) -> list[Any]:
    return [kwargs]


def rollout_evaluation_positional(args: Any, evaluation: bool, data_source: Any, rollout_id: int = 0) -> None:
    return None


def dynamic_filter_varargs(*args: Any) -> bool:
    return True


async def reward_with_judge(args: Any, sample: Sample, judge: str) -> float:
    return 1.0 if judge else 0.0


def test_keywords_may_come_through_kwargs() -> None:
    plugin = load_plugin(f"{__name__}:rollout_kwargs", HookKind.ROLLOUT)
    assert plugin.call(Args(), 1, None, evaluation=True) == [{"evaluation": True}]


def test_a_keyword_also_filled_positionally_is_refused() -> None:
    with pytest.raises(PluginError, match="positional parameter 'evaluation' would also be passed by keyword"):
        load_plugin(f"{__name__}:rollout_evaluation_positional", HookKind.ROLLOUT)


def test_varargs_accept_any_positional_count() -> None:
    assert not load_plugin(f"{__name__}:dynamic_filter_varargs", HookKind.DYNAMIC_FILTER).is_async


def test_a_partial_binding_the_extra_parameter_fits(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(
        sys.modules[__name__], "bound_reward", functools.partial(reward_with_judge, judge="x"), raising=False
    )
    plugin = load_plugin(f"{__name__}:bound_reward", HookKind.REWARD)
    assert plugin.is_async


def test_the_unbound_version_does_not() -> None:
    with pytest.raises(PluginError, match="requires 'judge'"):
        load_plugin(f"{__name__}:reward_with_judge", HookKind.REWARD)


def test_plugin_error_names_the_kind_path_and_signature() -> None:
    plugin = load_plugin(examples("reward_length"), HookKind.REWARD)
    message = str(plugin.error("did something odd"))
    assert message == (
        f"reward plugin '{EXAMPLES}:reward_length': did something odd; expected async (args, sample) -> float | dict"
    )
