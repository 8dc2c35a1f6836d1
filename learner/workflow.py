"""Multi-agent workflows: a system of roles (a solver, a critic, a rewriter, a selector, ...), each a
prompt and a policy scope, run over a round's prompts by a coordinator that bounds how many instances
run at once; every agent turn becomes a training sample with its own reward.

A system is a user function in the style of slime's multi-agent example::

    async def system(episode: Episode, task: Sample) -> None:
        answer = await episode.ask(SOLVER, task_text(task))
        review = await episode.ask(CRITIC, f"Question: ...\\nAnswer: {answer.text}")
        episode.reward(answer, score(answer.text))
        episode.reward(review, ...)

``episode.ask`` renders the role's instructions and the content with the chat template, samples one
answer through SGLang's ``/generate`` (the learner's router: token ids in, ids and log-probs out) and
returns the turn; its sample is the role's prompt and answer, with ``metadata["role"]`` and
``metadata["scope"]`` (which policy trains on it), and the episode's ``rollout_id`` (an episode's
turns share the loss denominator, as slime's multi-agent samples do). Turns left without a reward get
the episode's ``final_reward``, when the system set one.

``Workflow(system).generate`` is a slime generate function (it returns the episode's samples); set
``custom_generate_path`` to it.
"""

from __future__ import annotations

import asyncio
import itertools
import weakref
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from learner.rollout import checkpoint_tokenizer
from learner.sample import Sample, SampleStatus
from learner.sglang_router import post_generate

DEFAULT_CONCURRENCY = 4


@dataclass(frozen=True, slots=True)
class Role:
    name: str
    instructions: str  # the role's system message
    scope: str = "shared"  # the policy its turns train: one shared model, or a role's own adapter


@dataclass(slots=True)
class AgentTurn:
    role: Role
    sample: Sample

    @property
    def text(self) -> str:
        return self.sample.response


@dataclass
class Episode:
    """One run of the system on one task: asks agents, keeps their turns, takes their rewards."""

    args: Any
    task: Sample
    rollout_id: int
    sampling_params: dict[str, Any]
    turns: list[AgentTurn] = field(default_factory=list)
    final_reward: float | None = None

    async def ask(self, role: Role, content: str, **sampling: Any) -> AgentTurn:
        """One answer of ``role`` to ``content`` (``sampling`` overrides the round's parameters)."""
        tokenizer = checkpoint_tokenizer(str(self.args.hf_checkpoint))
        messages = [{"role": "system", "content": role.instructions}, {"role": "user", "content": content}]
        prompt: list[int] = tokenizer.apply_chat_template(  # type: ignore[assignment]
            messages, add_generation_prompt=True, return_dict=False
        )
        body = {"input_ids": prompt, "sampling_params": {**self.sampling_params, **sampling}, "return_logprob": True}
        output = await post_generate(self.args, body)
        sample = Sample(
            prompt_token_ids=prompt,
            prompt=messages,
            label=self.task.label,
            group_index=self.task.group_index,
            rollout_id=self.rollout_id,
            rollout_temperature=self.task.rollout_temperature,
            metadata={**self.task.metadata, "role": role.name, "scope": role.scope, "messages": messages},
        )
        items = output["meta_info"]["output_token_logprobs"]
        sample.append_response_tokens(
            self.args,
            tokens=[int(item[1]) for item in items],
            log_probs=[float(item[0]) for item in items],
            meta_info=output["meta_info"],
            text=output["text"],
        )
        turn = AgentTurn(role, sample)
        self.turns.append(turn)
        return turn

    def reward(self, turn: AgentTurn, value: float) -> None:
        turn.sample.reward = value


System = Callable[[Episode, Sample], Awaitable[None]]


class Workflow:
    """Runs ``system`` once per task, at most ``max_concurrent`` episodes at a time (per event loop)."""

    def __init__(self, system: System, *, max_concurrent: int = DEFAULT_CONCURRENCY) -> None:
        if max_concurrent < 1:
            raise ValueError("max_concurrent must be at least 1")
        self.system = system
        self.max_concurrent = max_concurrent
        self._rollout_ids = itertools.count()
        self._bounds: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Semaphore] = (
            weakref.WeakKeyDictionary()
        )

    async def generate(self, args: Any, sample: Sample, sampling_params: dict[str, Any]) -> list[Sample]:
        """slime's generate contract: the episode's turns as samples, each with a reward."""
        loop = asyncio.get_running_loop()
        bound = self._bounds.get(loop)
        if bound is None:
            bound = self._bounds[loop] = asyncio.Semaphore(self.max_concurrent)
        async with bound:
            episode = Episode(args, sample, next(self._rollout_ids), dict(sampling_params))
            await self.system(episode, sample)
        samples = [turn.sample for turn in episode.turns]
        for turn_sample in samples:
            if turn_sample.reward is None and episode.final_reward is not None:
                turn_sample.reward = episode.final_reward
            if any(s.status == SampleStatus.ABORTED for s in samples):
                turn_sample.status = SampleStatus.ABORTED  # one agent's lost answer spoils the episode
        return samples
