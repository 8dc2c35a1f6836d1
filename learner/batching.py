"""From scored groups to micro-batches: dynamic-sampling filter, exclusion, loss masks, packing.

Dynamic sampling follows slime (``rollout/filter_hub``, ``sglang_rollout.generate_rollout``): a
filter sees one group and answers ``DynamicFilterOutput(keep, reason, keep_when_insufficient)`` or a
bare bool (slime's legacy form); dropped groups are counted per reason under slime's metric names
``rollout/dynamic_filter/drop_{reason}``. One difference: a drop without a reason is counted as
``drop_unspecified`` where slime does not count it, so every dropped group shows up somewhere.

Packing keeps every sample whole and lays samples end to end in one token row per micro-batch
(``cu_seqlens`` offsets, positions restarting at each sample), so attention and losses computed per
segment equal the unpacked ones. Bins are filled first-fit-decreasing (slime fills first-fit in
input order: decreasing order needs fewer bins for the same cap); a sample longer than the cap is an
error here, where slime gives it a bin of its own over the cap, because the cap is a memory limit.
"""

from __future__ import annotations

import statistics
from collections import Counter
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from learner.algorithms.advantages import segment_ids
from learner.plugins import HookKind, Plugin, PluginError
from learner.sample import Sample
from learner.to_device import to_device

__all__ = [
    "DynamicFilterOutput",
    "FilterResult",
    "MicroBatch",
    "PackedMicroBatch",
    "PackingError",
    "PaddedRows",
    "apply_assistant_loss_mask",
    "apply_dynamic_filter",
    "assistant_loss_mask",
    "call_buffer_filter",
    "call_dynamic_filter",
    "check_reward_nonzero_std",
    "check_reward_nonzero_std_with_fallback",
    "collate_micro_batch",
    "pack_micro_batches",
    "pack_samples",
    "padded_rows",
    "segment_masked_mean",
    "sequence_loss_mask",
    "should_drop_dynamic_filter_output",
    "split_removed",
    "training_loss_mask",
    "zero_std_metrics",
]

ZERO_STD_EPSILON = 1e-6  # slime's: rewards whose std is below this do not vary
DROP_METRIC_PREFIX = "rollout/dynamic_filter/drop_"


# dynamic sampling


@dataclass(slots=True)
class DynamicFilterOutput:
    """slime's filter result: drop the group unless ``keep``; ``reason`` names the metric.

    ``keep_when_insufficient`` keeps a rejected group when dropping it would leave too few groups to
    reach the target (no extra oversampling round for it).
    """

    keep: bool
    reason: str | None = None
    keep_when_insufficient: bool = False


DynamicFilter = Callable[..., Any]


def check_reward_nonzero_std(args: object, samples: list[Sample], **kwargs: Any) -> DynamicFilterOutput:
    """Keep a group whose rewards vary (unbiased std above 1e-6; a group of one never varies)."""
    rewards = [s.get_reward_value(args) for s in samples]
    keep = len(rewards) > 1 and statistics.stdev(rewards) > ZERO_STD_EPSILON
    return DynamicFilterOutput(keep=keep, reason=None if keep else f"zero_std_{round(rewards[0], 1)}")


def check_reward_nonzero_std_with_fallback(args: object, samples: list[Sample], **kwargs: Any) -> DynamicFilterOutput:
    """Like ``check_reward_nonzero_std`` but keeps zero-std groups rather than leaving the batch short."""
    output = check_reward_nonzero_std(args, samples, **kwargs)
    output.keep_when_insufficient = True
    return output


def call_dynamic_filter(fn: Plugin | DynamicFilter | None, args: object, group: list[Sample]) -> DynamicFilterOutput:
    """Run a filter (None keeps everything) and upgrade slime's legacy bool result.

    Raises:
        PluginError: a result that is neither a DynamicFilterOutput nor a truth value (None included).
    """
    if fn is None:
        return DynamicFilterOutput(keep=True)
    output = fn.call(args, group) if isinstance(fn, Plugin) else fn(args, group)
    if isinstance(output, DynamicFilterOutput):
        return DynamicFilterOutput(bool(output.keep), output.reason, bool(output.keep_when_insufficient))
    if hasattr(output, "keep"):  # slime's own DynamicFilterOutput, from a slime install
        reason = getattr(output, "reason", None)
        return DynamicFilterOutput(bool(output.keep), reason, bool(getattr(output, "keep_when_insufficient", False)))
    if output is None or not hasattr(type(output), "__bool__"):
        name = fn.path if isinstance(fn, Plugin) else getattr(fn, "__qualname__", repr(fn))
        raise PluginError(f"dynamic filter {name!r} returned {output!r}, not a DynamicFilterOutput or bool")
    return DynamicFilterOutput(keep=bool(output))  # legacy: a bare truth value (a torch bool too)


