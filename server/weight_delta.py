"""Byte-level weight deltas: ship only what changed between two versions of a checkpoint.

A delta folder holds ``delta.json`` (the manifest), ``delta.bin`` (the payloads, one after another)
and the target checkpoint's small files (config, tokenizer), so base + delta is a whole checkpoint.
Per tensor the manifest gives its dtype, shape, encoding and the sha256 of the target's raw bytes:

- ``same``: bit-identical to the base tensor; nothing shipped.
- ``xor``: the target bytes XOR the base bytes (zero wherever a byte did not change), split into
  byte planes (every element's first byte, then every second byte, ...: the sign/exponent planes of
  a small update are almost all zero) and compressed.
- ``full``: no usable base tensor (new name, other shape or dtype): the target bytes, same pipeline.

Applying refuses a base whose version is not the manifest's ``base_version`` (``OutOfOrderDelta``)
and any tensor whose result does not hash to its recorded sha256 (``DeltaChecksumError``); both are
raised before the caller changes anything. The server owns this format; the learner imports it to
write deltas (``server`` never imports ``learner``).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import time
import uuid
import zlib
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal

import torch
import zstandard
from safetensors.torch import load_file, save_file

__all__ = [
    "DeltaChecksumError",
    "DeltaError",
    "DeltaStats",
    "OutOfOrderDelta",
    "WeightDelta",
    "materialise",
    "read_checkpoint",
    "tensor_sha256",
    "write_delta",
]

MANIFEST, PAYLOAD = "delta.json", "delta.bin"
FORMAT = "tandem-weight-delta/1"
Encoding = Literal["same", "xor", "full"]
Compression = Literal["zstd", "zlib", "none"]
_INDEX_FILE = "model.safetensors.index.json"  # names shard files a materialised checkpoint does not have


class DeltaError(ValueError):
    """A delta that cannot be read or applied; whatever it was applied to is unchanged."""


class OutOfOrderDelta(DeltaError):
    """The delta was built against another version than the one it is applied to."""


class DeltaChecksumError(DeltaError):
    """A tensor rebuilt from base + delta does not hash to the sha256 the delta recorded."""


@dataclass(frozen=True, slots=True)
class TensorEntry:
    dtype: str
    shape: tuple[int, ...]
    encoding: Encoding
    offset: int
    length: int
    sha256: str

    @property
    def torch_dtype(self) -> torch.dtype:
        dtype = getattr(torch, self.dtype, None)
        if not isinstance(dtype, torch.dtype):
            raise DeltaError(f"unknown dtype {self.dtype!r} in the manifest")
        return dtype


@dataclass(slots=True)
class DeltaStats:
    """What a delta costs: ``payload_bytes`` shipped for ``full_bytes`` of weights."""

    full_bytes: int = 0
    payload_bytes: int = 0
    changed_bytes: int = 0  # bytes that differ from the base (the floor of any byte-range encoding)
    tensors: dict[str, int] = field(default_factory=lambda: {"same": 0, "xor": 0, "full": 0})
    seconds: float = 0.0

    @property
    def ratio(self) -> float:
        return self.payload_bytes / self.full_bytes if self.full_bytes else 0.0


def _raw(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes, flat uint8 on the CPU (a view when it is already contiguous there)."""
    return tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)


