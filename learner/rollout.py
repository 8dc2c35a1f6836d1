"""Rollout: n fresh responses per prompt from the serving weights, through the gateway, so GRPO gets real groups.

The learner never talks to engines: it asks the gateway (``POST /admin/rollouts``, admin key), which
samples at low priority with its own bound on rollout sequences (``rollout_max_concurrency``), so
users keep their latency. Here ``RolloutConfig.concurrency`` bounds the prompts in flight as well.

Extension points, as in slime:

- ``custom_generate_path``: ``async (args, sample, sampling_params[, evaluation]) -> Sample | list[Sample]``
  replaces the default generate, called ``n_samples_per_prompt`` times per prompt on a fresh copy of
  the prompt sample (a sample's own ``generate_function_path`` wins, as in slime).
- ``rollout_path``: ``(args, rollout_id, data_source, evaluation=False) -> list[list[Sample]]`` (or an
  object with ``.samples``, like slime's ``RolloutFnTrainOutput``) replaces the whole rollout;
  ``data_source`` is the list of prompt samples.

Both get ``args``, a ``learner.slime_args.SlimeArgs``: slime's names for the settings, and while they
run an SGLang ``/generate`` at ``args.sglang_router_ip``:``args.sglang_router_port``
(``learner.sglang_router``), so slime's generate functions run unchanged. tandem's own plugins may use
``args.client`` instead, an ``httpx.AsyncClient`` on the gateway with the admin key (None for a
ROLLOUT plugin, which runs outside this module's event loop; ``args.server_url`` and
``args.admin_key`` are there too).

Usage from the round (sync code)::

    groups = rollout_groups(server_url, admin_key, prompts, RolloutConfig(n_samples_per_prompt=4))
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import httpx
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from learner.plugins import HookKind, Plugin, load_plugin
from learner.sample import Sample, SampleStatus, scored_temperature
from learner.sglang_router import sglang_router
from learner.slime_args import SlimeArgs, slime_args
from tandem.aio import gather_or_cancel
from tandem.moe_routing import routes_from_base64

__all__ = [
    "PromptSource",
    "RolloutConfig",
    "RolloutError",
    "eval_rollout",
    "gateway_client",
    "post_rollouts",
    "rollout_group",
    "rollout_groups",
    "sampling_params",
]

log = logging.getLogger(__name__)

MAX_SAMPLES_PER_PROMPT = 64  # the gateway's limit on n
_RETRY_STATUSES = (429, 503)  # a full engine queue, an aborted sample: worth another try


class RolloutError(Exception):
    """Rollout failed: the gateway is unreachable, refused the request, or answered something unreadable.

    ``status`` is the HTTP status when the gateway answered, else None; ``code`` is the gateway's
    error code (e.g. ``context_length_exceeded``) when it gave one.
    """

    def __init__(self, message: str, status: int | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.code = code


@dataclass(frozen=True, slots=True)
class RolloutConfig:
    """How to sample each prompt's group.

    Attributes:
        n_samples_per_prompt: responses per prompt (the GRPO group size).
        max_new_tokens: at most this many tokens per response.
        temperature, top_p, top_k: sampling (top_k -1: off). The logged logprobs are of the
            temperature-scaled distribution, as SGLang reports them.
        concurrency: prompts in flight at once from this client.
        timeout: seconds for one prompt's whole group.
        retries: further attempts when the gateway answers 429 or 503.
        seed: per-prompt seeds derive from it (prompt i: seed + i * n) for reproducible rollouts.
        custom_generate_path: a CUSTOM_GENERATE plugin replacing the default generate.
        rollout_path: a ROLLOUT plugin replacing the whole rollout.
    """

    n_samples_per_prompt: int = 4
    max_new_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    concurrency: int = 4
    timeout: float = 600.0
    retries: int = 2
    seed: int | None = None
    custom_generate_path: str | None = None
    rollout_path: str | None = None
    # MoE models: record each sample's routed experts, and train through them (tandem.moe_routing).
    routing_replay: bool = False

    def __post_init__(self) -> None:
        problems = []
        if not 1 <= self.n_samples_per_prompt <= MAX_SAMPLES_PER_PROMPT:
            problems.append(f"n_samples_per_prompt must be in [1, {MAX_SAMPLES_PER_PROMPT}]")
        if self.max_new_tokens < 1:
            problems.append("max_new_tokens must be at least 1")
        if not 0 <= self.temperature <= 2:
            problems.append("temperature must be in [0, 2]")
        if not 0 < self.top_p <= 1:
            problems.append("top_p must be in (0, 1]")
        if self.top_k == 0 or self.top_k < -1:
            problems.append("top_k must be -1 (off) or positive")
        if self.concurrency < 1:
            problems.append("concurrency must be at least 1")
        if self.timeout <= 0:
            problems.append("timeout must be > 0")
        if self.retries < 0:
            problems.append("retries must be >= 0")
        if problems:
            raise ValueError("invalid RolloutConfig: " + "; ".join(problems))
        # Load the plugins now: a wrong path or signature fails at config time, not mid-round.
        if self.custom_generate_path is not None:
            load_plugin(self.custom_generate_path, HookKind.CUSTOM_GENERATE)
        if self.rollout_path is not None:
            load_plugin(self.rollout_path, HookKind.ROLLOUT)

    def slime_args(self) -> dict[str, Any]:
        """These settings by slime's argument names (``learner.slime_args``)."""
        return {
            "n_samples_per_prompt": self.n_samples_per_prompt,
            "rollout_max_response_len": self.max_new_tokens,
            "rollout_temperature": self.temperature,
            "rollout_top_p": self.top_p,
            "rollout_top_k": self.top_k,
            "rollout_seed": 42 if self.seed is None else self.seed,
            "sglang_server_concurrency": self.concurrency,
            "custom_generate_function_path": self.custom_generate_path,
            "rollout_function_path": self.rollout_path,
            "use_rollout_routing_replay": self.routing_replay,
        }


