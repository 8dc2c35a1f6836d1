"""How much does a byte-level weight delta ship after a real learning round, and what does it cost?

Starts `tandem serve` (SQLite, local engine), lets simulated users chat and rate through the public
API and runs real rounds (``learner.round.run_round``: train in a child, export, roll out). For each
round, between the checkpoint it started from and the one it exported:

- the full checkpoint's bytes, the bytes that differ (the floor of any byte-range encoding) and the
  bytes of changed 64 B / 4 KiB chunks (what shipping changed ranges at that granularity costs);
- the delta payload of ``server.weight_delta`` in several encodings (XOR, with or without byte
  planes, zstd or zlib), each with the time to build it;
- applying it to a local engine serving the base (in this process) against loading the whole
  checkpoint from disk into the same engine, both checked bitwise against the export;
- after the last round, the server rolled back to its base by disk and forward by the delta
  (``POST /admin/weights`` source delta), against the round's own disk swap.

    python -m benchmarks.weight_delta --model tiny --rounds 2 --ratings 16 --lr 1e-2
    python -m benchmarks.weight_delta --model smollm2-135m-instruct --rounds 2 --ratings 16 --lr 3e-5
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from openai import OpenAI

from benchmarks.common import console, serve
from benchmarks.simulated_users import BrevityPreference, Population
from learner.round import run_round
from learner.server_api import ServerApi
from server.engines.local.engine import LocalEngine
from server.weight_delta import WeightDelta, read_checkpoint, tensor_sha256, write_delta

ADMIN_KEY = "weight-delta-admin"
# (label, compression, level, byte planes); the first is what the server writes by default.
ENCODINGS = [
    ("xor+planes+zstd-1", "zstd", 1, True),
    ("xor+planes+zstd-3", "zstd", 3, True),
    ("xor+zstd-3", "zstd", 3, False),
    ("xor+planes+zlib-1", "zlib", 1, True),
    ("xor+zlib-1", "zlib", 1, False),
]


def element_bytes(tensor: torch.Tensor) -> np.ndarray:
    """One row of raw bytes per element."""
    return tensor.contiguous().view(torch.uint8).numpy().reshape(-1, tensor.element_size())


def changed_elements(base: dict[str, torch.Tensor], target: dict[str, torch.Tensor]) -> float:
    changed = sum(int((element_bytes(base[n]) != element_bytes(t)).any(axis=1).sum()) for n, t in target.items())
    return changed / sum(t.numel() for t in target.values())


def changed_chunk_bytes(base: dict[str, torch.Tensor], target: dict[str, torch.Tensor], chunk: int) -> int:
    """Bytes of the ``chunk``-sized pieces of each tensor that hold at least one changed byte."""
    total = 0
    for name, new in target.items():
        old = base.get(name)
        raw_new = new.contiguous().reshape(-1).view(torch.uint8).numpy()
        if old is None or old.shape != new.shape or old.dtype != new.dtype:
            total += raw_new.size
            continue
        diff = np.bitwise_xor(old.contiguous().reshape(-1).view(torch.uint8).numpy(), raw_new)
        changed = np.pad(diff, (0, -diff.size % chunk)).reshape(-1, chunk).any(axis=1)
        sizes = np.minimum(chunk, diff.size - np.arange(changed.size) * chunk)  # the last chunk may be short
        total += int(sizes[changed].sum())
    return total


def measure_round(base_dir: Path, target_dir: Path, base_version: str, version: str, work: Path) -> dict[str, Any]:
    base, target = read_checkpoint(base_dir), read_checkpoint(target_dir)
    full = sum(t.numel() * t.element_size() for t in target.values())
    result: dict[str, Any] = {
        "full_bytes": full,
        "checkpoint_file_bytes": sum(f.stat().st_size for f in target_dir.glob("*.safetensors")),
        "dtype": str(next(iter(target.values())).dtype).removeprefix("torch."),
        "elements_changed": changed_elements(base, target),
        "ranges_64B": changed_chunk_bytes(base, target, 64) / full,
        "ranges_4KiB": changed_chunk_bytes(base, target, 4096) / full,
        "encodings": {},
    }
    for label, compression, level, planes in ENCODINGS:
        out = work / f"{version}-{label}"
        stats = write_delta(
            base,
            target,
            out,
            base_version=base_version,
            target_version=version,
            files_from=target_dir,
            compression=compression,  # type: ignore[arg-type]
            level=level,
            byte_planes=planes,
        )
        result["changed_bytes"] = stats.changed_bytes / full
        result["encodings"][label] = {
            "ratio": stats.ratio,
            "build_s": stats.seconds,
            "payload_bytes": stats.payload_bytes,
        }
    delta = WeightDelta.open(work / f"{version}-{ENCODINGS[0][0]}")
    return result | asyncio.run(apply_vs_disk(base_dir, target_dir, delta, target))


async def apply_vs_disk(
    base_dir: Path, target_dir: Path, delta: WeightDelta, target: dict[str, torch.Tensor]
) -> dict[str, Any]:
    """Seconds to apply the delta to an engine serving the base, and to load the target from disk."""
    engine = await LocalEngine.open(base_dir, weight_version=delta.base_version, prefix_cache_bytes=0)
    try:
        dtypes = {name: getattr(torch, entry["dtype"]) for name, entry in (await engine.weights_checksums()).items()}
        want = {name: tensor_sha256(t.to(dtypes[name])) for name, t in target.items()}  # as the engine serves it

        async def served() -> dict[str, str]:
            sums = await engine.weights_checksums()
            return {name: sums[name]["sha256"] for name in want}

        started = time.perf_counter()
        await engine.update_weights_from_delta(delta, str(target_dir), delta.target_version)
        apply_s = time.perf_counter() - started
        if await served() != want:
            raise RuntimeError("the engine's weights differ from the export after the delta")
        await engine.update_weights(str(base_dir), delta.base_version)
        started = time.perf_counter()
        await engine.update_weights(str(target_dir), delta.target_version)
        disk_s = time.perf_counter() - started
        if await served() != want:
            raise RuntimeError("the engine's weights differ from the export after the disk load")
    finally:
        await engine.close()
    return {"apply_s": apply_s, "disk_load_s": disk_s, "bitwise_equal": True}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny", help="'tiny', a builtin name, or an HF folder")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--ratings", type=int, default=16, help="rated chats per round")
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    with tempfile.TemporaryDirectory(prefix="tandem-delta-") as tmp:
        workdir = Path(tmp)
        server = serve(args.model, workdir, ADMIN_KEY, args.threads)
        try:
            api = ServerApi(server.url, ADMIN_KEY, 600)
            client = OpenAI(base_url=f"{server.url}/v1", api_key=server.api_key, timeout=600)
            model = client.models.list().data[0].id
            population = Population.make(BrevityPreference(), size=8, seed=0)
            config = server.round_config(args.lr)  # every round rolls out: its delta is what is measured
            rounds, version, checkpoint = [], "", ""
            for index in range(args.rounds):
                serving = api.serving()
                base_dir = Path(serving["version"]["checkpoint_path"] if serving["version"] else serving["model_path"])
                population.chat_and_rate(client, model, args.ratings, seed=index, max_tokens=args.max_tokens)
                result = run_round(config)
                if result.status != "succeeded" or result.checkpoint_path is None or result.version_id is None:
                    raise RuntimeError(f"round {index}: {result.status} {result.error}")
                version, checkpoint = result.version_id, result.checkpoint_path
                measured = measure_round(
                    base_dir, Path(checkpoint), serving["weight_version"], version, workdir / "deltas"
                )
                measured |= {"round": index + 1, "round_disk_swap_s": result.seconds["swap"]}
                rounds.append(measured)
                console.print(f"round {index + 1}: delta {measured['encodings'][ENCODINGS[0][0]]['ratio']:.3f} of full")
            # The server itself, once: back to the last round's base from disk, forward again by the delta.
            last = rounds[-1]
            api.roll_out(str(base_dir), serving["weight_version"])
            delta_dir = workdir / "deltas" / f"{version}-{ENCODINGS[0][0]}"
            started = time.perf_counter()
            api.roll_out_delta(str(delta_dir), version, model_path=checkpoint)
            last["server_delta_rollout_s"] = time.perf_counter() - started
            if api.serving()["weight_version"] != version:
                raise RuntimeError("the server does not serve the delta's version")
        finally:
            server.stop()

    args.out.mkdir(parents=True, exist_ok=True)
    stem = f"weight_delta_{Path(args.model).name}"
    (args.out / f"{stem}.json").write_text(
        json.dumps({"args": vars(args) | {"out": str(args.out)}, "rounds": rounds}, indent=1)
    )
    report(args.model, rounds)


def report(model: str, rounds: list[dict[str, Any]]) -> None:
    labels = [label for label, *_ in ENCODINGS]
    print(f"\n{model}: payload / full checkpoint (build s)\n")
    print(
        "| round | dtype | full MB | elements changed | bytes changed | 64 B ranges | 4 KiB ranges | "
        + " | ".join(labels)
        + " |"
    )
    print("|---|---|---|---|---|---|---|" + "---|" * len(labels))
    for r in rounds:
        cells = [f"{r['encodings'][label]['ratio']:.3f} ({r['encodings'][label]['build_s']:.2f})" for label in labels]
        print(
            f"| {r['round']} | {r['dtype']} | {r['full_bytes'] / 1e6:.1f} | {r['elements_changed']:.3f} | "
            f"{r['changed_bytes']:.3f} | {r['ranges_64B']:.3f} | {r['ranges_4KiB']:.3f} | " + " | ".join(cells) + " |"
        )
    print(
        "\n| round | apply delta s | load from disk s | apply / disk | round's disk swap s | server delta rollout s |"
    )
    print("|---|---|---|---|---|---|")
    for r in rounds:
        server = f"{r['server_delta_rollout_s']:.2f}" if "server_delta_rollout_s" in r else "-"
        print(
            f"| {r['round']} | {r['apply_s']:.2f} | {r['disk_load_s']:.2f} | {r['apply_s'] / r['disk_load_s']:.2f} | "
            f"{r['round_disk_swap_s']:.2f} | {server} |"
        )


if __name__ == "__main__":
    main()
