"""Weights from a byte-level delta, and from tensors in shared memory, on the local engine and `tandem engine`.

Equality is bitwise: every parameter's sha256 as the engine serves it (GET /weights_checksum) against
the trainer's tensors cast to the engine's dtype.
"""

from __future__ import annotations

import base64
import pickle
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch

from server.engines.local.engine import LocalEngine
from server.engines.local.weights import WeightLoadError
from server.engines.sglang_client import SGLangClient
from server.engines.sglang_server import create_engine_app
from server.engines.tensor_ipc import TensorPayloadError, deserialize_named_tensors, serialize_named_tensors
from server.router.pool import EnginePool, PoolConfig
from server.weight_delta import DeltaError, OutOfOrderDelta, WeightDelta, read_checkpoint, tensor_sha256, write_delta
from tests.e2e.processes import start_tandem
from tests.server.engines.helpers import collect, greedy, greedy_reference
from tests.support.uvicorn_thread import serve_in_thread

PROMPT = [1, 287, 201, 268, 318, 81, 638, 2, 201, 1, 295, 201]


def served_checksums(tensors: dict[str, torch.Tensor]) -> dict[str, str]:
    """What the engine's checksums must be once it serves ``tensors`` (float32; the tiny model is untied)."""
    return {name: tensor_sha256(t.to(torch.float32)) for name, t in tensors.items()}


def shas(checksums: dict[str, dict]) -> dict[str, str]:
    return {name: entry["sha256"] for name, entry in checksums.items()}