def sampling_params(config: RolloutConfig) -> dict[str, Any]:
    """slime's ``sampling_params`` dict, as a custom generate function receives it."""
    return {
        "temperature": config.temperature,
        "top_p": config.top_p,
        "top_k": config.top_k,
        "max_new_tokens": config.max_new_tokens,
    }


async def rollout_group(
    client: httpx.AsyncClient,
    prompt: Sample,
    config: RolloutConfig,
    group_index: int,
    *,
    seed: int | None = None,
    args: SlimeArgs | None = None,
) -> list[Sample]:
    """``config.n_samples_per_prompt`` fresh samples of ``prompt``'s prompt from the serving weights.

    Args:
        client: an ``httpx.AsyncClient`` with ``base_url`` the gateway and the admin key header.
        prompt: its ``prompt_token_ids`` are sampled (its response, if any, is not used).
        config: sampling, and the custom generate plugin if one is set.
        group_index: set on every returned sample.
        seed: the first sample's seed (sample i gets seed + i); None: unseeded.
        args: what a custom generate plugin gets (default: ``config``'s settings by slime's names).

    Returns:
        The samples (status COMPLETED or TRUNCATED, metadata ``source`` "rollout"); an empty list
        when the prompt leaves no room in the model's context for a response.

    Raises:
        RolloutError: the gateway is unreachable, refused the request, or answered unreadably.
        PluginError: a custom generate plugin returned something other than samples.
    """
    path = prompt.generate_function_path or config.custom_generate_path
    if path is not None:
        plugin = load_plugin(path, HookKind.CUSTOM_GENERATE)
        plugin_args = args if args is not None else _default_args(config, str(client.base_url), _admin_key(client))
        plugin_args.client = client
        return await _plugin_group(plugin, plugin_args, prompt, config, group_index)
    body: dict[str, Any] = {
        "input_ids": list(prompt.prompt_token_ids),
        "n": config.n_samples_per_prompt,
        "max_tokens": config.max_new_tokens,
        "temperature": config.temperature,
        "top_p": config.top_p,
        "top_k": config.top_k,
    }
    if seed is not None:
        body["seed"] = seed
    if config.routing_replay:
        body["return_routed_experts"] = True
    if prompt.session_id:
        body["session_id"] = prompt.session_id  # same replica as the user's session: its cache has the prompt
    try:
        answer = await post_rollouts(client, body, retries=config.retries)
    except RolloutError as exc:
        if (exc.status, exc.code) != (400, "context_length_exceeded"):
            raise
        log.warning("rollout prompt skipped: no room for a response", extra={"error": str(exc)})
        return []
    try:
        return [_sample(prompt, choice, group_index, config.temperature) for choice in answer["choices"]]
    except (KeyError, TypeError, ValueError) as exc:
        raise RolloutError(f"POST /admin/rollouts answered an unreadable body: {exc!r}") from exc


