"""Context parallel without TransformerEngine: the load-balanced split, RoPE and attention under it, and
whole training steps over several gloo ranks against one process.

The split, megatron's RoPE and ``SDPAttention`` are checked in one process (the all-gather replaced by
every rank's part, taken from the whole row). The step runs in ranks started by ``run_child``
(``context_parallel_rank``) on samples of odd, unequal lengths: loss parts, log-probs, every gradient
and the weights after one Adam step must equal a world of one's, which also proves the gradient
scaling (a factor of the CP size anywhere would show). Layouts: CP=2, CP=3, CP=2 x DP=2, and CP=2
for Qwen3-MoE and DeepSeek-V3's multi-latent attention with YaRN.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_thd
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.transformer_config import TransformerConfig
from safetensors.torch import load_file

from learner.child_process import run_child
from learner.megatron import sdpa_attention
from learner.megatron.context_parallel import held_positions, split_row
from learner.megatron.sdpa_attention import SDPAttention
from learner.megatron_config import MegatronConfig
from tests.learner.megatron.conftest import FAMILIES, MOE, random_hf, saved_state

LENGTHS = (7, 13, 4, 1, 30)  # odd, unequal, one shorter than 2 * cp


@dataclass(frozen=True)
class _Group:
    """What RoPE and attention ask of a process group: its size and this rank's place in it."""

    ranks: int
    me: int

    def size(self) -> int:
        return self.ranks

    def rank(self) -> int:
        return self.me


def padded(lengths: tuple[int, ...], size: int) -> tuple[int, ...]:
    return tuple(n + -n % (2 * size) for n in lengths)


def test_each_rank_holds_chunks_r_and_its_mirror() -> None:
    # segments padded to 8, 8, 4 (chunks of 2, 2, 1): rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2
    zero, one = (split_row((5, 8, 3), size=2, rank=r) for r in (0, 1))
    assert zero.cu_seqlens.tolist() == one.cu_seqlens.tolist() == [0, 8, 16, 20]
    assert zero.held.tolist() == [0, 1, 6, 7, 8, 9, 14, 15, 16, 19]
    assert one.held.tolist() == [2, 3, 4, 5, 10, 11, 12, 13, 17, 18]
    assert zero.positions.tolist() == [0, 1, 6, 7, 0, 1, 6, 7, 0, 3]
    assert zero.tokens.tolist() == [*range(5), *range(8, 16), *range(16, 19)]
    assert zero.max_seqlen == 8
    # sequence parallel over 4 ranks: a padding segment makes each rank's part a multiple of 4
    assert split_row((5, 8, 3), size=2, rank=0, row_multiple=4).cu_seqlens.tolist() == [0, 8, 16, 20, 24]


@pytest.mark.parametrize("size", [2, 3, 4])
def test_the_parts_gather_back_into_the_row(size: int) -> None:
    row = torch.randn(sum(LENGTHS))
    splits = [split_row(LENGTHS, size=size, rank=r) for r in range(size)]
    parts = torch.cat([s.local(row) for s in splits])  # what the all-gather returns, rank by rank
    assert len({len(s.held) for s in splits}) == 1
    for split in splits:
        torch.testing.assert_close(parts.index_select(0, split.row_index), row, rtol=0, atol=0)
    # the targets: wherever a token is held, the token after it in its sample
    ids = torch.arange(100, 100 + sum(LENGTHS))
    starts = set(torch.tensor([0, *LENGTHS]).cumsum(0).tolist())
    checked = 0
    for split in splits:
        targets, local = split.targets(ids), {p: j for j, p in enumerate(split.held.tolist())}
        for i, position in enumerate(split.tokens.tolist()):
            if position in local and i + 1 not in starts:
                assert int(targets[local[position]]) == int(ids[i + 1])
                checked += 1
    assert checked == sum(LENGTHS) - len(LENGTHS)