def should_drop_dynamic_filter_output(
    output: DynamicFilterOutput, *, remaining_batch_size: int, target_data_size: int | None
) -> bool:
    """slime's rule; ``remaining_batch_size`` counts groups not dropped (kept + still to examine)."""
    if output.keep:
        return False
    insufficient = target_data_size is not None and remaining_batch_size <= target_data_size
    return not (output.keep_when_insufficient and insufficient)


@dataclass(slots=True)
class FilterResult:
    """Groups kept, dropped (with their reasons) and left over once the target was reached."""

    kept: list[list[Sample]] = field(default_factory=list)
    dropped: list[tuple[list[Sample], str | None]] = field(default_factory=list)
    surplus: list[list[Sample]] = field(default_factory=list)

    @property
    def drop_counts(self) -> dict[str, int]:
        return dict(Counter(reason or "unspecified" for _, reason in self.dropped))

    def metrics(self) -> dict[str, int]:
        return {f"{DROP_METRIC_PREFIX}{reason}": n for reason, n in self.drop_counts.items()}


def apply_dynamic_filter(
    args: object,
    groups: Sequence[list[Sample]],
    filter_fn: Plugin | DynamicFilter | None = check_reward_nonzero_std,
    *,
    target_groups: int | None = None,
) -> FilterResult:
    """Filter groups in order, as slime's rollout loop does once they are generated.

    Args:
        args: passed to the filter (the built-in reads ``args.reward_key`` if present).
        groups: the scored groups, in the order they finished.
        filter_fn: a DYNAMIC_FILTER plugin or a plain function; None keeps every group.
        target_groups: stop once this many are kept (the rest go to ``surplus``, for the next
            round); it also decides when ``keep_when_insufficient`` applies. None: no target.

    Raises:
        ValueError: a negative target.
        PluginError: a plugin of another kind, or a result of the wrong type.
    """
    if target_groups is not None and target_groups < 0:
        raise ValueError(f"target_groups must be >= 0, got {target_groups}")
    if isinstance(filter_fn, Plugin) and filter_fn.kind is not HookKind.DYNAMIC_FILTER:
        raise filter_fn.error("is not a dynamic-sampling filter")
    result = FilterResult()
    remaining = len(groups)
    for position, group in enumerate(groups):
        if target_groups is not None and len(result.kept) >= target_groups:
            result.surplus = list(groups[position:])
            break
        output = call_dynamic_filter(filter_fn, args, group)
        if should_drop_dynamic_filter_output(output, remaining_batch_size=remaining, target_data_size=target_groups):
            result.dropped.append((group, output.reason))
            remaining -= 1
        else:
            result.kept.append(group)
    return result


def zero_std_metrics(groups: Sequence[Sequence[Sample]], reward_key: str | None = None) -> dict[str, int]:
    """slime's ``rollout/zero_std/count_{reward}``: groups whose rewards are all equal, by that reward."""
    counts: Counter[str] = Counter()
    for group in groups:
        rewards = [s.reward_value(reward_key) for s in group]
        if rewards and all(r == rewards[0] for r in rewards):
            counts[str(round(rewards[0], 1))] += 1
    return {f"rollout/zero_std/count_{reward}": n for reward, n in counts.items()}


def call_buffer_filter(plugin: Plugin, args: object, rollout_id: int, groups: list[list[Sample]]) -> list[list[Sample]]:
    """Run a buffer filter with slime's contract, ``(args, rollout_id, buffer, num_samples)``: the
    buffer is the round's groups and ``num_samples`` all of them; it picks (and may reorder) groups,
    popping from the buffer as slime's ``pop_first`` does, and never invents samples.

    Raises:
        PluginError: a plugin of another kind, a result that is not a list of lists, or a sample
            that is not one of the given ones.
    """
    if plugin.kind is not HookKind.BUFFER_FILTER:
        raise plugin.error("is not a buffer filter")
    given = {id(s) for group in groups for s in group}
    selected = plugin.call(args, rollout_id, [list(group) for group in groups], len(groups))
    if not isinstance(selected, list) or not all(isinstance(group, list) for group in selected):
        raise plugin.error(f"returned a {type(selected).__name__}, not a list of groups (lists of samples)")
    for item in (s for group in selected for s in group):
        if not isinstance(item, Sample) or id(item) not in given:
            raise plugin.error(f"returned {type(item).__name__} that is not one of the given samples")
    return selected


# exclusion and loss masks