def rollout_groups(
    server_url: str,
    admin_key: str,
    prompts: Sequence[Sample],
    config: RolloutConfig,
    *,
    rollout_id: int = 0,
    on_progress: Callable[[int, int], None] | None = None,
    args: SlimeArgs | None = None,
) -> list[list[Sample]]:
    """Per prompt, in order, its group of fresh samples (call from sync code: it runs its own event loop).

    Args:
        server_url: the gateway, e.g. ``http://127.0.0.1:8000``.
        admin_key: the gateway's admin key.
        prompts: prompt samples (e.g. from ``learner.collect``); prompt ``i``'s group gets its
            ``group_index`` (``i`` when it has none).
        config: sampling, concurrency and plugins.
        rollout_id: passed to a ROLLOUT plugin.
        on_progress: called with (groups done, groups in all) after each group.
        args: what plugins get (default: ``config``'s settings by slime's names); its
            ``rollout_batch_size`` is set to the number of prompts, and its router address to a
            learner-side SGLang ``/generate`` while plugins run.

    Raises:
        RolloutError: see ``rollout_group``; the first failure cancels the other groups.
        PluginError: a plugin returned the wrong shape.
    """
    args = args if args is not None else _default_args(config, server_url, admin_key)
    args.rollout_batch_size = args.over_sampling_batch_size = len(prompts)
    plugins = config.rollout_path or config.custom_generate_path or any(p.generate_function_path for p in prompts)
    if not plugins:
        return asyncio.run(_rollout_all(server_url, admin_key, list(prompts), config, on_progress, args))
    with sglang_router(server_url, admin_key, timeout=config.timeout) as (ip, port):
        args.sglang_router_ip, args.sglang_router_port = ip, port
        try:
            if config.rollout_path is not None:
                return _run_rollout_plugin(args, prompts, config, rollout_id)
            return asyncio.run(_rollout_all(server_url, admin_key, list(prompts), config, on_progress, args))
        finally:
            args.sglang_router_ip = args.sglang_router_port = None