@pytest.mark.parametrize("size", [2, 3, 4])
def test_every_rank_gets_the_same_causal_attention_work(size: int) -> None:
    """A position attends to the keys up to itself: a rank's work is the sum of (position + 1) it holds."""
    segments = padded(LENGTHS, size)
    starts = torch.tensor([0, *segments]).cumsum(0)

    def work(held: torch.Tensor) -> int:
        segment = torch.searchsorted(starts, held, right=True) - 1
        return int((held - starts[segment] + 1).sum())

    balanced = [work(held_positions(segments, size, r)) for r in range(size)]
    assert len(set(balanced)) == 1
    # the naive split (rank r holding the r-th contiguous part of each segment) is not balanced
    naive = [
        work(
            torch.cat(
                [
                    torch.arange(s + r * n // size, s + (r + 1) * n // size)
                    for s, n in zip(starts, segments, strict=False)
                ]
            )
        )
        for r in range(size)
    ]
    assert sum(naive) == sum(balanced) and max(naive) > max(balanced)


@pytest.mark.parametrize("size", [2, 3])
def test_rope_gives_each_held_position_its_true_rotation(size: int) -> None:
    segments = padded(LENGTHS, size)
    cu_seqlens = torch.tensor([0, *segments]).cumsum(0).to(torch.int32)
    inv_freq = 1.0 / 10000 ** (torch.arange(0, 16, 2).float() / 16)
    angles = torch.outer(torch.arange(max(segments)).float(), inv_freq)
    freqs = torch.cat([angles, angles], dim=-1)[:, None, None, :]  # megatron's [max_s, 1, 1, d]
    row = torch.randn(int(cu_seqlens[-1]), 2, 16)
    whole = _apply_rotary_pos_emb_thd(row, cu_seqlens, freqs, cp_group=_Group(1, 0))
    for rank in range(size):
        held = held_positions(segments, size, rank)
        part = _apply_rotary_pos_emb_thd(row[held], cu_seqlens, freqs, cp_group=_Group(size, rank))
        torch.testing.assert_close(part, whole[held], rtol=0, atol=0)


@pytest.mark.parametrize("size", [2, 3])
def test_attention_over_the_gathered_keys_equals_the_whole_row(
    world: MegatronConfig, monkeypatch: pytest.MonkeyPatch, size: int
) -> None:
    config = TransformerConfig(
        num_layers=1, hidden_size=64, num_attention_heads=4, num_query_groups=2, kv_channels=16, attention_dropout=0.0
    )
    attention = SDPAttention(config, 1, AttnMaskType.causal, "self").eval()
    segments = padded(LENGTHS, size)
    cu_seqlens = torch.tensor([0, *segments]).cumsum(0).to(torch.int32)
    packed = PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu_seqlens,
        cu_seqlens_kv=cu_seqlens,
        max_seqlen_q=max(segments),
        max_seqlen_kv=max(segments),
    )
    generator = torch.Generator().manual_seed(0)
    query, key, value = (torch.randn(int(cu_seqlens[-1]), h, 16, generator=generator) for h in (4, 2, 2))
    whole = attention(query, key, value, None, packed_seq_params=packed)  # one causal call per segment
    both = torch.cat([key.flatten(1), value.flatten(1)], dim=1)
    gathered = torch.cat([both[held_positions(segments, size, r)] for r in range(size)])
    out = torch.empty_like(whole)
    for rank in range(size):
        held = held_positions(segments, size, rank)

        def all_gather(tensor: torch.Tensor, group: Any, held: torch.Tensor = held) -> torch.Tensor:
            torch.testing.assert_close(tensor, both[held], rtol=0, atol=0)  # this rank's keys and values
            return gathered

        monkeypatch.setattr(sdpa_attention, "all_gather", all_gather)
        attention.cp_group = _Group(size, rank)  # type: ignore[assignment]
        out[held] = attention(query[held], key[held], value[held], None, packed_seq_params=packed)
    torch.testing.assert_close(out, whole, rtol=0, atol=2e-6)
    with pytest.raises(ValueError, match="context parallel: only packed rows"):
        attention(query[:, None], key[:, None], value[:, None], None)


# Whole steps over several ranks.

