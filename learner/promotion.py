"""A trained checkpoint's way to serving: a version row, the evaluation gate, the rollout.

The round trains; this decides what becomes of the result. Each step leaves the version row saying
why: a candidate held back by the gate, rejected when the server refused it, or serving.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sqlalchemy.orm import Session, sessionmaker

from learner.evaluation import EvalConfig, EvalFailed
from learner.evaluation.stage import evaluate_candidate
from learner.round_config import RoundError, StageFailed
from learner.sample import Sample
from learner.server_api import ServerApi
from learner.trainers import weights_sha256
from storage import record_model_version, set_version_status
from storage.model_versions import VersionStatus


@dataclass(frozen=True, slots=True)
class Promotion:
    """Promotes checkpoints trained from ``serving_dir`` (the version ``parent_id``) for ``model``."""

    sessions: sessionmaker[Session]
    server: ServerApi
    model: str
    parent_id: str | None
    serving_dir: Path

    def record(self, checkpoint: Path, *, sha256: str, watermark: int | None, metrics: dict[str, Any]) -> str:
        """The candidate version's id; ``sha256`` is what the trainer hashed, proving the folder is whole."""
        if weights_sha256(checkpoint) != sha256:
            raise StageFailed(f"checkpoint {checkpoint} changed after export (sha256 mismatch)")
        version_id = checkpoint.name
        with self.sessions.begin() as session:
            record_model_version(
                session,
                version_id=version_id,
                model=self.model,
                checkpoint_path=str(checkpoint),
                sha256=sha256,
                parent_id=self.parent_id,
                watermark=watermark,
                metrics=metrics,
            )
        return version_id

    def evaluate(
        self,
        checkpoint: Path,
        version_id: str,
        *,
        config: EvalConfig,
        eval_set: list[Sample],
        root: Path,
        num_threads: int | None,
    ) -> tuple[bool, dict[str, Any]]:
        """Whether the candidate may serve, and the evaluation's metrics; the row records the why."""
        try:
            evaluation = evaluate_candidate(
                config,
                eval_set,
                candidate=checkpoint,
                serving=self.serving_dir,
                serving_version=self.parent_id,
                root=root,
                num_threads=num_threads,
            )
        except EvalFailed as exc:
            self._candidate(version_id, f"evaluation failed: {str(exc).splitlines()[0]}")
            raise StageFailed(f"evaluating {version_id} failed: {exc}") from exc
        self._candidate(version_id, evaluation.reason, evaluation=evaluation.record)
        return evaluation.passed, evaluation.metrics | {"eval/reason": evaluation.reason}

    def roll_out(self, checkpoint: Path, version_id: str, canary_share: float = 0.0) -> None:
        """Serving it everywhere, through the server, or with ``canary_share`` first to that share of
        sessions (a base canary, decided by live ratings). A refused rollout rejects the version; a
        refused canary (no engine pool to split, say) leaves it a candidate an admin may promote."""
        try:
            if canary_share > 0:
                self.server.start_base_canary(version_id, canary_share, reason="learning round")
            else:
                self.server.roll_out(str(checkpoint), version_id)
        except RoundError as exc:
            status: VersionStatus = "candidate" if canary_share > 0 else "rejected"
            with self.sessions.begin() as session:
                set_version_status(session, version_id=version_id, status=status, reason=str(exc))
            what = "start a canary of" if canary_share > 0 else "roll out"
            raise StageFailed(f"the server did not {what} {version_id}: {exc}") from exc

    def _candidate(self, version_id: str, reason: str, **values: Any) -> None:
        with self.sessions.begin() as session:
            set_version_status(session, version_id=version_id, status="candidate", reason=reason, **values)