def eval_rollout(
    server_url: str,
    admin_key: str,
    prompts: Sequence[Sample],
    config: RolloutConfig,
    path: str,
    *,
    rollout_id: int,
    args: SlimeArgs | None = None,
) -> dict[str, float]:
    """Run an EVAL_ROLLOUT plugin (slime's ``--eval-function-path``) against the serving weights and
    give its metrics as slime logs them: ``eval/<dataset>`` (mean reward, by ``args.eval_reward_key``
    for dict rewards), ``eval/<dataset>-truncated_ratio``, and the plugin's own metrics.

    The plugin is called ``(args, rollout_id, data_source, evaluation=True)`` with the router up and
    ``data_source`` the round's prompts (``PromptSource``); it returns ``RolloutFnEvalOutput`` or its
    ``data`` dict, ``{dataset: {"rewards": [...], "truncated": [...], "samples": [...]}}``.

    Raises:
        PluginError: a result of another shape, or rewards that are not numbers.
    """
    plugin = load_plugin(path, HookKind.EVAL_ROLLOUT)
    args = args if args is not None else _default_args(config, server_url, admin_key)
    with sglang_router(server_url, admin_key, timeout=config.timeout) as (ip, port):
        args.sglang_router_ip, args.sglang_router_port = ip, port
        args.client = None
        try:
            result = plugin.call(args, rollout_id, PromptSource(prompts, args, config.temperature), evaluation=True)
            if inspect.isawaitable(result):
                result = asyncio.run(_awaited(result))
        finally:
            args.sglang_router_ip = args.sglang_router_port = None
    data = getattr(result, "data", result)
    if not isinstance(data, dict) or not all(isinstance(d, dict) and "rewards" in d for d in data.values()):
        raise plugin.error(f"returned {type(result).__name__}, not {{dataset: {{'rewards': [...], ...}}}}")
    key = args.eval_reward_key or args.reward_key
    metrics: dict[str, float] = {}
    for name, dataset in data.items():
        rewards = [r.get(key) if isinstance(r, dict) and key else r for r in dataset["rewards"]]
        numbers = [float(r) for r in rewards if isinstance(r, int | float) and not isinstance(r, bool)]
        if not rewards or len(numbers) != len(rewards):
            raise plugin.error(
                f"dataset {name!r}: rewards must be a non-empty list of numbers (eval_reward_key {key!r})"
            )
        metrics[f"eval/{name}"] = sum(numbers) / len(numbers)
        truncated = dataset.get("truncated")
        if truncated:
            metrics[f"eval/{name}-truncated_ratio"] = sum(map(bool, truncated)) / len(truncated)
    extra = getattr(result, "metrics", None) or {}
    return metrics | {str(k): float(v) for k, v in extra.items()}


def _default_args(config: RolloutConfig, server_url: str, admin_key: str) -> SlimeArgs:
    return slime_args(config.slime_args(), server_url=server_url, admin_key=admin_key, client=None)


async def _rollout_all(
    server_url: str,
    admin_key: str,
    prompts: list[Sample],
    config: RolloutConfig,
    on_progress: Callable[[int, int], None] | None,
    args: SlimeArgs,
) -> list[list[Sample]]:
    slots = asyncio.Semaphore(config.concurrency)
    done = 0
    n = config.n_samples_per_prompt

    async def one(client: httpx.AsyncClient, index: int, prompt: Sample) -> list[Sample]:
        nonlocal done
        async with slots:
            seed = None if config.seed is None else config.seed + index * n
            group_index = index if prompt.group_index is None else prompt.group_index
            group = await rollout_group(client, prompt, config, group_index, seed=seed, args=args)
        done += 1
        if on_progress is not None:
            on_progress(done, len(prompts))
        return group

    # One connection per prompt in flight; the gateway bounds the engine work itself.
    async with gateway_client(server_url, admin_key, timeout=config.timeout, max_connections=config.concurrency) as c:
        return await gather_or_cancel(one(c, i, p) for i, p in enumerate(prompts))


def gateway_client(server_url: str, admin_key: str, *, timeout: float, max_connections: int) -> httpx.AsyncClient:
    """An ``httpx.AsyncClient`` on the gateway at ``server_url`` with the admin key (for ``post_rollouts``).

    Args:
        timeout: seconds for one request.
        max_connections: requests in flight at once from this client.
    """
    return httpx.AsyncClient(
        base_url=server_url.rstrip("/"),
        headers={"Authorization": f"Bearer {admin_key}"},
        timeout=timeout,
        limits=httpx.Limits(max_connections=max_connections),
    )