CASES: dict[str, tuple[str, int, int, dict[str, Any]]] = {
    "qwen2 cp2": ("qwen2", 2, 1, {"kl_loss_coef": 0.05, "entropy_coef": 0.01}),
    "qwen2 cp3": ("qwen2", 3, 1, {"kl_loss_coef": 0.05, "entropy_coef": 0.01}),
    "qwen2 cp2 x dp2": ("qwen2", 2, 2, {"kl_loss_coef": 0.05, "entropy_coef": 0.01}),
    "qwen3_moe cp2": ("qwen3_moe", 2, 1, {"reduction": "token_mean", "use_tis": True, "entropy_coef": 0.01}),
    "deepseek_v3 mla yarn cp2": ("deepseek_v3-dense-yarn-q-proj", 2, 1, {"kl_loss_coef": 0.05}),
}
MICRO_BATCH_TOKENS = 24  # 6 samples of 3 to 14 tokens: 3 micro-batches, uneven over 2 replicas


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path]]:
    """Each family's policy and (other) KL reference, random, saved in float32."""
    root = tmp_path_factory.mktemp("cp-models")
    folders = {}
    for family in {case[0] for case in CASES.values()}:
        make = {**FAMILIES, **MOE}[family]
        pair = []
        for seed, role in enumerate(("policy", "reference")):
            saved_state(random_hf(make(), seed=seed), root / family / role)
            pair.append(root / family / role)
        folders[family] = (pair[0], pair[1])
    return folders


def run_step(folders: tuple[Path, Path], cp: int, dp: int, loss: dict[str, Any], out: Path) -> dict[str, Any]:
    """One step in ``cp * dp`` ranks; the cap per device keeps the same micro-batches for every CP size."""
    layout = MegatronConfig(devices=cp * dp, context_parallel=cp)
    request = {
        "layout": layout.to_dict(),
        "loss": loss,
        "max_tokens": MICRO_BATCH_TOKENS // cp,
        "samples": 6,
        "seed": 2,
        "vocab": 256,
        "policy": str(folders[0]),
        "reference": str(folders[1]),
        "out": str(out),
    }
    module = "tests.learner.megatron.context_parallel_rank"
    result = run_child(module, json.dumps(request), timeout_s=300, what="training", processes=cp * dp)
    assert result.outcome == {"ok": True}, result.error or result.outcome
    return torch.load(out)


@pytest.fixture(scope="module")
def one_process() -> dict[tuple[str, str], dict[str, Any]]:
    """The world of one's step per family and loss, run once for every case that shares it."""
    return {}


@pytest.mark.parametrize("name", CASES)
def test_context_parallel_steps_like_one_process(
    models: dict[str, tuple[Path, Path]], one_process: dict[tuple[str, str], dict[str, Any]], tmp_path: Path, name: str
) -> None:
    family, cp, dp, loss = CASES[name]
    key = (family, json.dumps(loss))
    if key not in one_process:
        one_process[key] = run_step(models[family], 1, 1, loss, tmp_path / "one.pt")
    expected = one_process[key]
    got = run_step(models[family], cp, dp, loss, tmp_path / "cp.pt")

    assert got["totals"].keys() == expected["totals"].keys()
    for part, value in expected["totals"].items():
        # abs: the KL parts are means of log-prob differences, and the log-probs agree within 2e-6 below
        assert got["totals"][part] == pytest.approx(value, rel=1e-5, abs=1e-6), part
    for mine, theirs in zip(got["log_probs"], expected["log_probs"], strict=True):
        torch.testing.assert_close(mine, theirs, rtol=0, atol=2e-6)
    assert got["grads"].keys() == expected["grads"].keys()
    for tensor, grad in expected["grads"].items():
        # within 1e-5 of the tensor's largest gradient (measured: 8e-7); a wrong scale is off by 2x
        scale = float(grad.abs().max())
        torch.testing.assert_close(got["grads"][tensor], grad, rtol=0, atol=1e-5 * scale + 1e-12, msg=tensor)
    assert expected["grad_norm"] > 0.1
    assert got["grad_norm"] == pytest.approx(expected["grad_norm"], rel=1e-5)
    # Adam's first step is about lr x sign(gradient), noisy where a gradient is rounding noise: compare
    # each tensor's update as a whole (measured: 2e-4)
    base = load_file(models[family][0] / "model.safetensors")
    for tensor, weight in expected["weights"].items():
        update, expected_update = got["weights"][tensor] - base[tensor], weight - base[tensor]
        assert float((update - expected_update).norm()) <= 2e-3 * float(expected_update.norm()), tensor
