"""PPO's critic: a value head over the policy's last hidden states (slime's ``--advantage-estimator ppo``).

slime trains a separate critic model. Here the critic is a linear head reading the policy's final
hidden states, detached: its value loss trains the head alone, and the policy's gradient is the
policy loss's, as with slime's separate critic. It learns at its own rate (``TrainConfig.critic_lr``,
slime's ``--critic-lr``), is saved with each checkpoint (``critic/value_head.safetensors``, beside
the weights: engines read only the top-level weight files, and the checkpoint's sha256 covers those)
and the next round starts from its parent's. A value is the state's before a token, aligned as the
token's log-prob is (the hidden state one position earlier).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from learner.batching import PackedMicroBatch, collate_micro_batch, pack_samples
from learner.sample import Sample
from learner.trainers.row_forward import forward_rows
from learner.trainers.step_loss import shifted

__all__ = ["VALUE_HEAD_FILE", "ValueHead", "forward_logits_and_values", "response_values"]

VALUE_HEAD_FILE = Path("critic") / "value_head.safetensors"


class ValueHead(nn.Module):
    """``V = w · h + b`` over detached hidden states; zeros at first (every state is worth 0)."""

    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        self.linear = nn.Linear(hidden_size, 1)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)

    def forward(self, hidden: Tensor) -> Tensor:
        return self.linear(hidden.detach().float()).squeeze(-1)

    @classmethod
    def load(cls, checkpoint_dir: Path, hidden_size: int, device: torch.device | str = "cpu") -> ValueHead:
        """The head saved with ``checkpoint_dir`` (its round trained PPO), else a fresh one."""
        head = cls(hidden_size)
        path = Path(checkpoint_dir) / VALUE_HEAD_FILE
        if path.is_file():
            head.load_state_dict(load_file(path))
        return head.to(device)

    def save(self, checkpoint_dir: Path) -> None:
        """Write the head into ``checkpoint_dir`` (a file renamed into place: never half written)."""
        path = Path(checkpoint_dir) / VALUE_HEAD_FILE
        path.parent.mkdir(parents=True, exist_ok=True)
        staging = path.with_suffix(".tmp")
        save_file({k: v.detach().cpu().contiguous() for k, v in self.state_dict().items()}, staging)
        os.replace(staging, path)


def forward_logits_and_values(model: nn.Module, head: ValueHead, batch: PackedMicroBatch) -> tuple[Tensor, Tensor]:
    """``[T, V]`` logits of the packed row and ``[T]`` values (0 at each sample's first token; the
    value of token t's state is the head on the hidden state at t - 1)."""
    rows, output = forward_rows(model, batch, output_hidden_states=True)
    values = head(rows.packed(output.hidden_states[-1]))
    return rows.packed(output.logits), shifted(values, batch.cu_seqlens)


@torch.no_grad()
def response_values(
    model: nn.Module, head: ValueHead, samples: Sequence[Sample], max_tokens_per_micro_batch: int
) -> list[Tensor]:
    """Each sample's ``[response_length]`` values before the update (GAE's and the value clip's)."""
    result: list[Tensor | None] = [None] * len(samples)
    for micro_batch in pack_samples(samples, max_tokens_per_micro_batch):
        batch = collate_micro_batch(samples, micro_batch)
        _, values = forward_logits_and_values(model, head, batch)
        cu = batch.cu_seqlens.tolist()
        for k, index in enumerate(batch.sample_indices):
            result[index] = values[cu[k + 1] - samples[index].response_length : cu[k + 1]].cpu()
    return [values for values in result if values is not None]