async def post_rollouts(client: httpx.AsyncClient, body: dict[str, Any], *, retries: int) -> dict[str, Any]:
    """``POST /admin/rollouts`` with ``body``: the gateway's JSON answer.

    A 429 or 503 is tried again up to ``retries`` more times, after 0.5 s, 1 s, 2 s, ...

    Raises:
        RolloutError: the gateway is unreachable, answered non-JSON, or refused the request (``status``
            and ``code`` say how; ``code`` "context_length_exceeded": the prompt leaves no room to answer).
    """
    for attempt in range(retries + 1):
        try:
            response = await client.post("/admin/rollouts", json=body)
        except httpx.HTTPError as exc:
            raise RolloutError(f"cannot reach the gateway at {client.base_url}: {exc!r}") from exc
        if response.status_code == 200:
            try:
                return dict(response.json())
            except ValueError as exc:
                text = response.text[:200]
                raise RolloutError(f"POST /admin/rollouts answered non-JSON: {text!r}", response.status_code) from exc
        if response.status_code not in _RETRY_STATUSES or attempt == retries:
            error = _error(response)
            message = error.get("message") or response.text[:300]
            code = error.get("code")
            raise RolloutError(
                f"POST /admin/rollouts answered {response.status_code}: {message}",
                response.status_code,
                code if isinstance(code, str) else None,
            )
        await asyncio.sleep(0.5 * 2**attempt)
    raise AssertionError("unreachable: the last attempt returns or raises")


def _error(response: httpx.Response) -> dict[str, Any]:
    try:
        error = response.json().get("error")
    except (ValueError, AttributeError):
        return {}
    return error if isinstance(error, dict) else {}


def _versions_in_order(spans: list[dict[str, Any]]) -> list[str]:
    versions: list[str] = []
    for span in sorted(spans, key=lambda span: int(span["start"])):
        if not versions or versions[-1] != span["version"]:
            versions.append(str(span["version"]))
    return versions


def _sample(prompt: Sample, choice: dict[str, Any], group_index: int, temperature: float) -> Sample:
    spans = list(choice["weight_versions"])
    return Sample(
        prompt_token_ids=list(prompt.prompt_token_ids),
        response_token_ids=[int(t) for t in choice["output_ids"]],
        group_index=group_index,
        prompt=prompt.prompt,
        response=str(choice["text"]),
        label=prompt.label,
        rollout_log_probs=[float(lp) for lp in choice["logprobs"]],
        rollout_routed_experts=_routes(choice, len(prompt.prompt_token_ids)),
        rollout_temperature=scored_temperature(temperature),
        weight_versions=_versions_in_order(spans),
        status=SampleStatus.TRUNCATED if choice["finish_reason"] == "length" else SampleStatus.COMPLETED,
        user_id=prompt.user_id,
        session_id=prompt.session_id,
        metadata=_metadata(prompt, choice_index=int(choice["index"]), weight_spans=spans),
    )


def _routes(choice: dict[str, Any], prompt_length: int) -> list[list[int]] | None:
    """The choice's routed experts (SGLang's base64 int32), a row per token but the last."""
    if not choice.get("routed_experts"):
        return None
    return routes_from_base64(choice["routed_experts"], prompt_length + len(choice["output_ids"]))


def _metadata(prompt: Sample, **extra: Any) -> dict[str, Any]:
    # The prompt's own feedback rated another response, so it is not carried over.
    return {
        "source": "rollout",
        "prompt_completion_id": prompt.completion_id,
        "tenant_id": prompt.metadata.get("tenant_id"),
        **extra,
    }


def _fresh(prompt: Sample, group_index: int, choice_index: int, temperature: float, args: SlimeArgs) -> Sample:
    """The prompt alone, ready for a generate function to fill in a response at ``temperature``.

    As in slime with ``--apply-chat-template``, ``prompt`` is the rendered prompt text (decoded from
    the prompt's token ids with ``args.hf_checkpoint``'s tokenizer) and ``tokens`` its ids; the chat
    messages are in ``metadata["messages"]``.
    """
    text = _prompt_text(args.hf_checkpoint, tuple(prompt.prompt_token_ids)) if args.hf_checkpoint else None
    return Sample(
        prompt_token_ids=list(prompt.prompt_token_ids),
        rollout_temperature=scored_temperature(temperature),
        group_index=group_index,
        index=group_index * args.n_samples_per_prompt + choice_index,
        prompt=prompt.prompt if text is None else text,
        label=prompt.label,
        user_id=prompt.user_id,
        session_id=prompt.session_id,
        metadata=_metadata(prompt, choice_index=choice_index, messages=prompt.prompt),
    )


