"""AdamW with its state on the host steps exactly as AdamW does (the fused kernel it runs), skips
parameters without a gradient as AdamW does, and keeps no state on the device."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM

from learner.trainers.host_optimizer import HostAdamW
from tests.fixtures.tiny_model import tiny_model_path


def test_it_steps_exactly_like_adamw_with_a_second_group_of_its_own_rate() -> None:
    torch.manual_seed(0)
    models = [AutoModelForCausalLM.from_pretrained(tiny_model_path(), dtype=torch.float32) for _ in range(2)]
    heads = [torch.nn.Linear(64, 1) for _ in range(2)]
    heads[1].load_state_dict(heads[0].state_dict())
    groups = [
        [{"params": list(m.parameters())}, {"params": list(h.parameters()), "lr": 1e-2}]
        for m, h in zip(models, heads, strict=True)
    ]
    optimizers = [
        torch.optim.AdamW(groups[0], lr=1e-3, weight_decay=0.1, fused=True),
        HostAdamW(groups[1], lr=1e-3, weight_decay=0.1),
    ]
    ids = torch.randint(0, models[0].config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))
    for step in range(4):
        for model, head, optimizer in zip(models, heads, optimizers, strict=True):
            optimizer.zero_grad()
            out = model(ids, labels=ids, output_hidden_states=True)
            # From the third step the head gets no gradient: AdamW leaves it (no decay, no moments).
            extra = head(out.hidden_states[-1]).pow(2).mean() if step < 2 else 0.0
            (out.loss + extra).backward()
            optimizer.step()
    for a, b in zip(
        [*models[0].parameters(), *heads[0].parameters()],
        [*models[1].parameters(), *heads[1].parameters()],
        strict=True,
    ):
        assert torch.equal(a, b)
    assert not torch.equal(
        next(models[1].parameters()),
        next(AutoModelForCausalLM.from_pretrained(tiny_model_path(), dtype=torch.float32).parameters()),
    )
    # The moments live with the host copies; the optimizer the trainer holds has none.
    assert optimizers[1].state == {} and len(optimizers[1]._host.state) == len(optimizers[0].state)
