"""SGLang's distributed weight sync over gloo: this test process is the trainer (rank 0), a real
`tandem engine` process the receiver. Equality is bitwise: the engine's per-parameter sha256
(GET /weights_checksum) against the trainer's tensors as the engine serves them (float32).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import httpx
import pytest
import torch

from learner.weight_broadcast import (
    BroadcastConfig,
    BroadcastError,
    EngineTarget,
    WeightBroadcaster,
    broadcast_weights,
    plan_buckets,
)
from server.weight_delta import read_checkpoint, tensor_sha256
from tests.e2e.processes import start_tandem
from tests.server.conftest import perturbed_model, tiny_model  # noqa: F401  (fixtures)
from tests.server.engines.helpers import greedy_reference

PROMPT = [1, 287, 201, 268, 318, 81, 638, 2, 201, 1, 295, 201]
GLOO = BroadcastConfig(backend="gloo", bucket_bytes=256 << 10, timeout_s=60)
FITS = "model.layers.0.input_layernorm.weight"


@pytest.fixture(scope="module")
def engine(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineTarget]:  # noqa: F811
    process = start_tandem(
        ["engine", "--model", str(tiny_model)], data_dir=tmp_path_factory.mktemp("engine"), ready_path="/model_info"
    )
    try:
        yield EngineTarget(process.url)
    finally:
        process.stop()


def served(engine: EngineTarget) -> dict:
    return httpx.get(f"{engine.url}/weights_checksum", timeout=60).json()


def shas(tensors: dict[str, torch.Tensor]) -> dict[str, str]:
    """What the engine's checksums are once it serves ``tensors`` (it serves float32)."""
    return {name: tensor_sha256(t.to(torch.float32)) for name, t in tensors.items()}


def greedy_output(engine: EngineTarget, n: int) -> list[int]:
    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}}
    return httpx.post(f"{engine.url}/generate", json=body, timeout=60).json()["output_ids"]


def test_buckets_keep_the_order_and_stay_under_the_cap() -> None:
    named = [(f"t{i}", torch.zeros(n, dtype=torch.float32)) for i, n in enumerate([10, 20, 5, 100, 1, 1])]
    buckets = plan_buckets(named, 120)  # bytes: 40, 80, 20, 400, 4, 4
    assert [[name for name, _ in bucket] for bucket in buckets] == [["t0", "t1"], ["t2"], ["t3"], ["t4", "t5"]]


def test_the_engine_process_ends_up_with_the_trainers_weights_bitwise(
    engine: EngineTarget,
    tiny_model: Path,  # noqa: F811
    perturbed_model: Path,  # noqa: F811
) -> None:
    trained = {name: t.to(torch.float32) for name, t in read_checkpoint(perturbed_model).items()}
    stats = broadcast_weights([engine], list(trained.items()), "v-dist", GLOO)
    assert stats.buckets == len(plan_buckets(list(trained.items()), GLOO.bucket_bytes)) > 3
    assert stats.tensors == len(trained) and stats.bytes == sum(t.numel() * 4 for t in trained.values())
    assert stats.transfer_s > 0 and stats.gb_per_s > 0
    now = served(engine)
    assert now["weight_version"] == "v-dist"
    assert {name: entry["sha256"] for name, entry in now["tensors"].items()} == shas(trained)
    assert greedy_output(engine, 12) == greedy_reference(perturbed_model, PROMPT, 12)

    # bfloat16 into the float32 engine converts exactly: the trainer may send half the bytes.
    original = read_checkpoint(tiny_model)
    assert {t.dtype for t in original.values()} == {torch.bfloat16}
    stats = broadcast_weights([engine], list(original.items()), "default", GLOO)
    now = served(engine)
    assert now["weight_version"] == "default" and stats.bytes == sum(t.numel() * 2 for t in original.values())
    assert {name: entry["sha256"] for name, entry in now["tensors"].items()} == shas(original)


