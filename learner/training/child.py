"""Training in a child process: a crash, OOM kill, hang or NaN there fails the run and nothing else.

The parent runs ``python -m learner.training.child REQUEST`` (``learner.child_process``); the child
loads the base checkpoint, trains, exports and writes its ``TrainingOutcome``. Serving state is never
touched from here: the checkpoint is a new folder the caller may roll out.

With ``eval_every`` > 0 the child also scores the in-training weights on ``eval_set`` before the
first step and after every ``eval_every``-th (``learner.evaluation.scoring``): ``evaluations``.

A megatron layout over several devices (``MegatronConfig.devices`` > 1) runs one child per device,
the ranks of one torch.distributed world (``learner.child_process``): rank 0 writes the outcome and
the checkpoint; another rank only exits 0 (done, or the same step refused as on rank 0) or fails,
which fails the run. The layout is checked against the model's config before any process starts.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch

if TYPE_CHECKING:
    from transformers import PreTrainedModel

from learner.child_process import run_child, write_outcome
from learner.megatron_config import check_model
from learner.trainers.checkpoint import ExportResult, checkpoint_dtype, export_adapter, export_checkpoint
from learner.trainers.critic import ValueHead
from learner.trainers.drift import DriftWatch, PolicyDrifted
from learner.trainers.host_optimizer import HostAdamW
from learner.trainers.int4_qat import apply_int4_qat, remove_int4_qat, write_int4_copy
from learner.trainers.torch_backend import TrainingDiverged, response_log_probs, response_scores, train_step
from learner.training_request import AdapterSpec, TrainingRequest

__all__ = ["FailureKind", "TrainingOutcome", "load_for_training", "reference_model", "run_training_child"]

FailureKind = Literal["diverged", "drifted", "error", "crashed", "timeout"]


@dataclass(frozen=True, slots=True)
class TrainingOutcome:
    """What a run gave: a checkpoint and per-step metrics, or why it failed (``failure``, ``error``)."""

    status: Literal["succeeded", "failed"]
    checkpoint: ExportResult | None = None
    metrics: tuple[dict[str, float], ...] = ()  # one dict per optimizer step, in order
    error: str | None = None
    failure: FailureKind | None = None
    evaluations: tuple[dict[str, float], ...] = ()  # periodic evaluation: each has the "step" it followed

    def __post_init__(self) -> None:
        if self.status == "succeeded" and (self.checkpoint is None or self.error is not None):
            raise ValueError("a succeeded run has a checkpoint and no error")
        if self.status == "failed" and (self.checkpoint is not None or self.error is None or self.failure is None):
            raise ValueError("a failed run has an error and a failure kind, and no checkpoint")
        if self.status not in ("succeeded", "failed"):
            raise ValueError(f"unknown status {self.status!r}")

    def to_dict(self) -> dict[str, Any]:
        checkpoint = (
            None if self.checkpoint is None else {"path": str(self.checkpoint.path), "sha256": self.checkpoint.sha256}
        )
        return {
            "status": self.status,
            "checkpoint": checkpoint,
            "metrics": list(self.metrics),
            "error": self.error,
            "failure": self.failure,
            "evaluations": list(self.evaluations),
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TrainingOutcome:
        checkpoint = data["checkpoint"]
        return cls(
            status=data["status"],
            checkpoint=None if checkpoint is None else ExportResult(Path(checkpoint["path"]), checkpoint["sha256"]),
            metrics=tuple(data["metrics"]),
            error=data["error"],
            failure=data["failure"],
            evaluations=tuple(data.get("evaluations", ())),
        )


# parent side


def run_training_child(request: TrainingRequest) -> TrainingOutcome:
    """Run ``request`` in fresh Python processes (one per device) and report how it went; never raises
    for a failed run."""
    processes = 1
    if request.config.backend == "megatron":
        misfit = _layout_misfit(request)
        if misfit is not None:
            return TrainingOutcome("failed", error=misfit, failure="error")
        processes = request.config.megatron.devices
    run = run_child(
        "learner.training.child", request.to_json(), timeout_s=request.timeout_s, what="training", processes=processes
    )
    if run.outcome is None:
        return TrainingOutcome("failed", error=run.error, failure=run.failure)
    return TrainingOutcome.from_dict(run.outcome)


def _layout_misfit(request: TrainingRequest) -> str | None:
    """Why the megatron layout cannot lay out the base model (heads, layers... per ``check_model``);
    None when it fits or the config cannot be read here (the child then reports why)."""
    from transformers import AutoConfig

    try:
        hf_config = AutoConfig.from_pretrained(request.base_model_dir)
    except (OSError, ValueError):
        return None
    try:
        check_model(request.config.megatron, hf_config)
    except ValueError as exc:
        return f"ValueError: {exc}"
    return None


# child side


def _periodic_eval(request: TrainingRequest) -> Callable[[torch.nn.Module, int], dict[str, float]] | None:
    if request.eval_every == 0:
        return None
    from transformers import AutoTokenizer

    from learner.evaluation.scoring import score_model

    tokenizer = AutoTokenizer.from_pretrained(request.base_model_dir)

    def evaluate(model: torch.nn.Module, step: int) -> dict[str, float]:
        started = time.perf_counter()
        scores = score_model(model, tokenizer, request.eval_set, request.eval_method)  # type: ignore[arg-type]
        return {"step": float(step), **scores, "seconds": time.perf_counter() - started}

    return evaluate


def _train(
    request: TrainingRequest, metrics: list[dict[str, float]], evaluations: list[dict[str, float]]
) -> ExportResult | None:
    """Train and export; None on a megatron rank other than 0 (rank 0 exports)."""
    torch.manual_seed(request.seed)
    if request.num_threads is not None:
        torch.set_num_threads(request.num_threads)
    if request.config.backend == "megatron":
        from learner.megatron.train import train_megatron  # megatron-core is imported only for this backend

        return train_megatron(request, metrics)

    model = load_for_training(request.base_model_dir, request.device)
    qat = request.config.qat == "int4"
    if qat:
        if request.adapter is not None:
            raise ValueError("qat int4 trains the model's own weights, not a LoRA adapter")
        apply_int4_qat(model, checkpoint_dtype(request.base_model_dir), request.config.qat_group_size)
    ref_model = reference_model(request)
    # The trained module: the model itself, or the model frozen under a LoRA adapter.
    policy = model if request.adapter is None else _with_adapter(model, request.adapter)
    trainable = [p for p in policy.parameters() if p.requires_grad]
    groups: list[dict[str, Any]] = [{"params": trainable}]
    critic = None
    if request.config.advantage_estimator == "ppo":  # the parent's critic, or a fresh one
        critic = ValueHead.load(request.base_model_dir, model.config.hidden_size, request.device)
        groups.append({"params": list(critic.parameters()), "lr": request.config.critic_lr, "weight_decay": 0.0})
    adamw = HostAdamW if request.config.optimizer_offload else torch.optim.AdamW
    optimizer = adamw(groups, lr=request.learning_rate, weight_decay=request.weight_decay)
    samples = list(request.samples)
    advantages = None if request.advantages is None else torch.tensor(request.advantages, dtype=torch.float32)
    old_log_probs = None
    if request.num_steps > 1 and not request.config.use_rollout_logprobs:
        # PPO's ratio is against the policy before this rollout's first step, for every step.
        old_log_probs = response_log_probs(policy, samples, request.config.max_tokens_per_micro_batch)
    evaluate = _periodic_eval(request)
    if evaluate is not None:
        evaluations.append(evaluate(policy, 0))
    drift = _drift_probe(request, policy, ref_model)
    for step in range(1, request.num_steps + 1):
        metrics.append(
            train_step(
                policy,
                optimizer,
                samples,
                request.config,
                ref_model=ref_model,
                old_log_probs=old_log_probs,
                advantages=advantages,
                critic=critic,
            )
        )
        if drift is not None:
            metrics[-1] |= drift(policy, step, metrics[-1]["grad_norm"])
        if evaluate is not None and step % request.eval_every == 0:
            evaluations.append(evaluate(policy, step))
    if request.adapter is not None:
        return export_adapter(policy, request.out_dir)
    if qat:
        remove_int4_qat(model)
    dtype = checkpoint_dtype(request.base_model_dir)
    exported = export_checkpoint(model, request.base_model_dir, request.out_dir, dtype=dtype)
    if qat:  # the engines' INT4 copy, from the weights as they trained
        write_int4_copy(model, exported.path, dtype, request.config.qat_group_size)
    if critic is not None:
        critic.save(exported.path)  # beside the weights, for the next round (not in their sha256)
    return exported


def _drift_probe(
    request: TrainingRequest, policy: torch.nn.Module, ref_model: torch.nn.Module | None
) -> Callable[[torch.nn.Module, int, float], dict[str, float]] | None:
    """After each step: the policy probed on its batch against the lineage root (``learner.trainers.drift``).

    The root's log-probs and entropy are taken once, here: from the KL loss's reference when loaded,
    from the base under a disabled adapter, from the policy itself when the serving checkpoint is
    the root, else from the root loaded for the probe and freed.
    """
    # The policy's own answers: a supervised sample (a correction) is pulled towards on purpose.
    samples = [s for s in request.samples if not s.supervised]
    if request.drift is None or not request.drift.on or not samples:
        return None
    budget = request.config.max_tokens_per_micro_batch
    root_dir = request.reference_model_dir
    if ref_model is not None:
        root = response_scores(ref_model, samples, budget)
    elif request.adapter is not None:
        with policy.disable_adapter():  # type: ignore[operator]  # a PeftModel's
            root = response_scores(policy, samples, budget)
    elif root_dir is None or root_dir.resolve() == request.base_model_dir.resolve():
        root = response_scores(policy, samples, budget)
    else:
        loaded = load_for_training(root_dir, request.device).eval()
        root = response_scores(loaded, samples, budget)
        del loaded
    root_log_probs = torch.cat([lp for lp, _ in root])
    watch = DriftWatch(request.drift, root_entropy=float(torch.cat([e for _, e in root]).mean()))

    def probe(model: torch.nn.Module, step: int, grad_norm: float) -> dict[str, float]:
        scores = response_scores(model, samples, budget)
        own = torch.cat([lp for lp, _ in scores]).double()
        r = (root_log_probs.double() - own).clamp(max=50.0)  # k3: exp(r) - 1 - r, r = log p_root - log p_policy
        kl = float((r.exp() - 1 - r).mean())
        return watch.step(
            step, kl_to_root=kl, entropy=float(torch.cat([e for _, e in scores]).mean()), grad_norm=grad_norm
        )

    return probe


def load_for_training(path: Path, device: str) -> PreTrainedModel:
    """A checkpoint in float32 on ``device``, whatever it holds: bf16 updates of size lr * grad round to 0."""
    from transformers import AutoModelForCausalLM  # the parent never needs it

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return model.to(torch.device(device))  # type: ignore[arg-type]  # transformers types .to oddly


def reference_model(request: TrainingRequest) -> PreTrainedModel | None:
    """The frozen reference policy of the KL loss or of the KL in the reward, when there is one."""
    if request.config.loss.kl_loss_coef == 0 and request.config.kl_coef == 0:
        return None
    path = request.reference_model_dir or request.base_model_dir
    return load_for_training(path, request.device).eval().requires_grad_(False)


def _with_adapter(model: torch.nn.Module, spec: AdapterSpec) -> torch.nn.Module:
    """``model`` frozen under a trainable LoRA adapter: ``spec.init_dir``'s weights, or a fresh one
    (peft's initialisation: B = 0, so training starts from the base's own answers)."""
    from peft import LoraConfig, PeftModel, get_peft_model

    if spec.init_dir is not None:
        return PeftModel.from_pretrained(model, spec.init_dir, is_trainable=True)
    config = LoraConfig(
        r=spec.rank, lora_alpha=spec.alpha, lora_dropout=spec.dropout, target_modules=list(spec.target_modules)
    )
    return get_peft_model(model, config)


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        sys.stderr.write("usage: python -m learner.training.child REQUEST.json\n")
        return 2
    request_path = Path(argv[1])
    request = TrainingRequest.from_json(request_path.read_text())
    metrics: list[dict[str, float]] = []
    evaluations: list[dict[str, float]] = []
    if int(os.environ.get("RANK", "0")) != 0:
        return _other_rank(request, metrics)
    try:
        checkpoint = _train(request, metrics, evaluations)
        if checkpoint is None:
            raise RuntimeError("rank 0 exported no checkpoint")
        outcome = TrainingOutcome(
            "succeeded", checkpoint=checkpoint, metrics=tuple(metrics), evaluations=tuple(evaluations)
        )
    except PolicyDrifted as exc:
        outcome = TrainingOutcome("failed", metrics=tuple(metrics), error=f"PolicyDrifted: {exc}", failure="drifted")
    except TrainingDiverged as exc:
        outcome = TrainingOutcome(
            "failed", metrics=tuple(metrics), error=f"TrainingDiverged: {exc}", failure="diverged"
        )
    except Exception as exc:
        detail = "".join(traceback.format_exception(exc))
        outcome = TrainingOutcome(
            "failed", metrics=tuple(metrics), error=f"{type(exc).__name__}: {exc}\n{detail}", failure="error"
        )
    write_outcome(request_path, outcome.to_dict())
    return 0


def _other_rank(request: TrainingRequest, metrics: list[dict[str, float]]) -> int:
    """A rank > 0: trains its part and exits 0; any other error propagates (a traceback, exit 1).

    A refused step exits 0 too: every rank refuses it alike (the checks read all-reduced values) and
    rank 0 reports it; failing here could end the run before rank 0 has written that report.
    """
    with contextlib.suppress(TrainingDiverged):
        _train(request, metrics, [])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