def split_removed(samples: Sequence[Sample]) -> tuple[list[Sample], list[Sample]]:
    """``(trainable, removed)`` by the ``remove_sample`` flag.

    Run after rewards are normalised, so removed samples still count in their group's baseline as in
    slime; dropping them from the batch then changes no other sample's loss (losses are per sample).
    """
    kept = [s for s in samples if not s.remove_sample]
    return kept, [s for s in samples if s.remove_sample]


def training_loss_mask(sample: Sample) -> list[int]:
    """The response loss mask the trainer uses: all zeros for a removed sample (slime's rule)."""
    return [0] * sample.response_length if sample.remove_sample else sample.resolved_loss_mask()


def trained_token_counts(samples: Sequence[Sample]) -> torch.Tensor:
    """``[N]`` float32: each sample's trained response tokens (its ``training_loss_mask`` sum), the
    weight of its advantage in token-level statistics."""
    return torch.tensor([sum(training_loss_mask(s)) for s in samples], dtype=torch.float32)


def assistant_loss_mask(
    response_token_ids: Sequence[int],
    *,
    masked_token_ids: Collection[int] = (),
    non_assistant_spans: Sequence[tuple[int, int]] = (),
) -> list[int]:
    """1 on the assistant's own response tokens, 0 on the rest.

    Args:
        response_token_ids: the response part of the sample (the prompt is never trained).
        masked_token_ids: special tokens never to train on (e.g. a turn header the template inserts).
            Leave the end-of-turn token out of it: the model must learn to stop.
        non_assistant_spans: ``[start, end)`` response positions that are not the model's own text
            (tool results, user turns inside a multi-turn response).

    Raises:
        ValueError: a span outside the response or with end < start.
    """
    n = len(response_token_ids)
    blocked = frozenset(masked_token_ids)
    mask = [0 if t in blocked else 1 for t in response_token_ids]
    for start, end in non_assistant_spans:
        if not 0 <= start <= end <= n:
            raise ValueError(f"span [{start}, {end}) is outside a response of {n} tokens")
        mask[start:end] = [0] * (end - start)
    return mask


def apply_assistant_loss_mask(
    sample: Sample,
    *,
    masked_token_ids: Collection[int] = (),
    non_assistant_spans: Sequence[tuple[int, int]] = (),
) -> None:
    """Narrow ``sample.loss_mask`` to assistant tokens (combined with any mask it already has)."""
    mask = assistant_loss_mask(
        sample.response_token_ids, masked_token_ids=masked_token_ids, non_assistant_spans=non_assistant_spans
    )
    sample.loss_mask = [a & b for a, b in zip(sample.resolved_loss_mask(), mask, strict=True)]


def sequence_loss_mask(sample: Sample) -> list[int]:
    """The loss mask over prompt + response: 0 on the prompt, ``training_loss_mask`` on the response."""
    return [0] * sample.prompt_length + training_loss_mask(sample)


# packing


class PackingError(ValueError):
    """Samples that cannot be packed under the token cap."""


@dataclass(frozen=True, slots=True)
class MicroBatch:
    """Samples laid end to end: sample ``sample_indices[k]`` is tokens ``cu_seqlens[k]:cu_seqlens[k+1]``."""

    sample_indices: tuple[int, ...]
    cu_seqlens: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.cu_seqlens) != len(self.sample_indices) + 1 or self.cu_seqlens[:1] != (0,):
            raise PackingError("cu_seqlens must start at 0 and have one more entry than sample_indices")
        if any(b <= a for a, b in zip(self.cu_seqlens, self.cu_seqlens[1:], strict=False)):
            raise PackingError("cu_seqlens must increase strictly (no empty samples)")

    @property
    def num_tokens(self) -> int:
        return self.cu_seqlens[-1]

    def bounds(self) -> list[tuple[int, int]]:
        """``[start, end)`` of each sample in the packed row, in ``sample_indices`` order."""
        return list(zip(self.cu_seqlens, self.cu_seqlens[1:], strict=False))