@functools.cache
def checkpoint_tokenizer(checkpoint: str) -> PreTrainedTokenizerBase:
    """The tokenizer of a checkpoint folder, loaded once per process."""
    return AutoTokenizer.from_pretrained(checkpoint)


def _prompt_text(checkpoint: str, ids: tuple[int, ...]) -> str:
    return str(checkpoint_tokenizer(checkpoint).decode(list(ids)))


class PromptSource(list[Sample]):
    """A ROLLOUT plugin's ``data_source``: the round's prompt samples as a list (tandem's contract),
    with slime's ``RolloutDataSource`` methods. ``get_samples(n)`` hands out the next ``n`` prompts
    as groups of ``n_samples_per_prompt`` fresh samples (groups given back first); ``add_samples``
    takes groups back, as slime returns a rollout's aborted groups."""

    def __init__(self, prompts: Sequence[Sample], args: SlimeArgs, temperature: float) -> None:
        super().__init__(prompts)
        self._args = args
        self._temperature = temperature
        self._handed_out = 0
        self._returned: list[list[Sample]] = []

    def get_samples(self, num_samples: int) -> list[list[Sample]]:
        groups = self._returned[:num_samples]
        del self._returned[: len(groups)]
        while len(groups) < num_samples and self._handed_out < len(self):
            prompt = self[self._handed_out]
            group_index = self._handed_out if prompt.group_index is None else prompt.group_index
            n = self._args.n_samples_per_prompt
            groups.append([_fresh(prompt, group_index, i, self._temperature, self._args) for i in range(n)])
            self._handed_out += 1
        return groups

    def add_samples(self, groups: list[list[Sample]]) -> None:
        self._returned.extend(groups)


async def _plugin_group(
    plugin: Plugin, args: SlimeArgs, prompt: Sample, config: RolloutConfig, group_index: int
) -> list[Sample]:
    params = sampling_params(config)
    samples: list[Sample] = []
    for choice_index in range(config.n_samples_per_prompt):
        fresh = _fresh(prompt, group_index, choice_index, config.temperature, args)
        result = await plugin.call(args, fresh, dict(params), evaluation=False)
        produced = result if isinstance(result, list) else [result]
        if not produced or not all(isinstance(s, Sample) for s in produced):
            raise plugin.error(f"returned {type(result).__name__}, not a Sample or a non-empty list of them")
        _sampled_at(config, produced)
        for sample in produced:
            sample.group_index = group_index
            sample.validate()
        samples.extend(produced)
    return samples


def _admin_key(client: httpx.AsyncClient) -> str:
    return client.headers.get("authorization", "").removeprefix("Bearer ")


def _run_rollout_plugin(
    args: SlimeArgs, prompts: Sequence[Sample], config: RolloutConfig, rollout_id: int
) -> list[list[Sample]]:
    plugin = load_plugin(config.rollout_path or "", HookKind.ROLLOUT)
    args.client = None
    result = plugin.call(args, rollout_id, PromptSource(prompts, args, config.temperature), evaluation=False)
    if inspect.isawaitable(result):
        result = asyncio.run(_awaited(result))
    groups = getattr(result, "samples", result)
    if not isinstance(groups, list) or not all(
        isinstance(group, list) and all(isinstance(s, Sample) for s in group) for group in groups
    ):
        raise plugin.error(f"returned {type(result).__name__}, not list[list[Sample]]")
    _sampled_at(config, [s for group in groups for s in group])
    return groups


def _sampled_at(config: RolloutConfig, samples: list[Sample]) -> None:
    """A plugin's samples are scored at the rollout temperature, as slime scores every rollout at
    --rollout-temperature (a plugin's sampling_params carry it)."""
    for sample in samples:
        sample.rollout_temperature = scored_temperature(config.temperature)


async def _awaited(result: Any) -> Any:
    return await result
