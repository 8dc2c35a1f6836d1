"""The torch backend's one forward of a packed micro-batch: its samples as right-padded rows (see
``learner.batching.PaddedRows``), each token through the experts its rollout used where the samples
carry their routes (``tandem.moe_routing``, R3)."""

from __future__ import annotations

from typing import Any

from torch import nn

from learner.batching import PackedMicroBatch, PaddedRows, padded_rows
from tandem.moe_routing import replayed_routing


def forward_rows(model: nn.Module, batch: PackedMicroBatch, **kwargs: Any) -> tuple[PaddedRows, Any]:
    """``batch``'s rows and the model's output on them (``kwargs`` go to the model)."""
    device = next(model.parameters()).device
    rows = padded_rows(batch)
    input_ids, position_ids = rows.inputs_on(device)
    with replayed_routing(model, rows.spread(batch.routed_experts, fill=-1)):
        return rows, model(input_ids=input_ids, position_ids=position_ids, **kwargs)
