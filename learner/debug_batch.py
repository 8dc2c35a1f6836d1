"""A round's training batch saved to a folder, and replayed with no engine, server or database.

The folder holds the ``TrainingRequest`` the round handed to the training child (samples with their
rewards and behaviour log-probs, advantages, train config, learning rate, steps, seed, threads and
a reference to the base checkpoint) and a manifest with the payload's sha256 and the base weights'
sha256. Replaying runs the same training child on the same request, so on the same base weights and
thread count it writes the same checkpoint, bit for bit (slime's ``--save-debug-train-data`` /
``--load-debug-rollout-data``).

    batch_dir/
        request.json    the request, without ``out_dir`` (chosen at replay)
        manifest.json   format, payload sha256 and size, base checkpoint and its weights' sha256, info

A folder is written under a hidden name and renamed when whole, so a crash never leaves half a batch
that looks complete. A batch holds users' conversations as token ids: keep it as private as the
database.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import uuid
from collections.abc import Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from learner.trainers import weights_sha256
from learner.training import TrainingOutcome, TrainingRequest, run_training_child

__all__ = ["BatchError", "load_batch", "read_manifest", "replay_batch", "save_batch"]

log = logging.getLogger(__name__)

FORMAT = "tandem-debug-batch"
VERSION = 1
MANIFEST = "manifest.json"
PAYLOAD = "request.json"
# Not part of the batch: the replay picks its own output folder, and a fault is a test hook.
_NOT_SAVED = ("out_dir",)
# Manifest fields that repeat the payload for people reading it; they must agree with it.
_SUMMARY = ("base_model_dir", "samples", "num_steps", "learning_rate")


class BatchError(ValueError):
    """A batch folder that is incomplete, tampered with, or of an unknown format; nothing was trained."""


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _write_synced(path: Path, data: bytes) -> None:
    with path.open("wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())


def save_batch(
    request: TrainingRequest,
    batch_dir: Path,
    *,
    base_weights_sha256: str | None = None,
    info: Mapping[str, Any] | None = None,
) -> Path:
    """Save ``request`` as a replayable batch in the new folder ``batch_dir``.

    Args:
        request: what the round is about to train (call before ``run_training_child``, so a batch
            that crashes the trainer is saved too).
        batch_dir: must not exist; its parent is created.
        base_weights_sha256: the base checkpoint's ``weights_sha256`` when the caller knows it (the
            serving version's row); None: hashed here.
        info: plain JSON data for people (round id, model, watermark), stored in the manifest.

    Returns:
        ``batch_dir``.

    Raises:
        FileExistsError: ``batch_dir`` exists.
        CheckpointError: the base checkpoint has no weights to hash.
    """
    batch_dir = Path(batch_dir)
    if batch_dir.exists():
        raise FileExistsError(f"{batch_dir} exists: a batch folder is never overwritten")
    data = {k: v for k, v in json.loads(request.to_json()).items() if k not in _NOT_SAVED}
    payload = json.dumps(data, indent=1).encode()
    manifest = {
        "format": FORMAT,
        "version": VERSION,
        "created_at": datetime.now(UTC).isoformat(),
        "payload": {PAYLOAD: {"sha256": _sha256(payload), "bytes": len(payload)}},
        "base_weights_sha256": base_weights_sha256 or weights_sha256(request.base_model_dir),
        "base_model_dir": data["base_model_dir"],
        "samples": len(request.samples),
        "num_steps": request.num_steps,
        "learning_rate": request.learning_rate,
        "response_tokens": sum(s.response_length for s in request.samples),
        "info": dict(info or {}),
    }
    batch_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = batch_dir.parent / f".{batch_dir.name}.partial-{uuid.uuid4().hex[:8]}"
    staging.mkdir()
    try:
        _write_synced(staging / PAYLOAD, payload)
        _write_synced(staging / MANIFEST, json.dumps(manifest, indent=2).encode())
        os.rename(staging, batch_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return batch_dir


def read_manifest(batch_dir: Path) -> dict[str, Any]:
    """The manifest of ``batch_dir``, checked for format and version only (``load_batch`` checks the rest).

    Raises:
        BatchError: no folder, no manifest, not JSON, or another format or version.
    """
    batch_dir = Path(batch_dir)
    if not batch_dir.is_dir():
        raise BatchError(f"{batch_dir} is not a folder")
    path = batch_dir / MANIFEST
    if not path.is_file():
        raise BatchError(f"{batch_dir}: no {MANIFEST}; not a saved batch, or an incomplete one")
    try:
        manifest = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as exc:
        raise BatchError(f"{path} is not valid JSON: {exc}") from exc
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise BatchError(f"{path}: not a {FORMAT} manifest")
    if manifest.get("version") != VERSION:
        raise BatchError(f"{path}: format version {manifest.get('version')!r}; this tandem reads {VERSION}")
    return manifest


def _payload(batch_dir: Path, manifest: dict[str, Any]) -> dict[str, Any]:
    entries = manifest.get("payload")
    if not isinstance(entries, dict) or set(entries) != {PAYLOAD}:
        raise BatchError(f"{batch_dir}: the manifest must list exactly {PAYLOAD} as its payload")
    entry = entries[PAYLOAD]
    path = batch_dir / PAYLOAD
    if not path.is_file():
        raise BatchError(f"{batch_dir}: {PAYLOAD} is missing; the batch is incomplete")
    raw = path.read_bytes()
    if not isinstance(entry, dict) or entry.get("bytes") != len(raw) or entry.get("sha256") != _sha256(raw):
        raise BatchError(
            f"{path} does not match the manifest's sha256 and size: the batch was modified or is truncated"
        )
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise BatchError(f"{path} is not valid JSON: {exc}") from exc
    if not isinstance(data, dict) or not isinstance(data.get("samples"), list):
        raise BatchError(f"{path} is not a saved training request")
    for name in _SUMMARY:
        saved = len(data["samples"]) if name == "samples" else data.get(name)
        if manifest.get(name) != saved:
            raise BatchError(f"{batch_dir}: the manifest's {name} ({manifest.get(name)!r}) disagrees with {PAYLOAD}")
    return data


def load_batch(batch_dir: Path, *, out_dir: Path, model_dir: Path | None = None) -> TrainingRequest:
    """The saved request, verified, writing to ``out_dir`` and training from ``model_dir`` if given.

    Args:
        batch_dir: a folder written by ``save_batch``.
        out_dir: the checkpoint folder the replay will create.
        model_dir: the base checkpoint; None: the one the batch names, which must still hold the
            weights it held when the batch was saved. Given, it is used as is (other weights, or
            the same ones on another machine); a different sha256 is logged as a warning.

    Raises:
        BatchError: the folder is incomplete or modified, the request does not parse, or the named
            base checkpoint is missing or changed.
    """
    batch_dir = Path(batch_dir)
    manifest = read_manifest(batch_dir)
    data = _payload(batch_dir, manifest)
    base = Path(model_dir) if model_dir is not None else Path(data["base_model_dir"])
    if not base.is_dir():
        raise BatchError(f"the base checkpoint {base} is not a folder on this machine (pass --model-dir)")
    found, saved = weights_sha256(base), manifest.get("base_weights_sha256")
    if found != saved:
        if model_dir is None:
            raise BatchError(
                f"the base checkpoint {base} changed since the batch was saved (weights sha256 {found[:12]}, "
                f"saved {str(saved)[:12]}); pass --model-dir to replay on other weights"
            )
        log.warning("replaying on other base weights than the batch was saved with", extra={"model_dir": str(base)})
    data.update(base_model_dir=str(base), out_dir=str(out_dir))
    try:
        return TrainingRequest.from_json(json.dumps(data))
    except (ValueError, KeyError, TypeError) as exc:
        raise BatchError(f"{batch_dir / PAYLOAD} is not a valid training request: {exc}") from exc


def replay_batch(batch_dir: Path, *, out_dir: Path, model_dir: Path | None = None) -> TrainingOutcome:
    """Train the saved batch again in the training child and export the checkpoint to ``out_dir``.

    Needs no engine, server or database: only the batch folder and the base checkpoint.

    Returns:
        The child's outcome, as the round would have got it (a failed run is reported, not raised).

    Raises:
        BatchError: see ``load_batch``; nothing was trained.
        FileExistsError: ``out_dir`` exists.
    """
    out_dir = Path(out_dir)
    if out_dir.exists():
        raise FileExistsError(f"{out_dir} exists: checkpoints are never overwritten")
    request = load_batch(batch_dir, out_dir=out_dir, model_dir=model_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    return run_training_child(request)
