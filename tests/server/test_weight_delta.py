"""The byte-level weight delta format: round trips bitwise, refuses the wrong base and corrupt payloads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from server.weight_delta import (
    DeltaChecksumError,
    DeltaError,
    OutOfOrderDelta,
    WeightDelta,
    materialise,
    read_checkpoint,
    tensor_sha256,
    write_delta,
)


def assert_bitwise_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype and got[name].shape == tensor.shape, name
        assert tensor_sha256(got[name]) == tensor_sha256(tensor), name


@pytest.fixture
def delta(tiny_model: Path, perturbed_model: Path, tmp_path: Path) -> WeightDelta:
    write_delta(
        read_checkpoint(tiny_model),
        read_checkpoint(perturbed_model),
        tmp_path / "delta",
        base_version="v1",
        target_version="v2",
        files_from=perturbed_model,
    )
    return WeightDelta.open(tmp_path / "delta")


@pytest.mark.parametrize("compression", ["zstd", "zlib", "none"])
def test_base_plus_delta_is_the_target_bitwise(
    tiny_model: Path, perturbed_model: Path, tmp_path: Path, compression: str
) -> None:
    base, target = read_checkpoint(tiny_model), read_checkpoint(perturbed_model)
    stats = write_delta(
        base,
        target,
        tmp_path / "d",
        base_version="v1",
        target_version="v2",
        compression=compression,  # type: ignore[arg-type]
    )
    delta = WeightDelta.open(tmp_path / "d")
    assert (delta.base_version, delta.target_version) == ("v1", "v2")
    changed = delta.apply(base.get)
    # perturb_weights adds noise to the matrices only: the norms ship nothing.
    assert set(changed) == {name for name, t in target.items() if t.dim() == 2}
    assert stats.tensors == {"same": len(target) - len(changed), "xor": len(changed), "full": 0}
    assert_bitwise_equal({**base, **changed}, target)
    assert stats.payload_bytes == delta.payload_bytes == (tmp_path / "d" / "delta.bin").stat().st_size
    assert stats.full_bytes == sum(t.numel() * t.element_size() for t in target.values())
    if compression != "none":
        assert stats.payload_bytes < stats.changed_bytes <= stats.full_bytes


def test_identical_weights_ship_nothing(tiny_model: Path, tmp_path: Path) -> None:
    weights = read_checkpoint(tiny_model)
    stats = write_delta(weights, weights, tmp_path / "d", base_version="a", target_version="b")
    assert stats.payload_bytes == stats.changed_bytes == 0
    assert WeightDelta.open(tmp_path / "d").apply(weights.get) == {}


def test_new_shape_dtype_or_name_ships_the_full_tensor(tiny_model: Path, tmp_path: Path) -> None:
    base = read_checkpoint(tiny_model)
    target = dict(base)
    norm = next(name for name, t in base.items() if t.dim() == 1)
    matrix = next(name for name, t in base.items() if t.dim() == 2)
    target[norm] = base[norm].to(torch.float32) * 2
    target[matrix] = base[matrix][:-1].clone()
    target["extra.weight"] = torch.arange(6, dtype=torch.int64).reshape(2, 3)
    write_delta(base, target, tmp_path / "d", base_version="a", target_version="b")
    delta = WeightDelta.open(tmp_path / "d")
    assert {name for name, e in delta.tensors.items() if e.encoding == "full"} == {norm, matrix, "extra.weight"}
    assert_bitwise_equal({**base, **delta.apply(base.get)}, target)


def test_out_of_order_base_is_refused(delta: WeightDelta) -> None:
    delta.check_base("v1")
    with pytest.raises(OutOfOrderDelta, match="turns 'v1' into 'v2', but the weights it was applied to are 'v0'"):
        delta.check_base("v0")


def test_other_base_bytes_fail_the_checksum(delta: WeightDelta, perturbed_model: Path) -> None:
    wrong_base = read_checkpoint(perturbed_model)  # the target itself: XOR-ing the delta again gives the base
    with pytest.raises(DeltaChecksumError, match="does not match the delta's sha256"):
        delta.apply(wrong_base.get)


def test_wider_served_base_casts_back_exactly(delta: WeightDelta, tiny_model: Path, perturbed_model: Path) -> None:
    served = {name: t.to(torch.float32) for name, t in read_checkpoint(tiny_model).items()}  # bf16 served in fp32
    changed = delta.apply(served.get)
    target = read_checkpoint(perturbed_model)
    assert_bitwise_equal(changed, {name: target[name] for name in changed})
    # A narrower one cannot give the base's bytes back.
    narrowed = {name: t.to(torch.float16) for name, t in read_checkpoint(tiny_model).items()}
    with pytest.raises(DeltaChecksumError):
        delta.apply(narrowed.get)


def test_missing_or_reshaped_base_tensor_is_refused(delta: WeightDelta, tiny_model: Path) -> None:
    base = read_checkpoint(tiny_model)
    name = next(n for n, e in delta.tensors.items() if e.encoding == "xor")
    with pytest.raises(DeltaError, match="the base has no such tensor"):
        delta.apply({k: v for k, v in base.items() if k != name}.get)
    with pytest.raises(DeltaError, match="expects a base tensor of shape"):
        delta.apply({**base, name: base[name][:1]}.get)


def test_corrupt_payload_is_refused(delta: WeightDelta, tiny_model: Path) -> None:
    payload = delta.path / "delta.bin"
    data = bytearray(payload.read_bytes())
    data[len(data) // 2] ^= 0xFF
    payload.write_bytes(bytes(data))
    with pytest.raises(DeltaError):
        delta.apply(read_checkpoint(tiny_model).get)


def test_manifest_that_lies_about_a_checksum_is_refused(delta: WeightDelta, tiny_model: Path) -> None:
    manifest = json.loads((delta.path / "delta.json").read_text())
    name = next(n for n, e in manifest["tensors"].items() if e["encoding"] == "same")
    manifest["tensors"][name]["sha256"] = "0" * 64
    (delta.path / "delta.json").write_text(json.dumps(manifest))
    with pytest.raises(DeltaChecksumError, match=name):
        WeightDelta.open(delta.path).apply(read_checkpoint(tiny_model).get)


@pytest.mark.parametrize(
    "manifest",
    [None, "not json", json.dumps({"format": "other"}), json.dumps({"format": "tandem-weight-delta/1"})],
)
def test_unreadable_manifest_is_a_delta_error(tmp_path: Path, manifest: str | None) -> None:
    if manifest is not None:
        (tmp_path / "delta.json").write_text(manifest)
    with pytest.raises(DeltaError, match=str(tmp_path)):
        WeightDelta.open(tmp_path)


def test_materialise_writes_the_target_checkpoint(
    delta: WeightDelta, tiny_model: Path, perturbed_model: Path, tmp_path: Path
) -> None:
    out = materialise(delta, tiny_model, tmp_path / "full")
    assert_bitwise_equal(load_file(out / "model.safetensors"), read_checkpoint(perturbed_model))
    assert json.loads((out / "config.json").read_text()) == json.loads((perturbed_model / "config.json").read_text())
    assert (out / "tokenizer.json").is_file() and not (out / "delta.json").exists()
    # A retry finds it done; the target's own export is accepted as is; other weights are not.
    assert materialise(delta, tiny_model, out) == out
    assert materialise(delta, tiny_model, perturbed_model) == perturbed_model
    with pytest.raises(DeltaError, match="is not the delta's target tensor"):
        materialise(delta, tiny_model, tiny_model)
    with pytest.raises(DeltaChecksumError):
        materialise(delta, perturbed_model, tmp_path / "from-the-wrong-base")
    assert not (tmp_path / "from-the-wrong-base").exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_delta_folders_are_never_overwritten(delta: WeightDelta, tiny_model: Path) -> None:
    weights = read_checkpoint(tiny_model)
    with pytest.raises(FileExistsError):
        write_delta(weights, weights, delta.path, base_version="a", target_version="b")
