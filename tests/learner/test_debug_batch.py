"""A saved round batch replays to the same weights as the round's own training, with nothing else running.

Samples are the tiny model's own (sampled, with their behaviour log-probs), trained with TIS over two
steps. The three training children (direct, replay_batch, the CLI) start together, a thread each.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from learner.algorithms import PolicyLossConfig
from learner.debug_batch import BatchError, load_batch, read_manifest, replay_batch, save_batch
from learner.sample import Sample
from learner.trainers import TrainConfig, response_log_probs
from learner.training import TrainingOutcome, TrainingRequest, run_training_child
from server.engines.local.weights import read_state_dict
from tandem.cli import app
from tests.fixtures.tiny_model import tiny_model_path
from tests.learner.trainers.conftest import load_tiny

PROMPTS, GROUP, NEW_TOKENS = 2, 4, 6


def own_samples(base: Path) -> list[Sample]:
    """The tiny model's sampled answers, rewarded 1 when they hold an even token, as serving logged them."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = load_tiny(base)
        torch.manual_seed(0)
        prompts = torch.randint(3, 2048, (PROMPTS, 5))
        with torch.no_grad():
            rows = model.generate(
                prompts.repeat_interleave(GROUP, 0),
                do_sample=True,
                top_k=0,
                max_new_tokens=NEW_TOKENS,
                min_new_tokens=NEW_TOKENS,
                pad_token_id=0,
            )
        samples = [
            Sample(
                prompt_token_ids=row[:5].tolist(),
                response_token_ids=row[5:].tolist(),
                group_index=i // GROUP,
                index=i,
                reward=float(sum(t % 2 == 0 for t in row[5:].tolist()) > NEW_TOKENS // 2),
            )
            for i, row in enumerate(rows)
        ]
        for sample, log_probs in zip(samples, response_log_probs(model, samples, 4096), strict=True):
            sample.rollout_log_probs = log_probs.tolist()
    finally:
        torch.set_num_threads(threads)
    return samples


@pytest.fixture(scope="module")
def request_(tmp_path_factory: pytest.TempPathFactory) -> TrainingRequest:
    samples = own_samples(tiny_model_path())
    mean = sum(s.reward_value() for s in samples) / len(samples)
    return TrainingRequest(
        base_model_dir=tiny_model_path(),
        out_dir=tmp_path_factory.mktemp("direct") / "checkpoint",
        samples=tuple(samples),
        config=TrainConfig(loss=PolicyLossConfig(use_tis=True), max_tokens_per_micro_batch=32),
        num_steps=2,
        learning_rate=1e-2,  # large enough to move bf16 weights
        num_threads=1,
        timeout_s=120,
        advantages=tuple(s.reward_value() - mean + 0.01 * s.index for s in samples),  # as a round passes them
    )


@pytest.fixture(scope="module")
def batch_dir(request_: TrainingRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_batch(request_, tmp_path_factory.mktemp("batches") / "round-1", info={"round_id": "round-1"})


@pytest.fixture(scope="module")
def runs(
    request_: TrainingRequest, batch_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, tuple[TrainingOutcome | subprocess.CompletedProcess[str], Path]]:
    out = tmp_path_factory.mktemp("replays")
    cli = [sys.executable, "-m", "tandem.cli", "replay", str(batch_dir), "--out", str(out / "cli")]
    with ThreadPoolExecutor(3) as pool:
        direct = pool.submit(run_training_child, request_)
        replayed = pool.submit(replay_batch, batch_dir, out_dir=out / "replay")
        by_cli = pool.submit(subprocess.run, cli, capture_output=True, text=True, timeout=180, check=False)
        return {
            "direct": (direct.result(), request_.out_dir),
            "replay": (replayed.result(), out / "replay"),
            "cli": (by_cli.result(), out / "cli"),
        }


def test_the_batch_folder_holds_the_request_and_a_manifest(batch_dir: Path, request_: TrainingRequest) -> None:
    assert sorted(p.name for p in batch_dir.iterdir()) == ["manifest.json", "request.json"]
    assert list(batch_dir.parent.glob(".*")) == []  # no staging folder left behind
    manifest = read_manifest(batch_dir)
    assert manifest["samples"] == 8 and manifest["num_steps"] == 2 and manifest["info"] == {"round_id": "round-1"}
    loaded = load_batch(batch_dir, out_dir=Path("/elsewhere"))
    # Samples (compared as data: Sample compares by identity), advantages and config survive exactly.
    assert [s.to_dict() for s in loaded.samples] == [s.to_dict() for s in request_.samples]
    assert replace(loaded, samples=request_.samples) == replace(request_, out_dir=Path("/elsewhere"))


def test_replays_write_the_weights_the_round_wrote(runs: dict, request_: TrainingRequest) -> None:
    (direct, direct_dir), (replayed, replay_dir), (cli, cli_dir) = runs["direct"], runs["replay"], runs["cli"]
    assert direct.status == "succeeded" and replayed.status == "succeeded", (direct.error, replayed.error)
    assert cli.returncode == 0, cli.stderr
    summary = cli.stdout.strip().splitlines()[-1]
    assert summary.startswith("replayed ") and "8 samples, 2 steps" in summary and str(cli_dir) in summary
    assert replayed.checkpoint.sha256 == direct.checkpoint.sha256
    weights = {
        name: read_state_dict(path) for name, path in (("direct", direct_dir), ("replay", replay_dir), ("cli", cli_dir))
    }
    base = read_state_dict(request_.base_model_dir)
    assert weights["direct"].keys() == weights["replay"].keys() == weights["cli"].keys() == base.keys()
    for name, tensor in weights["direct"].items():
        assert torch.equal(tensor, weights["replay"][name]) and torch.equal(tensor, weights["cli"][name]), name
    assert sum(not torch.equal(weights["direct"][n], base[n]) for n in base) > len(base) // 2  # training moved them
    assert [m["loss"] for m in replayed.metrics] == [m["loss"] for m in direct.metrics]


def tampered_copy(batch_dir: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "batch"
    shutil.copytree(batch_dir, copy)
    return copy


def edit_json(path: Path, edit: Callable[[dict], object]) -> None:
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))


@pytest.mark.parametrize(
    ("tamper", "message"),
    [
        (lambda d: edit_json(d / "manifest.json", lambda m: m.update(learning_rate=1.0)), "learning_rate"),
        (lambda d: edit_json(d / "manifest.json", lambda m: m["payload"]["request.json"].update(bytes=1)), "sha256"),
        (lambda d: edit_json(d / "request.json", lambda r: r.update(learning_rate=1.0)), "modified"),
        (lambda d: (d / "request.json").unlink(), "request.json is missing"),
        (lambda d: (d / "manifest.json").unlink(), "no manifest.json"),
        (lambda d: (d / "manifest.json").write_text("{"), "not valid JSON"),
        (lambda d: edit_json(d / "manifest.json", lambda m: m.update(version=2)), "format version 2"),
    ],
    ids=["manifest-field", "manifest-size", "payload", "no-payload", "no-manifest", "bad-json", "version"],
)
def test_a_tampered_or_incomplete_batch_is_refused(
    batch_dir: Path, tmp_path: Path, tamper: Callable[[Path], object], message: str
) -> None:
    copy = tampered_copy(batch_dir, tmp_path)
    tamper(copy)
    with pytest.raises(BatchError, match=message):
        replay_batch(copy, out_dir=tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_changed_base_weights_are_refused_unless_named(request_: TrainingRequest, tmp_path: Path) -> None:
    base = tmp_path / "base"
    shutil.copytree(tiny_model_path(), base)
    saved = save_batch(replace(request_, base_model_dir=base), tmp_path / "batch")
    assert load_batch(saved, out_dir=tmp_path / "out").base_model_dir == base
    weights = next(base.glob("*.safetensors"))
    weights.write_bytes(weights.read_bytes()[:-1] + b"\0")
    with pytest.raises(BatchError, match="changed since the batch was saved"):
        load_batch(saved, out_dir=tmp_path / "out")
    assert load_batch(saved, out_dir=tmp_path / "out", model_dir=base).base_model_dir == base


def test_the_cli_refuses_a_tampered_batch_without_training(batch_dir: Path, tmp_path: Path) -> None:
    copy = tampered_copy(batch_dir, tmp_path)
    (copy / "request.json").write_text("{}")
    result = CliRunner().invoke(app, ["replay", str(copy), "--out", str(tmp_path / "out")])
    assert result.exit_code == 2 and "modified or is truncated" in result.output
    assert not (tmp_path / "out").exists()


def test_saving_never_overwrites(batch_dir: Path, request_: TrainingRequest) -> None:
    with pytest.raises(FileExistsError):
        save_batch(request_, batch_dir)