def pack_micro_batches(lengths: Sequence[int], max_tokens_per_device: int) -> list[MicroBatch]:
    """First-fit-decreasing packing of whole samples into bins of at most ``max_tokens_per_device``.

    Within a bin samples keep their input order; bins are ordered by their first sample, so the
    result does not depend on anything but the lengths.

    Raises:
        PackingError: a non-positive cap, an empty sample, or one longer than the cap.
    """
    if max_tokens_per_device < 1:
        raise PackingError(f"max_tokens_per_device must be positive, got {max_tokens_per_device}")
    empty = [i for i, n in enumerate(lengths) if n < 1]
    if empty:
        raise PackingError(f"samples {empty} have no tokens")
    too_long = [(i, n) for i, n in enumerate(lengths) if n > max_tokens_per_device]
    if too_long:
        listed = ", ".join(f"#{i}: {n}" for i, n in too_long)
        raise PackingError(
            f"{len(too_long)} sample(s) exceed max_tokens_per_device={max_tokens_per_device} ({listed}): "
            "truncate or drop them before packing"
        )
    bins: list[list[int]] = []
    free: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        target = next((b for b, room in enumerate(free) if lengths[i] <= room), None)
        if target is None:
            bins.append([i])
            free.append(max_tokens_per_device - lengths[i])
        else:
            bins[target].append(i)
            free[target] -= lengths[i]
    batches = []
    for members in sorted((sorted(b) for b in bins), key=lambda b: b[0]):
        offsets = [0]
        for i in members:
            offsets.append(offsets[-1] + lengths[i])
        batches.append(MicroBatch(tuple(members), tuple(offsets)))
    return batches


def pack_samples(samples: Sequence[Sample], max_tokens_per_device: int) -> list[MicroBatch]:
    """``pack_micro_batches`` over the samples' prompt + response lengths (indices into ``samples``)."""
    return pack_micro_batches([s.total_length for s in samples], max_tokens_per_device)


@dataclass(frozen=True, slots=True)
class PackedMicroBatch:
    """One packed token row and what a loss needs to treat each sample as if it were alone.

    ``loss_mask[t]`` is 1 when token ``t`` is a trained response token. Its log-prob comes from the
    logits at ``t - 1``: every sample starts with a prompt token (mask 0), so a prediction across a
    sample boundary is always masked out.
    """

    input_ids: torch.Tensor  # [T] int64
    position_ids: torch.Tensor  # [T] int64, restarting at 0 for each sample
    loss_mask: torch.Tensor  # [T] float32
    cu_seqlens: torch.Tensor  # [n + 1] int32
    sample_indices: tuple[int, ...]
    # [T] float32: each position's logits are divided by its sample's ``rollout_temperature`` before
    # scoring, as slime divides by --rollout-temperature; None when every sample's is 1.
    temperature: torch.Tensor | None = None
    # [T] float32: 1 on the positions of ``supervised`` samples (trained by the SFT term); None: none.
    supervised: torch.Tensor | None = None
    # [T, layers x top_k] int32: the experts each token's rollout routed it to (tandem.moe_routing),
    # -1 where none was recorded (each sample's last token, samples without); None: no sample has them.
    routed_experts: torch.Tensor | None = None


def collate_micro_batch(samples: Sequence[Sample], micro_batch: MicroBatch) -> PackedMicroBatch:
    """Build the packed tensors of ``micro_batch`` from ``samples`` (the list it was packed from).

    Raises:
        PackingError: a sample whose length changed since packing, one without a prompt token, or one
            with multimodal inputs (the trained models are text-only).
    """
    ids: list[int] = []
    positions: list[int] = []
    mask: list[int] = []
    temperature: list[float] = []
    supervised: list[float] = []
    for index, (start, end) in zip(micro_batch.sample_indices, micro_batch.bounds(), strict=True):
        sample = samples[index]
        sample.validate()
        if sample.total_length != end - start:
            raise PackingError(f"sample {index} has {sample.total_length} tokens, packed as {end - start}")
        if not sample.prompt_length:
            raise PackingError(f"sample {index} has no prompt token: its first response token has no prediction")
        if sample.multimodal_train_inputs is not None:
            raise PackingError(f"sample {index} has multimodal_train_inputs: tandem trains text-only models")
        ids += sample.tokens
        positions += range(sample.total_length)
        mask += sequence_loss_mask(sample)
        temperature += [sample.rollout_temperature] * sample.total_length
        supervised += [float(sample.supervised)] * sample.total_length
    routes = [samples[index].rollout_routed_experts for index in micro_batch.sample_indices]
    return PackedMicroBatch(
        input_ids=torch.tensor(ids, dtype=torch.long),
        position_ids=torch.tensor(positions, dtype=torch.long),
        loss_mask=torch.tensor(mask, dtype=torch.float32),
        cu_seqlens=torch.tensor(micro_batch.cu_seqlens, dtype=torch.int32),
        sample_indices=micro_batch.sample_indices,
        temperature=None if set(temperature) == {1.0} else torch.tensor(temperature, dtype=torch.float32),
        supervised=torch.tensor(supervised, dtype=torch.float32) if any(supervised) else None,
        routed_experts=_packed_routes(routes, [samples[i].total_length for i in micro_batch.sample_indices]),
    )


