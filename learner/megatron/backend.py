"""The Megatron trainer: a HF checkpoint trained as a megatron-core ``GPTModel``, exported back to HF.

``MegatronPolicy`` is one model role on this rank: built for the layout in ``MegatronConfig``
(``model``), loaded from the HF folder (``weights``), and, when trainable, wrapped in megatron's
``DistributedDataParallel`` with its optimizer (Adam; distributed, CPU-offloaded and bf16 variants
as configured). Micro-batches are the trainer's packed rows (``learner.batching``), fed as
right-padded ``[B, L]`` rows (the torch backend's layout: one fused causal attention call per layer)
through megatron's forward/backward schedule, so pipeline parallelism works the same as one stage.
The loss of each micro-batch is ``learner.trainers.step_loss`` on the vocabulary-gathered logits:
the torch backend's own code, with the same reductions.

Loss scaling across micro-batches and replicas: the shared loss is already normalised by the whole
step's sample and token counts, so gradients must be summed, not averaged. Megatron's schedule
divides each micro-batch loss by their number and its DDP averages over data-parallel replicas;
``_loss_scale`` undoes both (as slime does).

Context parallel (``context_parallel`` > 1, ``learner.megatron.context_parallel``): each sample of a
micro-batch is padded to a multiple of ``2 * cp`` and every CP rank runs two chunks of it (``r`` and
``2 * cp - 1 - r``); attention all-gathers keys and values (``SDPAttention``). Each rank scores the
positions it holds (log-prob of the next token and entropy, ``[held]``, not ``[held, V]``), the scores
are all-gathered with gradient into the whole row, padding dropped, and every CP rank computes the
same shared loss on it. The gather's backward sums the CP ranks' gradients, so each rank's part gets
``cp`` times the loss gradient; ``_loss_scale`` divides it out (see there).

Several processes: every rank must take the same decisions at the same collectives, or one waits
forever for another. So a step is refused on what every rank sees alike: the loss (computed on the
last pipeline stage only, flagged across the world after the schedule, never raised inside it), the
all-reduced gradient norm, and a non-finite weight anywhere.
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypedDict, Unpack

import torch
import torch.distributed as dist
from megatron.core import parallel_state, tensor_parallel
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.pipeline_parallel import get_forward_backward_func
from torch import Tensor
from transformers import AutoConfig

from learner.batching import PackedMicroBatch, collate_micro_batch, pack_samples, padded_rows
from learner.megatron.context_parallel import RowSplit, split_row
from learner.megatron.cpu_compat import cuda_as_cpu, on_cpu
from learner.megatron.model import build_model
from learner.megatron.torch_kernels import (
    fuse_weight_gradient_accumulation,
    install_multi_tensor_kernels,
    use_fused_adamw,
)
from learner.megatron.weights import gather_hf_weights, load_hf_weights
from learner.megatron_config import MegatronConfig, check_model
from learner.sample import Sample
from learner.to_device import to_device
from learner.trainers.step_loss import (
    StepInputs,
    StepTotals,
    all_finite,
    entropy_in_loss,
    micro_batch_loss,
    prepare_step,
    shifted,
    step_metrics,
    target_scores,
    token_log_probs,
)
from learner.trainers.train_config import TrainConfig, TrainingDiverged

__all__ = ["MegatronPolicy", "OptimizerSettings"]


@dataclass(frozen=True, slots=True)
class OptimizerSettings:
    """Adam's knobs (betas and epsilon are torch's defaults, as in the torch backend)."""

    learning_rate: float
    weight_decay: float = 0.0
    clip_grad: float | None = 1.0


@dataclass(frozen=True, slots=True)
class _Item:
    """One micro-batch this rank runs; ``weight`` 0 for a filler that keeps replicas in step."""

    batch: PackedMicroBatch
    weight: float = 1.0
    ref_log_probs: Tensor | None = None


class _StepArgs(TypedDict, total=False):
    """``train_step``'s optional inputs, passed on to ``accumulate_gradients``."""

    ref: MegatronPolicy | None
    old_log_probs: Sequence[Tensor | None] | None
    advantages: Tensor | None


def _device() -> torch.device:
    return torch.device("cpu") if on_cpu() else torch.device("cuda", torch.cuda.current_device())