def _xor(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Bytewise XOR, a machine word at a time where the bytes allow it (torch runs it on every core)."""
    for size, word in ((8, torch.int64), (4, torch.int32), (2, torch.int16)):
        if a.numel() % size == 0:
            try:
                return torch.bitwise_xor(a.view(word), b.view(word)).view(torch.uint8)
            except RuntimeError:  # a view of misaligned bytes (a tensor inside a mapped file)
                break
    return torch.bitwise_xor(a, b)


def _planes(data: torch.Tensor, itemsize: int) -> torch.Tensor:
    return data.reshape(-1, itemsize).T.contiguous().reshape(-1) if itemsize > 1 else data


def _unplanes(data: torch.Tensor, itemsize: int) -> torch.Tensor:
    return data.reshape(itemsize, -1).T.contiguous().reshape(-1) if itemsize > 1 else data


def _from_bytes(data: bytes) -> torch.Tensor:
    """A writable uint8 tensor holding ``data``."""
    return torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)


def _compressor(compression: Compression, level: int) -> Callable[[memoryview], bytes]:
    if compression == "zstd":
        return zstandard.ZstdCompressor(level=level).compress
    if compression == "zlib":
        return lambda data: zlib.compress(data, level)
    return bytes


def _decompressor(compression: str) -> Callable[[bytes], bytes]:
    if compression == "zstd":
        return zstandard.ZstdDecompressor().decompress
    if compression == "zlib":
        return zlib.decompress
    if compression == "none":
        return bytes
    raise DeltaError(f"unknown compression {compression!r} in the manifest")


def _sha256(data: torch.Tensor) -> str:
    return hashlib.sha256(data.numpy().data).hexdigest()


def tensor_sha256(tensor: torch.Tensor) -> str:
    """sha256 of a tensor's raw bytes (row-major, on the CPU): equal hashes mean bitwise-equal weights."""
    return _sha256(_raw(tensor))


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def read_checkpoint(path: Path, *, error: type[Exception] = DeltaError) -> dict[str, torch.Tensor]:
    """Every tensor of a safetensors checkpoint folder (one file or shards).

    Raises:
        error: no safetensors file, or an unreadable one (``DeltaError`` unless the caller names its own).
    """
    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise error(f"{path}: no *.safetensors files")
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        try:
            tensors.update(load_file(file))
        except Exception as exc:  # safetensors raises its own error types for corrupt files
            raise error(f"{file}: unreadable checkpoint: {exc}") from exc
    return tensors


def write_delta(
    base: Mapping[str, torch.Tensor],
    target: Mapping[str, torch.Tensor],
    out_dir: Path,
    *,
    base_version: str,
    target_version: str,
    files_from: Path | None = None,
    compression: Compression = "zstd",
    level: int = 1,
    byte_planes: bool = True,
) -> DeltaStats:
    """Write the delta that turns ``base`` into ``target`` into the new folder ``out_dir``.

    Args:
        base, target: name -> tensor, as the checkpoints hold them (``read_checkpoint``).
        files_from: the target checkpoint folder, whose non-weight files (config, tokenizer) are copied.
        compression, level: how payloads are compressed.
        byte_planes: split each payload into byte planes before compressing (BENCHMARKS.md measures both).

    Raises:
        FileExistsError: ``out_dir`` exists.
    """
    out_dir = Path(out_dir)
    if out_dir.exists():
        raise FileExistsError(f"{out_dir} exists: deltas are never overwritten")
    started = time.perf_counter()
    compress = _compressor(compression, level)
    stats = DeltaStats()
    entries: dict[str, TensorEntry] = {}
    with _staged(out_dir) as staging, (staging / PAYLOAD).open("wb") as payload:
        for name in sorted(target):
            new = _raw(target[name])
            old = base.get(name)
            itemsize = target[name].element_size()
            stats.full_bytes += new.numel()
            if old is not None and old.dtype == target[name].dtype and old.shape == target[name].shape:
                diff = _xor(_raw(old), new)
                changed = int(torch.count_nonzero(diff))
                encoding: Encoding = "xor" if changed else "same"
            else:
                diff, changed, encoding = new, new.numel(), "full"
            planes = _planes(diff, itemsize) if byte_planes else diff
            blob = compress(planes.numpy().data) if encoding != "same" else b""
            entries[name] = TensorEntry(
                dtype=_dtype_name(target[name].dtype),
                shape=tuple(target[name].shape),
                encoding=encoding,
                offset=payload.tell(),
                length=len(blob),
                sha256=_sha256(new),
            )
            payload.write(blob)
            stats.payload_bytes += len(blob)
            stats.changed_bytes += changed
            stats.tensors[encoding] += 1
        manifest = {
            "format": FORMAT,
            "base_version": base_version,
            "target_version": target_version,
            "compression": compression,
            "byte_planes": byte_planes,
            "tensors": {name: asdict(entry) for name, entry in entries.items()},
        }
        (staging / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
        if files_from is not None:
            _copy_small_files(Path(files_from), staging)
    stats.seconds = time.perf_counter() - started
    return stats


@dataclass(frozen=True, slots=True)
class WeightDelta:
    """A delta folder, read: its manifest, with the payloads left on disk until applied."""

    path: Path
    base_version: str
    target_version: str
    compression: str
    byte_planes: bool
    tensors: dict[str, TensorEntry]

    @classmethod
    def open(cls, path: Path) -> WeightDelta:
        """Read ``path/delta.json``.

        Raises:
            DeltaError: no delta folder there, or its manifest is not one this code writes.
        """
        path = Path(path)
        try:
            manifest = json.loads((path / MANIFEST).read_text())
            if manifest.get("format") != FORMAT:
                raise DeltaError(f"{path}: not a {FORMAT} delta (format {manifest.get('format')!r})")
            tensors = {
                name: TensorEntry(**{**entry, "shape": tuple(entry["shape"])})
                for name, entry in manifest["tensors"].items()
            }
            delta = cls(
                path,
                str(manifest["base_version"]),
                str(manifest["target_version"]),
                manifest["compression"],
                bool(manifest["byte_planes"]),
                tensors,
            )
        except FileNotFoundError as exc:
            raise DeltaError(f"{path}: no {MANIFEST} (not a weight delta folder)") from exc
        except (OSError, ValueError, KeyError, TypeError) as exc:
            if isinstance(exc, DeltaError):
                raise
            raise DeltaError(f"{path}/{MANIFEST} is unreadable: {exc}") from exc
        _decompressor(delta.compression)
        if any(e.encoding not in ("same", "xor", "full") for e in tensors.values()):
            raise DeltaError(f"{path}/{MANIFEST}: unknown tensor encoding")
        return delta

    @property
    def payload_bytes(self) -> int:
        return sum(entry.length for entry in self.tensors.values())

    def check_base(self, version: str) -> None:
        """Raises OutOfOrderDelta unless ``version`` is the version this delta was built against."""
        if version != self.base_version:
            raise OutOfOrderDelta(
                f"the delta {self.path} turns {self.base_version!r} into {self.target_version!r}, "
                f"but the weights it was applied to are {version!r}"
            )

    def apply(self, base: Callable[[str], torch.Tensor | None]) -> dict[str, torch.Tensor]:
        """The target's tensors that differ from the base, every tensor's checksum verified first.

        Args:
            base: name -> the base tensor (its bytes as the base checkpoint holds them), or None.

        Returns:
            name -> new CPU tensor, for the ``xor`` and ``full`` entries (``same`` ones are the base's).

        Raises:
            DeltaChecksumError: a rebuilt tensor's sha256 differs (a corrupt delta or another base).
            DeltaError: a base tensor is missing or of another shape than the delta expects, or a payload
                is corrupt.
        """
        decompress = _decompressor(self.compression)
        changed: dict[str, torch.Tensor] = {}
        with (self.path / PAYLOAD).open("rb") as payload:
            for name, entry in self.tensors.items():
                dtype, itemsize = entry.torch_dtype, entry.torch_dtype.itemsize
                old = None if entry.encoding == "full" else self._base_tensor(base, name, entry)
                if entry.encoding == "same":
                    data = _raw(old)  # type: ignore[arg-type]
                else:
                    payload.seek(entry.offset)
                    blob = payload.read(entry.length)
                    try:
                        data = _from_bytes(decompress(blob))
                        data = _unplanes(data, itemsize) if self.byte_planes else data
                    except (zlib.error, zstandard.ZstdError, RuntimeError) as exc:
                        raise DeltaError(f"{self.path}: the payload of {name} is corrupt: {exc}") from exc
                    expected = math.prod(entry.shape) * itemsize
                    if data.numel() != expected:
                        raise DeltaError(f"{self.path}: the payload of {name} has {data.numel()} bytes, not {expected}")
                    if old is not None:
                        data = _xor(data, _raw(old))
                if _sha256(data) != entry.sha256:
                    raise DeltaChecksumError(
                        f"{name}: base + delta does not match the delta's sha256 (a corrupt delta, or weights "
                        f"other than {self.base_version!r} as a {entry.dtype} checkpoint holds them)"
                    )
                if entry.encoding != "same":
                    changed[name] = data.view(dtype).reshape(entry.shape)
        return changed

    def _base_tensor(self, base: Callable[[str], torch.Tensor | None], name: str, entry: TensorEntry) -> torch.Tensor:
        old = base(name)
        if old is None:
            raise DeltaError(f"{name}: the delta changes it, but the base has no such tensor")
        if tuple(old.shape) != entry.shape:
            raise DeltaError(
                f"{name}: the delta expects a base tensor of shape {list(entry.shape)}, got {list(old.shape)}"
            )
        # A base served in a wider dtype (bf16 weights served in fp32) casts back exactly; a lossy
        # cast fails the checksum.
        return old.to(entry.torch_dtype)


def materialise(delta: WeightDelta, base_dir: Path, out_dir: Path) -> Path:
    """The full target checkpoint at ``out_dir``: base folder + delta, every tensor verified.

    An existing ``out_dir`` whose tensors all match the manifest's checksums is kept as it is (a
    retried rollout, or the learner's own export of the same weights); the folder appears whole or
    not at all.

    Raises:
        DeltaError: the base or an existing ``out_dir`` does not give the delta's checksums.
    """
    out_dir = Path(out_dir)
    if out_dir.exists():
        existing = read_checkpoint(out_dir)
        for name, entry in delta.tensors.items():
            if name not in existing or tensor_sha256(existing[name]) != entry.sha256:
                raise DeltaError(f"{out_dir} exists and its {name} is not the delta's target tensor")
        return out_dir
    base = read_checkpoint(Path(base_dir))
    changed = delta.apply(base.get)
    tensors = {name: changed.get(name, base.get(name)) for name in delta.tensors}
    with _staged(out_dir) as staging:
        save_file(tensors, staging / "model.safetensors", metadata={"format": "pt"})  # type: ignore[arg-type]
        _copy_small_files(delta.path, staging)
    return out_dir


def _copy_small_files(source: Path, dest: Path) -> None:
    """The checkpoint's files other than weights and delta parts (config, tokenizer)."""
    skip = {MANIFEST, PAYLOAD, _INDEX_FILE}
    for file in sorted(source.iterdir()):
        if file.is_file() and file.suffix != ".safetensors" and file.name not in skip:
            shutil.copy2(file, dest / file.name)


@contextmanager
def _staged(path: Path) -> Iterator[Path]:
    """Write into a hidden sibling folder, fsync it, rename it to ``path`` (whole or not at all)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = path.parent / f".{path.name}.partial-{uuid.uuid4().hex[:8]}"
    staging.mkdir()
    try:
        yield staging
        for file in staging.iterdir():
            with file.open("rb") as handle:
                os.fsync(handle.fileno())
        os.rename(staging, path)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