@pytest.fixture(scope="module")
def delta_dir(tiny_model: Path, perturbed_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("deltas") / "default-to-v2"
    write_delta(
        read_checkpoint(tiny_model),
        read_checkpoint(perturbed_model),
        out,
        base_version="default",
        target_version="v2",
        files_from=perturbed_model,
    )
    return out


async def test_local_engine_applies_a_delta_bitwise(
    engine: LocalEngine, delta_dir: Path, perturbed_model: Path, tiny_model: Path
) -> None:
    await engine.update_weights_from_delta(WeightDelta.open(delta_dir), str(perturbed_model), "v2")
    assert shas(await engine.weights_checksums()) == served_checksums(read_checkpoint(perturbed_model))
    info = engine.model_info()
    assert (info.weight_version, info.model_path) == ("v2", str(perturbed_model))
    result = await collect(engine, PROMPT, greedy(12))
    assert result.token_ids == greedy_reference(perturbed_model, PROMPT, 12) and set(result.versions) == {"v2"}
    # Applied again, the same delta is out of order: the engine serves its target now, and keeps it.
    served = await engine.weights_checksums()
    with pytest.raises(OutOfOrderDelta, match="'default' into 'v2', but the weights it was applied to are 'v2'"):
        await engine.update_weights_from_delta(WeightDelta.open(delta_dir), "/elsewhere", "v3")
    assert await engine.weights_checksums() == served
    assert (engine.model_info().weight_version, engine.model_info().model_path) == ("v2", str(perturbed_model))


async def test_local_engine_refuses_a_corrupt_delta_unchanged(
    engine: LocalEngine, delta_dir: Path, tmp_path: Path
) -> None:
    before = await engine.weights_checksums()
    broken = tmp_path / "broken"
    broken.mkdir()
    for file in delta_dir.iterdir():
        (broken / file.name).write_bytes(file.read_bytes())
    payload = bytearray((broken / "delta.bin").read_bytes())
    payload[-100] ^= 0x01
    (broken / "delta.bin").write_bytes(bytes(payload))
    with pytest.raises(DeltaError):
        await engine.update_weights_from_delta(WeightDelta.open(broken), "/nowhere", "v2")
    assert await engine.weights_checksums() == before
    assert engine.model_info().weight_version == "default"


async def test_local_engine_takes_in_memory_tensors(engine: LocalEngine, perturbed_model: Path) -> None:
    tensors = read_checkpoint(perturbed_model)
    path_before = engine.model_info().model_path
    await engine.update_weights_from_tensors(tensors, "v-mem")
    assert shas(await engine.weights_checksums()) == served_checksums(tensors)
    assert engine.model_info().weight_version == "v-mem" and engine.model_info().model_path == path_before
    with pytest.raises(WeightLoadError, match="wrong shapes"):
        await engine.update_weights_from_tensors({"lm_head.weight": torch.zeros(2, 2)}, "v-bad")
    assert engine.model_info().weight_version == "v-mem"


@pytest.fixture(scope="module")
def engine_urls(tiny_model: Path) -> Iterator[list[str]]:
    with (
        serve_in_thread(create_engine_app(lambda: LocalEngine.open(tiny_model, torch_threads=1))) as first,
        serve_in_thread(create_engine_app(lambda: LocalEngine.open(tiny_model, torch_threads=1))) as second,
    ):
        yield [first, second]


async def test_pool_rolls_a_delta_out_and_falls_back_to_disk_where_the_base_is_not_served(
    engine_urls: list[str], delta_dir: Path, tiny_model: Path, perturbed_model: Path
) -> None:
    want = served_checksums(read_checkpoint(perturbed_model))

    async def assert_all_serve_v2() -> None:
        async with httpx.AsyncClient(timeout=60) as http:
            for url in engine_urls:
                served = (await http.get(f"{url}/weights_checksum")).json()
                assert served["weight_version"] == "v2" and shas(served["tensors"]) == want

    pool = await EnginePool.open(engine_urls, PoolConfig(health_interval_s=3600, health_timeout_s=30))
    try:
        assert all(r.client.weight_sources == {"disk", "delta", "tensor"} for r in pool.replicas.values())
        # Both serve the base: both apply the delta (the checkpoint path is only reported, never read).
        await pool.update_weights_from_delta(WeightDelta.open(delta_dir), "/not/read/v2", "v2")
        await assert_all_serve_v2()
        assert {r.client.model_info().model_path for r in pool.replicas.values()} == {"/not/read/v2"}
        after = [c async for c in pool.generate(PROMPT, greedy(8))]
        assert [t for c in after for t in c.token_ids] == greedy_reference(perturbed_model, PROMPT, 8)

        await pool.update_weights(str(tiny_model), "default")
        second = pool.replicas[engine_urls[1]].client
        await second.update_weights(str(tiny_model), "elsewhere")
        async with httpx.AsyncClient(timeout=60) as http:
            refused = await http.post(
                f"{engine_urls[1]}/update_weights_from_delta",
                json={"delta_path": str(delta_dir), "model_path": str(perturbed_model), "weight_version": "v2"},
            )
        assert refused.status_code == 409 and "'elsewhere'" in refused.json()["message"]
        # Not at the delta's base, the second replica loads the whole checkpoint instead.
        await pool.update_weights_from_delta(WeightDelta.open(delta_dir), str(perturbed_model), "v2")
        await assert_all_serve_v2()
    finally:
        await pool.update_weights(str(tiny_model), "default")
        await pool.close()


@pytest.mark.parametrize(
    ("path", "body", "message"),
    [
        ("/update_weights_from_delta", {"delta_path": "/x"}, "model_path, weight_version required"),
        ("/update_weights_from_delta", [], "must be a JSON object"),
        (
            "/update_weights_from_delta",
            {"delta_path": "/nowhere", "model_path": "/x", "weight_version": "v"},
            "no delta.json",
        ),
        ("/update_weights_from_tensor", {"serialized_named_tensors": []}, "one payload"),
        ("/update_weights_from_tensor", {"serialized_named_tensors": ["not base64!"]}, "not base64"),
        ("/update_weights_from_disk", {}, "model_path required"),
    ],
)
def test_bad_weight_update_requests_are_400(engine_urls: list[str], path: str, body: object, message: str) -> None:
    response = httpx.post(engine_urls[0] + path, json=body, timeout=30)
    assert response.status_code == 400
    assert response.json()["success"] is False and message in response.json()["message"]


class _Exploit:
    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (print, ("this must never run",))


def test_a_payload_that_is_not_only_torch_is_refused() -> None:
    with pytest.raises(TensorPayloadError, match=r"refers to builtins\.print"):
        deserialize_named_tensors(base64.b64encode(pickle.dumps([("x", _Exploit())])).decode())
    with pytest.raises(TensorPayloadError, match=r"list of \(name, tensor\) pairs"):
        deserialize_named_tensors(base64.b64encode(pickle.dumps([1])).decode())
    shared = deserialize_named_tensors(serialize_named_tensors([("w", torch.arange(4.0))]))
    assert shared[0][0] == "w" and torch.equal(shared[0][1], torch.arange(4.0))


@pytest.fixture(scope="module")
def engine_process(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real `tandem engine` process: the colocated engine the trainer (this test process) feeds."""
    process = start_tandem(
        ["engine", "--model", str(tiny_model)], data_dir=tmp_path_factory.mktemp("engine"), ready_path="/model_info"
    )
    try:
        yield process.url
    finally:
        process.stop()


async def test_trainer_process_hands_weights_to_an_engine_process_through_shared_memory(
    engine_process: str, perturbed_model: Path
) -> None:
    # The trainer's updated weights, in the engine's dtype (what a colocated trainer would hold).
    tensors = {name: t.to(torch.float32) for name, t in read_checkpoint(perturbed_model).items()}
    client = await SGLangClient.open(engine_process)
    try:
        await client.update_weights_from_tensor(serialize_named_tensors(list(tensors.items())), "v-ipc")
        assert client.model_info().weight_version == "v-ipc"
        async with httpx.AsyncClient(timeout=60) as http:
            served = (await http.get(f"{engine_process}/weights_checksum")).json()
            assert shas(served["tensors"]) == served_checksums(tensors)
            # Tensors that do not fit the model change nothing.
            wrong = serialize_named_tensors([("lm_head.weight", torch.zeros(4, 4))])
            response = await http.post(
                f"{engine_process}/update_weights_from_tensor",
                json={"serialized_named_tensors": [wrong], "weight_version": "v-wrong"},
            )
            assert response.status_code == 400 and "wrong shapes" in response.json()["message"]
            again = (await http.get(f"{engine_process}/weights_checksum")).json()
            assert again == served
    finally:
        await client.close()
