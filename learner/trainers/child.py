"""Training in a child process: a crash, OOM kill, hang or NaN there fails the run and nothing else.

The parent runs ``python -m learner.trainers.child REQUEST`` (``learner.child_process``); the child
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
import dataclasses
import json
import os
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, get_args

import torch

from learner.algorithms import PolicyLossConfig
from learner.child_process import run_child, write_outcome
from learner.megatron.config import check_model
from learner.sample import Sample
from learner.trainers.checkpoint import ExportResult, checkpoint_dtype, export_checkpoint
from learner.trainers.torch_backend import TrainConfig, TrainingDiverged, response_log_probs, train_step

if TYPE_CHECKING:
    # Imported where used: learner.evaluation's package pulls in the database layer, which the
    # trainer (and the GPU benchmarks importing it) must not need.
    from learner.evaluation.config import EvalMethod

__all__ = ["DebugFault", "FailureKind", "TrainingOutcome", "TrainingRequest", "run_training_child"]

DebugFault = Literal["exit", "hang"]
FailureKind = Literal["diverged", "error", "crashed", "timeout"]
DEBUG_EXIT_CODE = 3


@dataclass(frozen=True, slots=True)
class TrainingRequest:
    """One training run: base checkpoint in, new checkpoint folder out.

    ``debug_fault`` makes the child fail on purpose once the model is loaded, to test failure
    handling end to end: ``"exit"`` ends it with ``os._exit(3)`` (a hard crash, like an OOM kill, with
    no Python cleanup and no outcome), ``"hang"`` sleeps until the timeout. In a multi-process run
    only the last rank does, leaving the others waiting in a collective.
    """

    base_model_dir: Path
    out_dir: Path  # the checkpoint folder to create; must not exist
    samples: tuple[Sample, ...]
    config: TrainConfig = field(default_factory=TrainConfig)
    num_steps: int = 1  # optimizer steps over the same samples (slime's --num-steps-per-rollout)
    learning_rate: float = 1e-6
    weight_decay: float = 0.0
    seed: int = 0
    device: str = "cpu"
    num_threads: int | None = None  # torch CPU threads in the child; None: torch's default
    timeout_s: float = 3600.0
    debug_fault: DebugFault | None = None
    # One per sample, computed by the caller (e.g. reward minus a feedback baseline); None: from the rewards.
    advantages: tuple[float, ...] | None = None
    # The KL loss's reference policy (slime: the initial model); None: the base checkpoint itself.
    reference_model_dir: Path | None = None
    # Periodic evaluation of the in-training weights (0: none).
    eval_every: int = 0
    eval_set: tuple[Sample, ...] = ()
    eval_method: EvalMethod = field(default_factory=lambda: _eval_method({}))

    def __post_init__(self) -> None:
        errors = []
        if not self.samples:
            errors.append("no samples to train on")
        if self.advantages is not None and len(self.advantages) != len(self.samples):
            errors.append(f"{len(self.advantages)} advantages for {len(self.samples)} samples")
        if self.num_steps < 1:
            errors.append(f"num_steps must be >= 1, got {self.num_steps}")
        if not self.learning_rate > 0 or self.weight_decay < 0:
            errors.append("learning_rate must be > 0 and weight_decay >= 0")
        if self.num_threads is not None and self.num_threads < 1:
            errors.append(f"num_threads must be >= 1, got {self.num_threads}")
        if not self.timeout_s > 0:
            errors.append(f"timeout_s must be > 0, got {self.timeout_s}")
        if self.eval_every < 0 or (self.eval_every > 0 and not self.eval_set):
            errors.append("eval_every must be >= 0, and > 0 only with an eval_set")
        if self.debug_fault is not None and self.debug_fault not in get_args(DebugFault):
            errors.append(f"debug_fault must be one of {get_args(DebugFault)}, got {self.debug_fault!r}")
        if errors:
            raise ValueError("invalid training request: " + "; ".join(errors))

    def to_json(self) -> str:
        data: dict[str, Any] = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        data.update(
            base_model_dir=str(self.base_model_dir),
            out_dir=str(self.out_dir),
            reference_model_dir=None if self.reference_model_dir is None else str(self.reference_model_dir),
            samples=[s.to_dict() for s in self.samples],
            config=dataclasses.asdict(self.config),
            eval_set=[s.to_dict() for s in self.eval_set],
            eval_method=dataclasses.asdict(self.eval_method),
        )
        return json.dumps(data)

    @classmethod
    def from_json(cls, text: str) -> TrainingRequest:
        data = json.loads(text)
        config = dict(data["config"])
        config["loss"] = PolicyLossConfig(**config["loss"])
        data.update(
            base_model_dir=Path(data["base_model_dir"]),
            out_dir=Path(data["out_dir"]),
            reference_model_dir=None if data.get("reference_model_dir") is None else Path(data["reference_model_dir"]),
            samples=tuple(Sample.from_dict(s) for s in data["samples"]),
            config=TrainConfig(**config),
            advantages=None if data.get("advantages") is None else tuple(data["advantages"]),
            eval_set=tuple(Sample.from_dict(s) for s in data.get("eval_set", ())),
            eval_method=_eval_method(data.get("eval_method", {})),
        )
        return cls(**data)


def _eval_method(fields: dict[str, Any]) -> EvalMethod:
    from learner.evaluation.config import EvalMethod

    return EvalMethod(**fields)


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
        "learner.trainers.child", request.to_json(), timeout_s=request.timeout_s, what="training", processes=processes
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
    from transformers import AutoModelForCausalLM  # the parent never needs it

    torch.manual_seed(request.seed)
    if request.num_threads is not None:
        torch.set_num_threads(request.num_threads)
    if request.config.backend == "megatron":
        from learner.megatron.train import train_megatron  # megatron-core is imported only for this backend

        return train_megatron(request, metrics)

    def load(path: Path) -> torch.nn.Module:
        # Trained in float32 whatever the checkpoint holds: bf16 updates of size lr * grad round to 0.
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        return model.to(request.device)

    model = load(request.base_model_dir)
    if request.debug_fault == "exit":
        os._exit(DEBUG_EXIT_CODE)
    if request.debug_fault == "hang":
        time.sleep(request.timeout_s + 3600)
    ref_model = None
    if request.config.loss.kl_loss_coef != 0:
        ref_model = load(request.reference_model_dir or request.base_model_dir).eval().requires_grad_(False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=request.learning_rate, weight_decay=request.weight_decay)
    samples = list(request.samples)
    advantages = None if request.advantages is None else torch.tensor(request.advantages, dtype=torch.float32)
    old_log_probs = None
    if request.num_steps > 1 and not request.config.use_rollout_logprobs:
        # PPO's ratio is against the policy before this rollout's first step, for every step.
        old_log_probs = response_log_probs(model, samples, request.config.max_tokens_per_micro_batch)
    evaluate = _periodic_eval(request)
    if evaluate is not None:
        evaluations.append(evaluate(model, 0))
    for step in range(1, request.num_steps + 1):
        metrics.append(
            train_step(
                model,
                optimizer,
                samples,
                request.config,
                ref_model=ref_model,
                old_log_probs=old_log_probs,
                advantages=advantages,
            )
        )
        if evaluate is not None and step % request.eval_every == 0:
            evaluations.append(evaluate(model, step))
    return export_checkpoint(
        model, request.base_model_dir, request.out_dir, dtype=checkpoint_dtype(request.base_model_dir)
    )


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        sys.stderr.write("usage: python -m learner.trainers.child REQUEST.json\n")
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
