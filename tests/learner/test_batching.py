"""Dynamic sampling, exclusion, loss masks and packing (a packed loss equals the unpacked ones)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from learner.algorithms.advantages import segment_ids
from learner.algorithms.losses import sample_mean
from learner.batching import (
    DynamicFilterOutput,
    FilterResult,
    MicroBatch,
    PackingError,
    apply_assistant_loss_mask,
    apply_dynamic_filter,
    assistant_loss_mask,
    call_buffer_filter,
    call_dynamic_filter,
    check_reward_nonzero_std,
    check_reward_nonzero_std_with_fallback,
    collate_micro_batch,
    pack_micro_batches,
    pack_samples,
    padded_rows,
    segment_masked_mean,
    sequence_loss_mask,
    should_drop_dynamic_filter_output,
    split_removed,
    training_loss_mask,
    zero_std_metrics,
)
from learner.plugins import HookKind, Plugin, PluginError, load_plugin
from learner.sample import Sample

EXAMPLES = "tests.learner.plugins_examples"


@dataclass
class Args:
    reward_key: str | None = None


def rewarded(*rewards: Any, group_index: int = 0) -> list[Sample]:
    return [Sample(prompt_token_ids=[1], response_token_ids=[2], group_index=group_index, reward=r) for r in rewards]


# dynamic sampling


def test_nonzero_std_keeps_varying_groups_and_names_the_constant_reward() -> None:
    assert check_reward_nonzero_std(Args(), rewarded(1.0, 0.0)) == DynamicFilterOutput(keep=True)
    assert check_reward_nonzero_std(Args(), rewarded(1.0, 1.0, 1.0)) == DynamicFilterOutput(False, "zero_std_1.0")
    assert check_reward_nonzero_std(Args(), rewarded(0.66, 0.66)).reason == "zero_std_0.7"  # slime rounds to 0.1
    assert check_reward_nonzero_std(Args(), rewarded(0.5)).reason == "zero_std_0.5"  # one sample never varies


def test_nonzero_std_reads_the_reward_key() -> None:
    group = rewarded({"a": 1.0, "b": 0.0}, {"a": 1.0, "b": 1.0})
    assert check_reward_nonzero_std(Args("b"), group).keep
    assert not check_reward_nonzero_std(Args("a"), group).keep


def test_fallback_variant_keeps_when_insufficient() -> None:
    output = check_reward_nonzero_std_with_fallback(Args(), rewarded(0.0, 0.0))
    assert not output.keep and output.keep_when_insufficient


def test_slimes_drop_rule() -> None:
    strict = DynamicFilterOutput(keep=False, reason="zero_std_0.0")
    fallback = DynamicFilterOutput(keep=False, reason="zero_std_0.0", keep_when_insufficient=True)
    assert should_drop_dynamic_filter_output(fallback, remaining_batch_size=3, target_data_size=2)
    assert not should_drop_dynamic_filter_output(fallback, remaining_batch_size=2, target_data_size=2)
    assert should_drop_dynamic_filter_output(strict, remaining_batch_size=2, target_data_size=2)
    assert should_drop_dynamic_filter_output(fallback, remaining_batch_size=0, target_data_size=None)
    assert not should_drop_dynamic_filter_output(DynamicFilterOutput(True), remaining_batch_size=9, target_data_size=1)


@dataclass
class SlimeStyleOutput:  # what slime's own DynamicFilterOutput looks like to us
    keep: bool
    reason: str | None = None


@pytest.mark.parametrize(
    ("fn", "expected"),
    [
        (None, DynamicFilterOutput(True)),
        (lambda args, group: False, DynamicFilterOutput(False)),
        (lambda args, group: torch.tensor(1.0) > 0.5, DynamicFilterOutput(True)),
        (lambda args, group: SlimeStyleOutput(False, "x"), DynamicFilterOutput(False, "x")),
        (lambda args, group: DynamicFilterOutput(torch.tensor(True), "y"), DynamicFilterOutput(True, "y")),  # type: ignore[arg-type]
    ],
)
def test_call_dynamic_filter_upgrades_every_form(fn: Any, expected: DynamicFilterOutput) -> None:
    output = call_dynamic_filter(fn, Args(), rewarded(1.0))
    assert output == expected and type(output.keep) is bool


def test_call_dynamic_filter_refuses_none() -> None:
    with pytest.raises(PluginError, match="returned None, not a DynamicFilterOutput or bool"):
        call_dynamic_filter(lambda args, group: None, Args(), rewarded(1.0))


def test_apply_dynamic_filter_drops_constant_groups_and_reports_slimes_metrics() -> None:
    groups = [rewarded(1.0, 0.0), rewarded(1.0, 1.0), rewarded(0.0, 0.0), rewarded(0.0, 0.0), rewarded(-1.0, 1.0)]
    result = apply_dynamic_filter(Args(), groups)
    assert result.kept == [groups[0], groups[4]]
    assert [reason for _, reason in result.dropped] == ["zero_std_1.0", "zero_std_0.0", "zero_std_0.0"]
    assert result.metrics() == {
        "rollout/dynamic_filter/drop_zero_std_1.0": 1,
        "rollout/dynamic_filter/drop_zero_std_0.0": 2,
    }
    assert result.surplus == []


def test_drops_without_a_reason_are_still_counted() -> None:
    result = apply_dynamic_filter(Args(), [rewarded(1.0)], lambda args, group: False)
    assert result.metrics() == {"rollout/dynamic_filter/drop_unspecified": 1}


def test_a_target_stops_filtering_and_leaves_surplus_groups() -> None:
    groups = [rewarded(1.0, 0.0, group_index=i) for i in range(4)]
    result = apply_dynamic_filter(Args(), groups, target_groups=2)
    assert result.kept == groups[:2] and result.surplus == groups[2:] and result.dropped == []


def test_keep_when_insufficient_fills_the_target_with_constant_groups() -> None:
    groups = [rewarded(0.0, 0.0), rewarded(1.0, 0.0), rewarded(1.0, 1.0)]
    strict = apply_dynamic_filter(Args(), groups, check_reward_nonzero_std, target_groups=2)
    assert strict.kept == [groups[1]] and len(strict.dropped) == 2
    # three candidates for two places: the first constant group may go, the second must stay
    fallback = apply_dynamic_filter(Args(), groups, check_reward_nonzero_std_with_fallback, target_groups=2)
    assert fallback.kept == [groups[1], groups[2]]
    assert [g for g, _ in fallback.dropped] == [groups[0]]


def test_apply_dynamic_filter_with_a_loaded_plugin() -> None:
    flagged = rewarded(1.0, 0.0)
    flagged[0].metadata["drop"] = True
    plugin = load_plugin(f"{EXAMPLES}:filter_drop_flagged", HookKind.DYNAMIC_FILTER)
    result = apply_dynamic_filter(Args(), [flagged, rewarded(1.0, 1.0)], plugin)
    assert result.drop_counts == {"drop_flag": 1} and len(result.kept) == 1
    with pytest.raises(PluginError, match="is not a dynamic-sampling filter"):
        apply_dynamic_filter(Args(), [], load_plugin(f"{EXAMPLES}:buffer_keep_rated", HookKind.BUFFER_FILTER))
    with pytest.raises(ValueError, match="target_groups must be >= 0"):
        apply_dynamic_filter(Args(), [], target_groups=-1)


def test_zero_std_metrics() -> None:
    groups = [rewarded(1.0, 1.0), rewarded(0.0, 0.0), rewarded(1.0, 1.0), rewarded(1.0, 0.0)]
    assert zero_std_metrics(groups) == {"rollout/zero_std/count_1.0": 2, "rollout/zero_std/count_0.0": 1}
    assert FilterResult().metrics() == {}


def test_buffer_filter_selects_from_the_given_groups() -> None:
    samples = rewarded(1.0, 0.0)
    samples[1].metadata["source"] = "corrected_answer"
    plugin = load_plugin(f"{EXAMPLES}:buffer_keep_rated", HookKind.BUFFER_FILTER)
    assert call_buffer_filter(plugin, Args(), 3, [samples]) == [[samples[0]]]


def test_a_slime_pop_first_buffer_filter_runs_unchanged() -> None:
    def pop_first(args: object, rollout_id: int | None, buffer: list[list[Sample]], num_samples: int) -> list:
        num_to_pop = min(len(buffer), num_samples)
        samples = buffer[:num_to_pop]
        del buffer[:num_to_pop]
        return samples

    groups = [rewarded(1.0, 0.0), rewarded(0.5, 0.5)]
    plugin = Plugin(HookKind.BUFFER_FILTER, "x:pop_first", pop_first, False, frozenset())
    assert call_buffer_filter(plugin, Args(), 0, groups) == groups and len(groups) == 2  # the caller's list kept


def test_buffer_filters_that_break_the_contract_are_refused() -> None:
    samples = rewarded(1.0, 0.0)
    as_tuple = Plugin(HookKind.BUFFER_FILTER, "x:y", lambda args, r, b, n: tuple(b), False, frozenset())
    with pytest.raises(PluginError, match="returned a tuple, not a list of groups"):
        call_buffer_filter(as_tuple, Args(), 0, [samples])
    flat = Plugin(HookKind.BUFFER_FILTER, "x:y", lambda args, r, b, n: b[0], False, frozenset())
    with pytest.raises(PluginError, match="not a list of groups"):
        call_buffer_filter(flat, Args(), 0, [samples])
    with pytest.raises(PluginError, match="is not a buffer filter"):
        dynamic = load_plugin(f"{EXAMPLES}:filter_legacy_bool", HookKind.DYNAMIC_FILTER)
        call_buffer_filter(dynamic, Args(), 0, [samples])


# exclusion and loss masks


def test_removed_samples_leave_the_batch_and_lose_their_mask() -> None:
    samples = rewarded(1.0, 0.0, 0.5)
    samples[1].remove_sample = True
    kept, removed = split_removed(samples)
    assert kept == [samples[0], samples[2]] and removed == [samples[1]]
    assert training_loss_mask(samples[1]) == [0]
    assert training_loss_mask(samples[0]) == [1]


def test_assistant_loss_mask() -> None:
    response = [50, 51, 99, 60, 61, 62, 52, 2]  # 99: a header token; 60-62: a tool result; 2: end of turn
    assert assistant_loss_mask(response) == [1] * 8
    masked = assistant_loss_mask(response, masked_token_ids={99}, non_assistant_spans=[(3, 6)])
    assert masked == [1, 1, 0, 0, 0, 0, 1, 1]
    with pytest.raises(ValueError, match="span \\[6, 9\\) is outside a response of 8 tokens"):
        assistant_loss_mask(response, non_assistant_spans=[(6, 9)])
    with pytest.raises(ValueError, match="outside"):
        assistant_loss_mask(response, non_assistant_spans=[(5, 4)])


def test_apply_assistant_loss_mask_narrows_an_existing_mask() -> None:
    sample = Sample(prompt_token_ids=[1, 2], response_token_ids=[5, 99, 6, 7], loss_mask=[0, 1, 1, 1])
    apply_assistant_loss_mask(sample, masked_token_ids=[99], non_assistant_spans=[(3, 4)])
    assert sample.loss_mask == [0, 0, 1, 0]
    assert sequence_loss_mask(sample) == [0, 0, 0, 0, 1, 0]


# packing


def test_packing_keeps_samples_whole_under_the_cap() -> None:
    lengths = [2, 5, 4, 7, 1, 3, 8]
    batches = pack_micro_batches(lengths, 10)
    assert len(batches) == 3  # total 30 over a cap of 10: optimal; slime's in-order first fit needs 4
    assert sorted(i for b in batches for i in b.sample_indices) == list(range(7))
    for batch in batches:
        assert batch.num_tokens <= 10
        assert list(batch.sample_indices) == sorted(batch.sample_indices)
        assert [end - start for start, end in batch.bounds()] == [lengths[i] for i in batch.sample_indices]
    assert [b.sample_indices[0] for b in batches] == sorted(b.sample_indices[0] for b in batches)
    assert batches == pack_micro_batches(lengths, 10)  # deterministic


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 50), max_size=40), st.integers(50, 120))
def test_packing_invariants(lengths: list[int], cap: int) -> None:
    batches = pack_micro_batches(lengths, cap)
    assert sorted(i for b in batches for i in b.sample_indices) == list(range(len(lengths)))
    assert all(b.num_tokens <= cap for b in batches)
    assert all(b.cu_seqlens[-1] == sum(lengths[i] for i in b.sample_indices) for b in batches)
    # first fit never leaves two bins that could have been one
    sums = sorted(b.num_tokens for b in batches)
    assert len(sums) < 2 or sums[0] + sums[1] > cap


@pytest.mark.parametrize(
    ("lengths", "cap", "message"),
    [
        ([3, 12, 4, 11], 10, "2 sample\\(s\\) exceed max_tokens_per_device=10 \\(#1: 12, #3: 11\\)"),
        ([3, 0], 10, "samples \\[1\\] have no tokens"),
        ([3], 0, "max_tokens_per_device must be positive"),
    ],
)
def test_packing_refuses(lengths: list[int], cap: int, message: str) -> None:
    with pytest.raises(PackingError, match=message):
        pack_micro_batches(lengths, cap)


def test_micro_batch_validates_offsets() -> None:
    with pytest.raises(PackingError, match="start at 0"):
        MicroBatch((0,), (1, 3))
    with pytest.raises(PackingError, match="increase strictly"):
        MicroBatch((0, 1), (0, 2, 2))


def samples_for_packing() -> list[Sample]:
    gen = torch.Generator().manual_seed(0)
    out = []
    for i, (p, r) in enumerate([(3, 4), (5, 2), (2, 6), (4, 1), (6, 3)]):
        ids = torch.randint(3, 40, (p + r,), generator=gen).tolist()
        mask = torch.randint(0, 2, (r,), generator=gen).tolist()
        mask[0] = 1
        out.append(Sample(prompt_token_ids=ids[:p], response_token_ids=ids[p:], loss_mask=mask, index=i))
    out[3].remove_sample = True
    return out


def test_collate_lays_samples_end_to_end() -> None:
    samples = samples_for_packing()
    [batch] = pack_samples(samples[:2], 100)
    packed = collate_micro_batch(samples, batch)
    assert packed.input_ids.tolist() == samples[0].tokens + samples[1].tokens
    assert packed.position_ids.tolist() == list(range(7)) + list(range(7))
    assert packed.loss_mask.tolist() == sequence_loss_mask(samples[0]) + sequence_loss_mask(samples[1])
    assert packed.cu_seqlens.tolist() == [0, 7, 14] and packed.cu_seqlens.dtype == torch.int32


def test_collate_refuses_changed_or_promptless_samples() -> None:
    samples = samples_for_packing()
    [batch] = pack_samples(samples[:1], 100)
    samples[0].response_token_ids = [*samples[0].response_token_ids, 5]
    samples[0].loss_mask = None
    with pytest.raises(PackingError, match="sample 0 has 8 tokens, packed as 7"):
        collate_micro_batch(samples, batch)
    promptless = [Sample(response_token_ids=[4, 5])]
    with pytest.raises(PackingError, match="no prompt token"):
        collate_micro_batch(promptless, pack_samples(promptless, 10)[0])
    images = [Sample(tokens=[1, 2, 3], response_length=1, multimodal_train_inputs={"pixel_values": []})]
    with pytest.raises(PackingError, match="multimodal_train_inputs: tandem trains text-only models"):
        collate_micro_batch(images, pack_samples(images, 10)[0])


def test_packed_masked_mean_equals_the_unpacked_per_sample_means() -> None:
    samples = samples_for_packing()
    gen = torch.Generator().manual_seed(1)
    token_losses = [torch.rand(s.total_length, generator=gen, dtype=torch.float64) for s in samples]
    unpacked = [
        (loss * torch.tensor(sequence_loss_mask(s), dtype=torch.float64)).sum() / max(sum(sequence_loss_mask(s)), 1)
        for s, loss in zip(samples, token_losses, strict=True)
    ]
    for batch in pack_samples(samples, 14):
        packed = collate_micro_batch(samples, batch)
        values = torch.cat([token_losses[i] for i in batch.sample_indices])
        per_sample = segment_masked_mean(values, packed.loss_mask, packed.cu_seqlens)
        torch.testing.assert_close(per_sample, torch.stack([unpacked[i] for i in batch.sample_indices]))
    assert unpacked[3] == 0  # the removed sample contributes nothing


def test_the_packed_layout_is_the_one_the_losses_read() -> None:
    """``learner.algorithms.losses.sample_mean`` over packed micro-batches adds up to the unpacked mean."""
    samples = samples_for_packing()
    gen = torch.Generator().manual_seed(2)
    token_losses = [torch.rand(s.total_length, generator=gen, dtype=torch.float64) for s in samples]
    masks = [torch.tensor(sequence_loss_mask(s), dtype=torch.float64) for s in samples]
    expected = torch.stack([(x * m).sum() / m.sum().clamp(min=1) for x, m in zip(token_losses, masks, strict=True)])
    total = torch.zeros((), dtype=torch.float64)
    for batch in pack_samples(samples, 14):
        packed = collate_micro_batch(samples, batch)
        values = torch.cat([token_losses[i] for i in batch.sample_indices])
        total += sample_mean(values, packed.loss_mask, len(samples), cu_seqlens=packed.cu_seqlens)
    torch.testing.assert_close(total, expected.mean())


def test_segment_masked_mean_checks_shapes() -> None:
    with pytest.raises(ValueError, match="must both be \\(5,\\)"):
        segment_masked_mean(torch.zeros(4), torch.zeros(5), torch.tensor([0, 2, 5]))


class TinyLM(torch.nn.Module):
    """Token + position embeddings, one causal self-attention layer, a head: enough to couple tokens."""

    def __init__(self, vocab: int = 40, dim: int = 16) -> None:
        super().__init__()
        self.tok = torch.nn.Embedding(vocab, dim)
        self.pos = torch.nn.Embedding(64, dim)
        self.qkv = torch.nn.Linear(dim, 3 * dim)
        self.head = torch.nn.Linear(dim, vocab)

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.tok(ids) + self.pos(positions)
        q, k, v = self.qkv(h).chunk(3, dim=-1)
        h = h + torch.nn.functional.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=mask)[0]
        return self.head(h)


def block_causal_mask(cu_seqlens: torch.Tensor) -> torch.Tensor:
    """``[T, T]`` bool mask: token i sees token j iff same sample and j <= i (packed attention, exactly)."""
    segments = segment_ids(cu_seqlens)
    causal = torch.ones(segments.numel(), segments.numel(), dtype=torch.bool).tril()
    return causal & (segments[:, None] == segments[None, :])


def token_nll(model: TinyLM, ids: torch.Tensor, positions: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
    """Per-token loss of predicting token t from the logits at t - 1 (0 at position 0)."""
    logp = torch.log_softmax(model(ids, positions, attn)[:-1], dim=-1)
    nll = -logp.gather(-1, ids[1:, None])[:, 0]
    return torch.cat([nll.new_zeros(1), nll])


def test_a_packed_forward_and_loss_equal_the_unpacked_ones() -> None:
    torch.manual_seed(0)
    model = TinyLM().double()
    samples = samples_for_packing()

    unpacked = []
    for s in samples:
        ids = torch.tensor(s.tokens)
        loss = token_nll(
            model, ids, torch.arange(s.total_length), torch.ones(len(ids), len(ids), dtype=torch.bool).tril()
        )
        mask = torch.tensor(sequence_loss_mask(s), dtype=torch.float64)
        unpacked.append((loss * mask).sum() / mask.sum().clamp(min=1))
    model.zero_grad()
    torch.stack(unpacked).sum().backward()
    unpacked_grads = [p.grad.clone() for p in model.parameters()]

    model.zero_grad()
    packed_losses = {}
    batches = pack_samples(samples, 16)
    assert len(batches) > 1 and any(len(b.sample_indices) > 1 for b in batches)
    for batch in batches:
        packed = collate_micro_batch(samples, batch)
        loss = token_nll(model, packed.input_ids, packed.position_ids, block_causal_mask(packed.cu_seqlens))
        per_sample = segment_masked_mean(loss, packed.loss_mask, packed.cu_seqlens)
        per_sample.sum().backward()
        packed_losses.update(zip(batch.sample_indices, per_sample.detach(), strict=True))

    torch.testing.assert_close(
        torch.stack([packed_losses[i] for i in range(len(samples))]), torch.stack(unpacked).detach()
    )
    for packed_grad, unpacked_grad in zip((p.grad for p in model.parameters()), unpacked_grads, strict=True):
        torch.testing.assert_close(packed_grad, unpacked_grad)


def test_without_the_block_mask_packing_would_leak_between_samples() -> None:
    """The check above can fail: plain causal attention over the packed row changes the losses."""
    torch.manual_seed(0)
    model = TinyLM().double()
    samples = samples_for_packing()[:2]
    [batch] = pack_samples(samples, 100)
    packed = collate_micro_batch(samples, batch)
    n = packed.input_ids.numel()
    right = token_nll(model, packed.input_ids, packed.position_ids, block_causal_mask(packed.cu_seqlens))
    leaky = token_nll(model, packed.input_ids, packed.position_ids, torch.ones(n, n, dtype=torch.bool).tril())
    first = slice(0, samples[0].total_length)
    torch.testing.assert_close(right[first], leaky[first])  # the first sample sees nothing before it either way
    assert not torch.allclose(right[first.stop :], leaky[first.stop :])


def test_block_causal_mask() -> None:
    mask = block_causal_mask(torch.tensor([0, 2, 3], dtype=torch.int32))
    assert mask.tolist() == [[True, False, False], [True, True, False], [False, False, True]]


def test_padded_rows_lay_each_sample_in_its_own_row_and_map_back() -> None:
    samples = [
        Sample(prompt_token_ids=[1, 2], response_token_ids=[3]),
        Sample(prompt_token_ids=[4], response_token_ids=[5, 6, 7, 8]),
        Sample(prompt_token_ids=[9], response_token_ids=[10]),
    ]
    packed = collate_micro_batch(samples, MicroBatch((1, 0, 2), (0, 5, 8, 10)))
    rows = padded_rows(packed)
    assert rows.input_ids.tolist() == [[4, 5, 6, 7, 8], [1, 2, 3, 0, 0], [9, 10, 0, 0, 0]]
    assert rows.position_ids.tolist() == [list(range(5))] * 3  # counting on through the padding
    assert rows.token_index is not None
    assert rows.packed(rows.input_ids).tolist() == packed.input_ids.tolist()
    hidden = rows.input_ids[..., None].expand(3, 5, 2)  # a [B, L, H] output maps back to [T, H]
    assert rows.packed(hidden)[:, 1].tolist() == packed.input_ids.tolist()

    equal = [
        Sample(prompt_token_ids=[9], response_token_ids=[10]),
        Sample(prompt_token_ids=[11], response_token_ids=[12]),
    ]
    same_length = padded_rows(collate_micro_batch(equal, MicroBatch((0, 1), (0, 2, 4))))
    assert same_length.input_ids.tolist() == [[9, 10], [11, 12]]
    assert same_length.token_index is None  # no padding: the rows flattened are the packed row

    even = padded_rows(collate_micro_batch(equal, MicroBatch((0, 1), (0, 2, 4))), length_multiple=4)
    assert even.input_ids.tolist() == [[9, 10, 0, 0], [11, 12, 0, 0]]  # sequence parallel: L divisible by 4
    assert even.packed(even.input_ids).tolist() == [9, 10, 11, 12]