def _share(items: list[PackedMicroBatch]) -> list[_Item]:
    """This data-parallel replica's micro-batches, round robin; replicas short of one get a zero-weight
    copy, since every replica must run the same schedule."""
    size, rank = parallel_state.get_data_parallel_world_size(), parallel_state.get_data_parallel_rank()
    rounds = math.ceil(len(items) / size)
    share = []
    for slot in range(rounds):
        index = slot * size + rank
        share.append(_Item(items[index]) if index < len(items) else _Item(items[0], weight=0.0))
    return share


class MegatronPolicy:
    """One model (the trained actor, or a frozen reference) on this rank's part of the layout.

    Needs ``runtime.parallel(config)`` active for its whole life.
    """

    def __init__(self, model_dir: Path, config: MegatronConfig, *, optimizer: OptimizerSettings | None = None) -> None:
        self.config = config
        self.hf = AutoConfig.from_pretrained(model_dir)
        check_model(config, self.hf)
        with cuda_as_cpu():  # tied embeddings over pipeline stages are synced with a hard-coded .cuda()
            model = build_model(
                self.hf,
                config,
                pre_process=parallel_state.is_pipeline_first_stage(),
                post_process=parallel_state.is_pipeline_last_stage(),
            )
        load_hf_weights(model, model_dir, self.hf, config)
        self.model = model.to(_device())
        self.optimizer: Any = None  # megatron's (chained) optimizer
        self.module: Any = self.model  # the DDP wrapper once trainable
        if optimizer is None:
            self.model.eval().requires_grad_(False)
            return
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True,
            overlap_grad_reduce=False,  # overlapping needs CUDA streams
            use_distributed_optimizer=config.distributed_optimizer,
        )
        optimizer_config = OptimizerConfig(
            optimizer="adam",
            lr=optimizer.learning_rate,
            min_lr=optimizer.learning_rate,
            weight_decay=optimizer.weight_decay,
            clip_grad=optimizer.clip_grad or 0.0,  # 0: megatron reports the norm without clipping
            bf16=config.bf16,
            params_dtype=torch.bfloat16 if config.bf16 else torch.float32,
            use_distributed_optimizer=config.distributed_optimizer,
            optimizer_cpu_offload=config.optimizer_cpu_offload,
            optimizer_offload_fraction=config.optimizer_offload_fraction if config.optimizer_cpu_offload else 0.0,
            overlap_cpu_optimizer_d2h_h2d=config.optimizer_cpu_offload,  # copies on their own CUDA streams
        )
        if config.optimizer_cpu_offload:
            # The hybrid optimizer then holds the float32 master weights itself (on the host for the
            # offloaded share); otherwise the distributed optimizer keeps a float32 copy on the GPU too.
            # Set after construction: OptimizerConfig's check of this mode asks TransformerEngine's
            # version, and fails without it; these are the values it sets for an offloaded optimizer.
            optimizer_config.use_precision_aware_optimizer = True
            optimizer_config.use_precision_aware_optimizer_no_fp8_or_ds_fp8 = True
            optimizer_config.store_param_remainders = False
        install_multi_tensor_kernels()
        with cuda_as_cpu():
            ddp = DistributedDataParallel(config=model.config, ddp_config=ddp_config, module=self.model)
            self.optimizer = get_megatron_optimizer(optimizer_config, [ddp])
        use_fused_adamw(self.optimizer)
        if not on_cpu():
            fuse_weight_gradient_accumulation(self.model)
        self.module = ddp
        model.config.finalize_model_grads_func = finalize_model_grads
        model.config.no_sync_func = ddp.no_sync
        model.config.grad_scale_func = self.optimizer.scale_loss

    # forward

    def _forward(self, batch: PackedMicroBatch) -> Tensor:
        """The packed row's ``[T, V / tp]`` logits (on the last pipeline stage; else hidden states).

        The samples go in as right-padded ``[B, L]`` rows under the causal mask, as in the torch
        backend: one fused causal attention call per layer (a packed row attends a sample at a time).
        Context parallel needs the packed row: it splits each sample across ranks.
        """
        if batch.routed_experts is not None:
            raise ValueError(
                "the samples carry rollout_routed_experts: routing replay runs on the torch backend; "
                "the megatron backend does not replay them yet"
            )
        if self.config.context_parallel > 1:
            return self._forward_packed(batch)
        rows = padded_rows(batch, length_multiple=self._row_multiple())
        output = self.module(*rows.inputs_on(_device()), None)
        return rows.packed(output) if parallel_state.is_pipeline_last_stage() else output

    def _forward_packed(self, batch: PackedMicroBatch) -> Tensor:
        """``_forward`` for context parallel: this rank's chunks of the packed row as ``thd`` segments
        (attention and RoPE read the global bounds)."""
        split = self._row_split(batch)
        cu_seqlens = split.cu_seqlens.to(torch.int32)
        longest = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
        packed = PackedSeqParams(
            qkv_format="thd",
            cu_seqlens_q=cu_seqlens,  # kept on the host: attention reads the bounds without a sync
            cu_seqlens_kv=cu_seqlens,
            max_seqlen_q=longest,
            max_seqlen_kv=longest,
        )
        ids = split.local(batch.input_ids)
        device = _device()
        output = self.module(
            to_device(ids[None], device), to_device(split.positions[None], device), None, packed_seq_params=packed
        )
        return output[0] if parallel_state.is_pipeline_last_stage() else output

    def _row_multiple(self) -> int:
        """Sequence parallel splits a row's tokens evenly over the tensor-parallel ranks."""
        return self.config.tensor_parallel if self.config.sequence_parallel else 1

    def _row_split(self, batch: PackedMicroBatch) -> RowSplit:
        """This context-parallel rank's part of ``batch``'s row (cached: forward and loss both ask)."""
        return split_row(
            tuple(batch.cu_seqlens.diff().tolist()),
            size=self.config.context_parallel,
            rank=parallel_state.get_context_parallel_rank(),
            row_multiple=self._row_multiple(),
        )

    def _row_scores(
        self, output: Tensor, batch: PackedMicroBatch, *, with_entropy: bool = True, entropy_grad: bool = False
    ) -> tuple[Tensor, Tensor]:
        """Under context parallel, the whole row's ``[T]`` log-probs and entropy, as
        ``token_log_probs_and_entropy`` gives them from the whole row's logits: this rank scores the
        positions it holds against their next tokens, and the ``[held, 2]`` scores are gathered."""
        split = self._row_split(batch)
        logits = self._full_vocab(output)
        targets = to_device(split.targets(batch.input_ids), logits.device)
        temperature = None if batch.temperature is None else split.local(batch.temperature, fill=1)
        scores = target_scores(
            logits, targets, temperature=temperature, with_entropy=with_entropy, entropy_grad=entropy_grad
        )
        row = split.gather_row(torch.stack(scores, dim=1), parallel_state.get_context_parallel_group())
        log_probs, entropy = row.unbind(1)
        return shifted(log_probs, batch.cu_seqlens), shifted(entropy, batch.cu_seqlens)

    def _full_vocab(self, logits: Tensor) -> Tensor:
        if self.config.tensor_parallel == 1:
            return logits
        return tensor_parallel.gather_from_tensor_model_parallel_region(logits)

    def _schedule(
        self,
        items: list[_Item],
        loss: Callable[[_Item, Tensor], tuple[Tensor, dict[str, Any]]],
        *,
        forward_only: bool,
    ) -> list[dict[str, Any]]:
        """Run megatron's forward(/backward) schedule over ``items``; each item's ``loss`` output, in order
        (on the last pipeline stage; empty elsewhere)."""
        queue: Iterator[_Item] = iter(items)

        def forward_step(data: Iterator[_Item], model: torch.nn.Module) -> tuple[Tensor, Callable[..., Any]]:
            item = next(data)
            return self._forward(item.batch), functools.partial(loss, item)

        # Shapes are exchanged between pipeline stages (variable_seq_lengths): these are upper bounds.
        longest, rows = max(len(i.batch.input_ids) for i in items), max(len(i.batch.sample_indices) for i in items)
        with cuda_as_cpu():
            return list(
                get_forward_backward_func()(
                    forward_step_func=forward_step,
                    data_iterator=queue,
                    model=[self.module],
                    num_microbatches=len(items),
                    seq_length=longest,
                    micro_batch_size=rows,
                    forward_only=forward_only,
                )
            )

    @torch.no_grad()
    def micro_batch_log_probs(self, batches: Sequence[PackedMicroBatch]) -> list[Tensor]:
        """``[T]`` token log-probs of each packed row (``torch_backend.compute_log_probs``'s values);
        on the last pipeline stage, empty elsewhere."""
        if not batches:  # a data-parallel replica with no sample of its own to score
            return []
        self.module.eval()

        def loss(item: _Item, output: Tensor) -> tuple[Tensor, dict[str, Any]]:
            if self.config.context_parallel > 1:
                log_probs = self._row_scores(output, item.batch, with_entropy=False)[0]
            else:
                log_probs = token_log_probs(self._full_vocab(output), item.batch)
            return output.new_zeros(()), {"log_probs": log_probs}

        outputs = self._schedule([_Item(b) for b in batches], loss, forward_only=True)
        return [o["log_probs"] for o in outputs]

    def micro_batches(self, samples: Sequence[Sample], config: TrainConfig) -> list[_Item]:
        """This replica's packed micro-batches: at most ``max_tokens_per_device`` tokens per device
        (the train config's cap when the layout sets none)."""
        cap = (self.config.max_tokens_per_device or config.max_tokens_per_micro_batch) * self.config.context_parallel
        return _share([collate_micro_batch(samples, m) for m in pack_samples(samples, cap)])

    def response_log_probs(self, samples: Sequence[Sample], config: TrainConfig) -> list[Tensor | None]:
        """Each sample's ``[response_length]`` log-probs, for the samples this rank's replica runs
        (the same packing and split as ``train_step``); None for the others."""
        items = self.micro_batches(samples, config)
        real = [item.batch for item in items if item.weight]
        result: list[Tensor | None] = [None] * len(samples)
        for batch, log_probs in zip(real, self.micro_batch_log_probs(real), strict=False):
            for index, start, end in zip(
                batch.sample_indices, batch.cu_seqlens[:-1], batch.cu_seqlens[1:], strict=True
            ):
                result[index] = log_probs[int(start) + samples[index].prompt_length : int(end)].cpu()
        return result

    # training

    def _loss_scale(self, num_microbatches: int) -> float:
        """The factor on each micro-batch's loss that makes the gradients the sum over the step's.

        Megatron's schedule multiplies a loss by ``cp / num_microbatches``; DDP sums the gradients over
        the ``dp * cp`` ranks of the data-parallel-with-CP group and divides by ``dp * cp``. Each CP rank
        computes the whole row's loss, and the score gather's backward sums the ``cp`` ranks' (equal)
        gradients, so each rank's part of the row gets ``cp`` times its true gradient. Together:
        ``scale * (cp / n) * cp / (dp * cp)`` must be 1.
        """
        cp = self.config.context_parallel
        return num_microbatches * parallel_state.get_data_parallel_world_size() / cp

    def _refuse(self, message: str) -> None:
        self.module.zero_grad_buffer()
        self.optimizer.zero_grad()
        raise TrainingDiverged(f"{message}: step refused, weights left as they were")

    def accumulate_gradients(
        self,
        samples: Sequence[Sample],
        config: TrainConfig,
        *,
        ref: MegatronPolicy | None = None,
        old_log_probs: Sequence[Tensor | None] | None = None,
        advantages: Tensor | None = None,
    ) -> dict[str, float]:
        """Forward and backward over ``samples``: gradients land in the DDP buffers (``main_grad``).

        Returns the summed loss parts, on every rank. Arguments as ``torch_backend.train_step``'s,
        with ``ref`` the frozen reference for the KL loss.

        Raises:
            TrainingDiverged: a micro-batch's loss is not finite, on any rank (gradients cleared).
        """
        inputs: StepInputs = prepare_step(
            samples,
            config,
            has_ref_model=ref is not None,
            old_log_probs=old_log_probs,  # type: ignore[arg-type]
            advantages=advantages,
        )
        refusal = self.config.custom_loss_refusal()
        if inputs.custom is not None and refusal:
            raise ValueError(refusal)
        items = self.micro_batches(samples, config)
        if ref is not None and config.loss.kl_loss_coef != 0:
            refs = ref.micro_batch_log_probs([item.batch for item in items])
            if refs:
                items = [_Item(i.batch, i.weight, r) for i, r in zip(items, refs, strict=True)]
        scale = self._loss_scale(len(items))
        self.module.train()
        self.module.zero_grad_buffer()
        self.optimizer.zero_grad()
        totals = StepTotals()  # read once the schedule is done: a read per micro-batch stalls the device

        def loss(item: _Item, output: Tensor) -> tuple[Tensor, dict[str, Any]]:
            if self.config.context_parallel > 1:  # no custom loss here (TrainConfig refuses it)
                scores = self._row_scores(output, item.batch, entropy_grad=entropy_in_loss(config))
                value, parts = micro_batch_loss(
                    config, inputs, samples, item.batch, None, ref_log_probs=item.ref_log_probs, token_scores=scores
                )
            else:
                value, parts = micro_batch_loss(
                    config, inputs, samples, item.batch, self._full_vocab(output), ref_log_probs=item.ref_log_probs
                )
            totals.add(value, parts, item.weight)
            return value * (scale * item.weight), {}

        self._schedule(items, loss, forward_only=False)
        loss_sum, parts = totals.read()  # a non-finite micro-batch loss makes the sum non-finite
        non_finite = _world_sum(0.0 if math.isfinite(loss_sum) else loss_sum)  # 0 everywhere, or nan/inf on every rank
        if non_finite != 0.0:
            self._refuse(f"loss is {non_finite}")
        if parallel_state.get_data_parallel_world_size() > 1:
            parts = _sum_over_replicas(parts)
        return _from_last_stage(parts)

    def apply_gradients(self) -> float:
        """Clip and step; the gradient norm before clipping.

        Raises:
            TrainingDiverged: a non-finite gradient norm (nothing changes) or weight after the step.
        """
        with cuda_as_cpu():
            # megatron's own ``step`` would prepare the gradients and take their norm a second time
            found_inf = self.optimizer.prepare_grads()
            grad_norm = float(self.optimizer.get_grad_norm())
            if found_inf or not math.isfinite(grad_norm):
                self._refuse(f"grad_norm is {grad_norm}")
            self._clip(grad_norm)
            self.optimizer.step_with_ready_grads()
        self.optimizer.zero_grad()
        with torch.no_grad():
            broken = not all_finite(self.model.parameters())
        if _world_sum(float(broken)):
            raise TrainingDiverged("a weight became non-finite in the optimizer step")
        return grad_norm

    def _clip(self, grad_norm: float) -> None:
        """Scale the main gradients to the configured clip norm, as megatron's ``step`` does."""
        for inner in getattr(self.optimizer, "chained_optimizers", [self.optimizer]):
            parameters = [] if getattr(inner, "is_stub_optimizer", False) else inner.get_parameters()
            if inner.config.clip_grad > 0.0 and parameters:
                clip_grad_by_total_norm_fp32(
                    parameters,
                    max_norm=inner.config.clip_grad,
                    total_norm=grad_norm,
                    use_decoupled_grad=inner.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8,
                )

    def train_step(self, samples: Sequence[Sample], config: TrainConfig, **step: Unpack[_StepArgs]) -> dict[str, float]:
        """One optimizer step over ``samples``: ``torch_backend.train_step``'s contract and metrics;
        ``step`` as ``accumulate_gradients``'s keywords."""
        started = time.perf_counter()
        totals = self.accumulate_gradients(samples, config, **step)
        grad_norm = self.apply_gradients()
        return step_metrics(samples, totals, grad_norm, time.perf_counter() - started)

    def hf_state(self) -> dict[str, Tensor] | None:
        """The whole model under HF names on global rank 0; None elsewhere."""
        return gather_hf_weights(self.model, self.hf, self.config)


def _world_sum(value: float) -> float:
    """``value`` summed over every rank (itself in a world of one)."""
    if dist.get_world_size() == 1:
        return value
    total = torch.tensor([value], dtype=torch.float64, device=_device())
    dist.all_reduce(total)
    return float(total)


def _sum_over_replicas(totals: dict[str, float]) -> dict[str, float]:
    names = sorted(totals)
    values = torch.tensor([totals[n] for n in names], dtype=torch.float64, device=_device())  # NCCL: on the GPU
    dist.all_reduce(values, group=parallel_state.get_data_parallel_group())
    return dict(zip(names, values.tolist(), strict=True))


def _from_last_stage(totals: dict[str, float]) -> dict[str, float]:
    """The loss parts, which only the last pipeline stage computed, on every stage."""
    if parallel_state.get_pipeline_model_parallel_world_size() == 1:
        return totals
    box = [totals]
    dist.broadcast_object_list(
        box,
        src=parallel_state.get_pipeline_model_parallel_last_rank(),
        group=parallel_state.get_pipeline_model_parallel_group(),
    )
    return box[0]