def _packed_routes(routes: Sequence[list[list[int]] | None], lengths: Sequence[int]) -> torch.Tensor | None:
    """The samples' recorded routes, one row per packed token (-1 rows where a sample has none)."""
    recorded = [torch.tensor(r, dtype=torch.int32) for r in routes if r]
    if not recorded:
        return None
    width = recorded[0].shape[1]
    rows = []
    for sample_routes, length in zip(routes, lengths, strict=True):
        if not sample_routes:
            rows.append(torch.full((length, width), -1, dtype=torch.int32))
            continue
        part = torch.tensor(sample_routes, dtype=torch.int32)
        if part.shape != (length - 1, width):
            raise PackingError(
                f"rollout_routed_experts is {list(part.shape)}, expected [{length - 1}, {width}]: a row per "
                "token but the last, each the same layers x top_k"
            )
        rows += [part, torch.full((1, width), -1, dtype=torch.int32)]
    return torch.cat(rows)


def segment_masked_mean(values: torch.Tensor, mask: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Per-sample ``sum(values * mask) / max(sum(mask), 1)`` over a packed row (slime's per-sample mean).

    Args:
        values: ``[T]`` per-token values (e.g. losses), differentiable.
        mask: ``[T]`` loss mask.
        cu_seqlens: ``[n + 1]`` sample offsets.

    Returns:
        ``[n]``, one mean per sample, exactly what each sample gives alone.

    Raises:
        ValueError: shapes that do not match ``cu_seqlens``.
    """
    total = int(cu_seqlens[-1])
    if values.shape != (total,) or mask.shape != (total,):
        raise ValueError(f"values {tuple(values.shape)} and mask {tuple(mask.shape)} must both be ({total},)")
    segments = segment_ids(cu_seqlens)
    n = cu_seqlens.numel() - 1
    mask = mask.to(values.dtype)
    sums = torch.zeros(n, dtype=values.dtype, device=values.device).index_add(0, segments, values * mask)
    counts = torch.zeros(n, dtype=values.dtype, device=values.device).index_add(0, segments, mask)
    return sums / counts.clamp(min=1)


@dataclass(frozen=True, slots=True)
class PaddedRows:
    """A packed row laid out one sample per row, right-padded, for models that take ``[B, L]`` batches.

    Under plain causal attention a right-padded row is exact: no real token sees the padding after
    it. So no ``[T, T]`` block mask is needed and attention runs its fused causal kernel.
    """

    input_ids: torch.Tensor  # [B, L]; padding 0
    position_ids: torch.Tensor  # [B, L]; counting on through the padding (a restart would read as a new sample)
    token_index: torch.Tensor | None  # [T]: where each packed token sits in the flattened [B * L]; None: no padding

    def inputs_on(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """``(input_ids, position_ids)`` on ``device``, copied without blocking (``to_device``)."""
        return to_device(self.input_ids, device), to_device(self.position_ids, device)

    def spread(self, packed: torch.Tensor | None, fill: int) -> torch.Tensor | None:
        """A packed ``[T, ...]`` laid out as the flattened ``[B * L, ...]`` rows, ``fill`` in the padding."""
        if packed is None or self.token_index is None:
            return packed
        spread = packed.new_full((self.input_ids.numel(), *packed.shape[1:]), fill)
        spread[self.token_index] = packed
        return spread

    def packed(self, output: torch.Tensor) -> torch.Tensor:
        """The packed row's ``[T, ...]`` from the model's ``[B, L, ...]`` output."""
        flat = output.flatten(0, 1)
        return flat if self.token_index is None else flat.index_select(0, to_device(self.token_index, flat.device))


def padded_rows(batch: PackedMicroBatch, *, length_multiple: int = 1) -> PaddedRows:
    """``batch``'s samples as right-padded rows of a length divisible by ``length_multiple`` (sequence
    parallel splits a row evenly); ``PaddedRows.packed`` maps ``[B, L, ...]`` back to packed."""
    lengths = batch.cu_seqlens.diff().tolist()
    longest = max(lengths)
    longest += -longest % length_multiple
    positions = torch.arange(longest).expand(len(lengths), longest)
    if all(length == longest for length in lengths):
        return PaddedRows(batch.input_ids.view(len(lengths), longest), positions, None)
    ids = torch.zeros(len(lengths), longest, dtype=batch.input_ids.dtype)
    keep = positions < torch.tensor(lengths)[:, None]
    ids[keep] = batch.input_ids  # row-major order of ``keep`` is the packed order
    return PaddedRows(ids, positions, keep.flatten().nonzero()[:, 0])
