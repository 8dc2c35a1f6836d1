"""Weight-only int8 linear layers: outputs within int8's error of the float ones, weights changed in
place re-quantized, and the local engine serving with them."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn
from transformers import AutoModelForCausalLM

from server.engines.local.engine import LocalEngine
from server.engines.local.int8_linear import Int8Linear, int8_linears, quantize_int8
from server.engines.local.weights import copy_weights, read_state_dict
from tests.server.engines.helpers import greedy, reference_logprobs


def load(path: Path) -> nn.Module:
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@torch.inference_mode()
def logits(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids).logits


def relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    return float((got - expected).norm() / expected.norm())


def test_each_row_keeps_int8s_precision() -> None:
    weight = torch.randn(96, 64) * torch.logspace(-3, 0, 96)[:, None]  # rows of very different magnitudes
    values, scale = quantize_int8(weight)
    assert values.dtype == torch.int8 and scale.shape == (96,)
    assert values.abs().amax(dim=1).eq(127).all()  # each row's largest weight lands on 127
    restored = values.float() * scale.float()[:, None]
    # Half a step of each row's grid, plus the scale's own bf16 rounding (2^-9 of the value).
    bound = scale.float()[:, None] / 2 + weight.abs() * 2**-8
    assert ((restored - weight).abs() <= bound).all()


def test_int8_layers_stay_close_to_float_ones_and_follow_in_place_swaps(
    tiny_model: Path, perturbed_model: Path
) -> None:
    plain, quantized = load(tiny_model), load(tiny_model)
    assert int8_linears(quantized) == sum(type(m) is nn.Linear for m in plain.modules()) > 0
    assert all(isinstance(m, Int8Linear) for m in quantized.modules() if isinstance(m, nn.Linear))
    assert quantized.state_dict().keys() == plain.state_dict().keys()
    ids = torch.tensor([[1, 287, 201, 268, 318, 81, 638, 2]])
    # Measured on the tiny model: 1.1 % of the logits' norm (int8 weights, bf16 inputs to each linear).
    assert relative_error(logits(quantized, ids), logits(plain, ids)) < 0.02

    copy_weights(quantized, read_state_dict(perturbed_model))  # what a weight swap does
    assert relative_error(logits(quantized, ids), logits(load(perturbed_model), ids)) < 0.02
    assert relative_error(logits(quantized, ids), logits(plain, ids)) > 0.1


async def test_the_engine_serves_with_int8_linears(tiny_model: Path) -> None:
    engine = await LocalEngine.open(tiny_model, torch_threads=1, linear_weights="int8")
    try:
        prompt = [1, 287, 201, 268]
        chunks = [chunk async for chunk in engine.generate(prompt, greedy(6))]
        linears = [m for m in engine._model.modules() if isinstance(m, nn.Linear)]
        assert linears and all(type(m) is Int8Linear for m in linears)  # swapped on the engine thread
    finally:
        await engine.close()
    tokens = [t for c in chunks for t in c.token_ids]
    served = [lp for c in chunks for lp in c.logprobs]
    assert len(tokens) == 6
    # The log-probs it reports are the int8 model's: close to the float model's for the same tokens.
    expected = reference_logprobs(tiny_model, prompt, tokens)
    assert max(abs(a - b) for a, b in zip(served, expected, strict=True)) < 0.05