@pytest.mark.parametrize(
    ("name", "tensor", "message"),
    [
        ("lm_head.weight", torch.zeros(2048, 64, dtype=torch.float64), "lm_head.weight float64[2048, 64] into float32"),
        ("model.norm.weight", torch.zeros(65), "model.norm.weight float32[65] into float32[64]"),
        ("model.layers.9.mlp.up_proj.weight", torch.zeros(3), "unknown ['model.layers.9.mlp.up_proj.weight']"),
    ],
)
def test_a_bucket_that_does_not_fit_is_refused_and_the_group_stays_usable(
    engine: EngineTarget, name: str, tensor: torch.Tensor, message: str
) -> None:
    before = served(engine)
    norm = torch.full((64,), 0.5)
    with WeightBroadcaster([engine], replace(GLOO, bucket_bytes=64 << 20)) as broadcaster:  # one bucket
        with pytest.raises(BroadcastError, match="answered 400") as refused:
            broadcaster.send([(FITS, norm), (name, tensor)], "v-bad")
        assert message in str(refused.value)
        # The bucket was refused whole, before anything was copied in.
        assert served(engine) == before
        # The broadcast itself completed, so the same group carries the next bucket.
        broadcaster.send([(FITS, norm)], "v-norm")
    now = served(engine)
    assert now["weight_version"] == "v-norm" and now["tensors"][FITS]["sha256"] == tensor_sha256(norm)
    broadcast_weights([engine], [(FITS, torch.ones(64))], before["weight_version"], GLOO)  # as built: ones
    assert served(engine) == before


@pytest.mark.parametrize(
    ("path", "body", "message"),
    [
        ("/update_weights_from_distributed", {"names": ["a"], "dtypes": ["float32"], "shapes": [[1]]}, "no group"),
        ("/update_weights_from_distributed", {"names": ["a"], "dtypes": ["float9"], "shapes": [[1]]}, "not a torch"),
        ("/update_weights_from_distributed", {"names": ["a", "b"], "dtypes": ["float32"], "shapes": [[1]]}, "length"),
        ("/update_weights_from_distributed", {"names": ["a"], "dtypes": ["float32"], "shapes": [[-1]]}, "non-negative"),
        ("/destroy_weights_update_group", {"group_name": "nothing"}, "no group 'nothing'"),
        (
            "/init_weights_update_group",
            {"master_address": "127.0.0.1", "master_port": 1, "world_size": 2},
            "rank_offset",
        ),
        (
            "/init_weights_update_group",
            {"master_address": "127.0.0.1", "master_port": 1, "rank_offset": 0, "world_size": 2},
            "rank_offset must be in [1, world_size)",
        ),
        (
            "/init_weights_update_group",
            {"master_address": "127.0.0.1", "master_port": 1, "rank_offset": 1, "world_size": 2, "backend": "nccl"},
            "nccl needs an engine on a GPU",
        ),
    ],
)
def test_requests_the_engine_cannot_serve_are_refused_at_once(
    engine: EngineTarget, path: str, body: dict, message: str
) -> None:
    response = httpx.post(f"{engine.url}{path}", json=body, timeout=10)
    assert response.status_code == 400 and response.json()["success"] is False
    assert message in response.json()["message"]


def test_an_engine_that_refuses_a_bucket_request_fails_the_send_at_once(engine: EngineTarget) -> None:
    """It never joins that broadcast: the trainer must not wait for the group's timeout to find out."""
    before = served(engine)
    broadcaster = WeightBroadcaster([engine], GLOO)
    broadcaster.connect()
    try:
        left = httpx.post(f"{engine.url}/destroy_weights_update_group", json={"group_name": GLOO.group_name})
        assert left.status_code == 200
        started = time.monotonic()
        with pytest.raises(BroadcastError, match="no group 'weight_update_group'"):
            broadcaster.send([(FITS, torch.ones(64))], "v-lost")
        assert time.monotonic() - started < GLOO.timeout_s / 4
        with pytest.raises(BroadcastError, match="unusable"):
            broadcaster.send([(FITS, torch.ones(64))], "v-lost")
    finally:
        broadcaster.close()
    assert served(engine) == before
    # The broken group was left here too, so this process syncs again under the same name.
    broadcast_weights([engine], [(FITS, torch.ones(64))], "v-again", GLOO)
    assert served(engine)["weight_version"] == "v-again"
    broadcast_weights([engine], [(FITS, torch.ones(64))], before["weight_version"], GLOO)
    assert served(engine) == before


def test_a_group_name_this_process_has_open_is_refused_before_any_engine_is_asked(engine: EngineTarget) -> None:
    """An engine asked to join would wait in the rendezvous for this process until its timeout."""
    with WeightBroadcaster([engine], GLOO) as first:
        second = WeightBroadcaster([engine], GLOO)
        with pytest.raises(BroadcastError, match="already has a group 'weight_update_group' open"):
            second.connect()
        second.close()
        first.send([(FITS, torch.ones(64))], served(engine)["weight_version"])
