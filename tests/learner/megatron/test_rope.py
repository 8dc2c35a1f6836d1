"""The five-kernel RoPE gives megatron's unfused RoPE: values and gradients, and hands other layouts back."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from megatron.core.models.common.embeddings import rope_utils
from megatron.core.transformer.transformer_config import TransformerConfig

from learner.megatron.rope import apply_rotary_pos_emb

CONFIG = TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=4)
pytestmark = pytest.mark.usefixtures("world")  # megatron's function reads the context-parallel group


def _freqs(seq: int, dim: int) -> torch.Tensor:
    """megatron's ``[s, 1, 1, dim]`` rotate-half frequencies: ``cat(f, f)``."""
    inv_freq = 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim))
    freqs = torch.outer(torch.arange(seq).float(), inv_freq)
    return torch.cat([freqs, freqs], dim=-1)[:, None, None, :]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_values_and_gradients_match_megatrons(dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(0)
    # a query split from a fused projection, as megatron hands it over: not contiguous
    fused = torch.randn(12, 3, 4, 48, generator=generator).to(dtype)
    freqs, grad = _freqs(12, 16), torch.randn(12, 3, 4, 16, generator=generator).to(dtype)
    results = []
    for rope in (apply_rotary_pos_emb, rope_utils.apply_rotary_pos_emb):
        query = fused[..., 16:32].detach().requires_grad_()
        out = rope(query, freqs, config=CONFIG)
        out.backward(grad)
        results.append((out.detach(), query.grad))
    (out, query_grad), (expected, expected_grad) = results
    assert torch.equal(out, expected)  # the same roundings in the same order
    tolerance = {"rtol": 0, "atol": 2e-2} if dtype == torch.bfloat16 else {"rtol": 1e-6, "atol": 1e-6}
    torch.testing.assert_close(query_grad, expected_grad, **tolerance)  # autograd sums in another order
    assert not torch.equal(out, fused[..., 16:32])  # it rotated something


def test_other_layouts_are_megatrons_own() -> None:
    t, freqs = torch.randn(8, 1, 2, 16), _freqs(8, 16)
    interleaved = dataclasses.replace(CONFIG, rotary_interleaved=True)
    for kwargs in ({"config": interleaved}, {"config": CONFIG, "mscale": 0.5}):
        assert torch.equal(
            apply_rotary_pos_emb(t, freqs, **kwargs), rope_utils.apply_rotary_pos_emb(t, freqs, **kwargs)
        )
    partial = _freqs(8, 8)  # a rotary part narrower than the head
    assert torch.equal(
        apply_rotary_pos_emb(t, partial, config=CONFIG), rope_utils.apply_rotary_pos_emb(t, partial, config=CONFIG)
    )
