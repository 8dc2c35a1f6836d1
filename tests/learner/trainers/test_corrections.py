"""A corrected answer becomes a supervised sample, and a training step makes it more likely."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoTokenizer

from learner.algorithms import PolicyLossConfig
from learner.batching import collate_micro_batch, pack_samples
from learner.corrections import corrected_samples
from learner.sample import Sample
from learner.trainers import TrainConfig, response_log_probs, train_step
from learner.trainers.step_loss import micro_batch_loss, prepare_step
from learner.trainers.torch_backend import forward_logits
from tests.learner.trainers.conftest import load_tiny

MESSAGES = [{"role": "user", "content": "What is 2+2?"}]


def rated(tokenizer: object, correction: str | None) -> Sample:
    prompt = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, return_dict=False)  # type: ignore[attr-defined]
    return Sample(
        prompt_token_ids=list(prompt),
        response_token_ids=[11, 12],
        prompt=list(MESSAGES),
        reward=-1.0,
        rollout_log_probs=[-1.0, -1.0],
        user_id="u1",
        session_id="s1",
        completion_id="chatcmpl-1",
        metadata={"tenant_id": "acme", "feedback": {"rating": "down", "corrected_answer": correction}},
    )


def test_a_corrected_answer_is_the_assistant_turn_through_its_end(base_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(base_dir)
    samples = [rated(tokenizer, " It is 4. "), rated(tokenizer, None), rated(tokenizer, "  ")]
    [corrected] = corrected_samples(samples, tokenizer)
    # The template's assistant turn after the served prompt, up to its end-of-turn token, not the newline after.
    assert corrected.response_token_ids == [
        *tokenizer.encode("It is 4.", add_special_tokens=False),
        tokenizer.eos_token_id,
    ]
    assert corrected.prompt_token_ids == samples[0].prompt_token_ids and corrected.response == "It is 4."
    assert corrected.supervised and corrected.rollout_log_probs is None and corrected.group_index is None
    assert (corrected.user_id, corrected.session_id) == ("u1", "s1")
    assert corrected.metadata == {
        "source": "corrected_answer",
        "tenant_id": "acme",
        "corrected_completion_id": "chatcmpl-1",
    }
    # A prompt the template does not reproduce: the text's tokens, then end of turn.
    odd = rated(tokenizer, "4")
    odd.prompt_token_ids = [1, 2, 3]
    assert corrected_samples([odd], tokenizer)[0].response_token_ids == [
        *tokenizer.encode("4", add_special_tokens=False),
        tokenizer.eos_token_id,
    ]


def test_a_step_with_a_correction_makes_it_more_likely_even_with_tis(base_dir: Path) -> None:
    """The rated answer trains by its advantage, the correction by likelihood; TIS needs no behaviour
    log-probs for the correction, which was never sampled."""
    tokenizer = AutoTokenizer.from_pretrained(base_dir)
    answer = rated(tokenizer, "It is 4.")
    [corrected] = corrected_samples([answer], tokenizer)
    model = load_tiny(base_dir)
    before = float(response_log_probs(model, [corrected], 4096)[0].sum())
    config = TrainConfig(loss=PolicyLossConfig(use_tis=True, sft_coef=1.0))
    metrics = train_step(
        model,
        torch.optim.SGD(model.parameters(), lr=0.5),
        [answer, corrected],
        config,
        advantages=torch.tensor([-1.0, 0.0]),
    )
    after = float(response_log_probs(model, [corrected], 4096)[0].sum())
    assert metrics["sft_loss"] > 0 and after > before + 0.1, (before, after)


def test_every_micro_batch_of_a_step_with_corrections_reports_sft_loss(base_dir: Path) -> None:
    """Data-parallel replicas sum their parts by name: a micro-batch without a correction reports 0."""
    tokenizer = AutoTokenizer.from_pretrained(base_dir)
    answer = rated(tokenizer, "It is 4.")
    samples = [answer, *corrected_samples([answer], tokenizer)]
    config = TrainConfig()
    inputs = prepare_step(
        samples, config, has_ref_model=False, old_log_probs=None, advantages=torch.tensor([-1.0, 0.0])
    )
    model = load_tiny(base_dir)
    alone = collate_micro_batch(samples, pack_samples(samples[:1], 4096)[0])
    _, parts = micro_batch_loss(config, inputs, samples, alone, forward_logits(model, alone))
    assert float(parts["sft_loss"]) == 0.0


def test_a_correction_the_template_cannot_render_is_skipped_not_the_round(base_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(base_dir)
    good = rated(tokenizer, "4")
    tokenizer.chat_template = "{{ raise_exception('this template renders no assistant turn') }}"
    assert corrected_samples([good], tokenizer) == []
