"""A three-role workflow (solver, critic, rewriter) end to end on the tiny model through a live
gateway's router: every agent turn is a sample with its role, prompt, log-probs and reward, an
episode's turns share a rollout id, and no more episodes run at once than the bound."""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace

import pytest
from transformers import AutoTokenizer

from learner.sample import Sample
from learner.workflow import Episode, Role, Workflow
from tests.server.conftest import tiny_model

__all__ = ["tiny_model"]  # the shared fixture, visible here

SOLVER = Role("solver", "You solve the problem.", scope="solver")
CRITIC = Role("critic", "You point out the mistakes in an answer.", scope="critic")
REWRITER = Role("rewriter", "You rewrite an answer with the critique in mind.")
SAMPLING = {"temperature": 1.0, "max_new_tokens": 6}


class ThreeRoles:
    """The system: solver, then critic on its answer, then rewriter on both; tracks concurrency."""

    def __init__(self) -> None:
        self.running = 0
        self.most = 0

    async def __call__(self, episode: Episode, task: Sample) -> None:
        self.running += 1
        self.most = max(self.most, self.running)
        try:
            question = str(task.label)
            answer = await episode.ask(SOLVER, question)
            review = await episode.ask(CRITIC, f"Question: {question}\nAnswer: {answer.text}")
            await episode.ask(REWRITER, f"Answer: {answer.text}\nCritique: {review.text}", max_new_tokens=4)
            episode.reward(answer, 1.0 if answer.text.strip() else 0.0)
            episode.reward(review, 0.5)
            episode.final_reward = -1.0  # for the turns not rewarded one by one: the rewriter's
        finally:
            self.running -= 1


def test_a_three_role_workflow(router_args: SimpleNamespace, tiny_model: Path) -> None:
    system = ThreeRoles()
    workflow = Workflow(system, max_concurrent=2)
    tasks = [Sample(prompt_token_ids=[1], label=f"What is {i} + {i}?", group_index=i) for i in range(5)]

    async def run_all() -> list[list[Sample]]:
        return list(await asyncio.gather(*(workflow.generate(router_args, task, SAMPLING) for task in tasks)))

    episodes = asyncio.run(run_all())
    assert system.most == 2  # five episodes, never more than two at once
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    rollout_ids = set()
    for task, samples in zip(tasks, episodes, strict=True):
        assert [s.metadata["role"] for s in samples] == ["solver", "critic", "rewriter"]
        assert [s.metadata["scope"] for s in samples] == ["solver", "critic", "shared"]
        assert len({s.rollout_id for s in samples}) == 1 and samples[0].rollout_id not in rollout_ids
        rollout_ids.add(samples[0].rollout_id)
        assert [s.reward for s in samples][1:] == [0.5, -1.0]
        assert all(s.group_index == task.group_index and s.label == task.label for s in samples)
        solver, critic, rewriter = samples
        assert SOLVER.instructions in tokenizer.decode(solver.prompt_token_ids)
        assert solver.response in tokenizer.decode(critic.prompt_token_ids)  # the critic read the answer
        assert critic.response in tokenizer.decode(rewriter.prompt_token_ids)
        for s in samples:
            assert 1 <= s.response_length <= 6 and len(s.rollout_log_probs or []) == s.response_length
            assert set(s.resolved_loss_mask()) == {1}
        assert rewriter.response_length <= 4  # a turn's own sampling parameters


def test_a_bad_bound_is_refused() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        Workflow(ThreeRoles(), max_concurrent=0)
