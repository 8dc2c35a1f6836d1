"""Distributed weight sync: broadcast new weights from the trainer to an engine process on another device.

This process plays the trainer (rank 0, weights on ``--device``); a `tandem engine` process on
``--engine-device`` is the receiver. The group is SGLang's update_weights_from_distributed one
(``learner.weight_broadcast``), created once and kept across versions, as a trainer would. For each
new version, alternating:

- broadcast: one ``update_weights_from_distributed`` per bucket (``--bucket-mb``), rank 0
  broadcasting each bucket's tensors (NCCL between two GPUs, gloo on the CPU); the time runs from
  the first request to the engine's last answer, after it copied every bucket into its weights.
- disk: save the weights as safetensors, then ``update_weights_from_disk`` (read back from the page
  cache), as ``benchmarks.colocated_sync`` does.

Each one is checked bitwise afterwards (the engine's GET /weights_checksum). GB/s is the full
checkpoint's size over the transfer time. NVLink multicast (NVLS) stays off: NCCL_NVLS_ENABLE=0
here and in the engine. NCCL refuses two ranks on one GPU, so a one-GPU smoke test uses
``--backend gloo`` (the tensors stay on the GPU; gloo stages them through host memory).

    python -m benchmarks.weight_broadcast --device cuda:0 --engine-device cuda:1 --shape 1.5b
    python -m benchmarks.weight_broadcast --device cuda:0 --engine-device cuda:0 --backend gloo --shape 0.5b
    python -m benchmarks.weight_broadcast --device cpu --shape tiny

Prints one JSON line (also written to ``--out``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import torch

from benchmarks.colocated_sync import DTYPE, build_model, check_served, handoff_disk, new_version, sync
from benchmarks.common import console, start_engine
from benchmarks.random_model import SHAPES
from learner.weight_broadcast import BroadcastConfig, EngineTarget, WeightBroadcaster

os.environ["NCCL_NVLS_ENABLE"] = "0"  # before any NCCL communicator exists in this process


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    parser.add_argument("--device", default="cpu", help="the trainer's device: cpu, cuda:0, ...")
    parser.add_argument("--engine-device", help="the engine's device (default: cuda:1 when there are two GPUs)")
    parser.add_argument("--backend", choices=("nccl", "gloo"), help="default: nccl for cuda, gloo for cpu")
    parser.add_argument("--bucket-mb", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args()
    cuda = args.device.startswith("cuda")
    if args.engine_device is None:
        args.engine_device = ("cuda:1" if torch.cuda.device_count() > 1 else "cuda:0") if cuda else "cpu"
    args.backend = args.backend or ("nccl" if cuda else "gloo")
    if args.backend == "nccl" and torch.device(args.device) == torch.device(args.engine_device):
        parser.error("NCCL cannot put two ranks on one GPU: give another --engine-device, or --backend gloo")
    if args.backend == "nccl" and not (cuda and args.engine_device.startswith("cuda")):
        parser.error("--backend nccl needs --device and --engine-device on GPUs")
    return args


def broadcast(
    broadcaster: WeightBroadcaster, tensors: dict[str, torch.Tensor], version: str, device: str
) -> dict[str, Any]:
    sync(device)
    stats = broadcaster.send(list(tensors.items()), version)
    return {"s": stats.transfer_s, "gb_per_s": stats.gb_per_s, "buckets": stats.buckets}


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory(prefix="tandem-broadcast-") as tmp:
        work = Path(tmp)
        model = work / "model"
        tensors = build_model(args.shape, args.device, model)
        size = sum(t.numel() * t.element_size() for t in tensors.values())
        console.print(f"{args.shape}: {len(tensors)} tensors, {size / 1e9:.2f} GB ({DTYPE}), {args.backend}")
        engine, url = start_engine(model, work / "engine", args.engine_device, DTYPE, args.threads)
        config = BroadcastConfig(backend=args.backend, bucket_bytes=args.bucket_mb << 20, timeout_s=600)
        sends: list[dict[str, Any]] = []
        save: list[float] = []
        load: list[float] = []
        try:
            with httpx.Client(timeout=600) as http:
                broadcaster = WeightBroadcaster([EngineTarget(url)], config)
                started = time.perf_counter()
                broadcaster.connect()
                connect_s = time.perf_counter() - started
                try:
                    for step in range(args.repeats):
                        new_version(tensors, 2 * step)
                        sends.append(broadcast(broadcaster, tensors, f"broadcast-{step}", args.device))
                        check_served(http, url, tensors, f"broadcast-{step}")
                        new_version(tensors, 2 * step + 1)
                        version = f"disk-{step}"
                        saved, loaded = handoff_disk(http, url, tensors, version, args.device, model, work / "ckpt")
                        save.append(saved)
                        load.append(loaded)
                        check_served(http, url, tensors, version)
                        shutil.rmtree(work / "ckpt" / version)
                        console.print(
                            f"step {step}: broadcast {sends[-1]['s']:.3f} s, disk {saved:.3f} + {loaded:.3f} s"
                        )
                finally:
                    broadcaster.close()
        finally:
            engine.terminate()
            engine.wait(timeout=60)

    broadcast_s = statistics.median(s["s"] for s in sends)
    disk_s = statistics.median(s + lo for s, lo in zip(save, load, strict=True))
    names = {
        d: torch.cuda.get_device_name(d) if d.startswith("cuda") else "cpu" for d in (args.device, args.engine_device)
    }
    result = {
        "benchmark": "weight_broadcast",
        "shape": args.shape,
        "backend": args.backend,
        "device": f"{args.device} ({names[args.device]})",
        "engine_device": f"{args.engine_device} ({names[args.engine_device]})",
        "nccl_nvls_enable": os.environ["NCCL_NVLS_ENABLE"],
        "dtype": str(DTYPE).removeprefix("torch."),
        "checkpoint_bytes": size,
        "tensors": len(tensors),
        "bucket_mb": args.bucket_mb,
        "buckets": sends[0]["buckets"],
        "connect_s": round(connect_s, 4),
        "broadcast_s": [round(s["s"], 4) for s in sends],
        "broadcast_median_s": round(broadcast_s, 4),
        "broadcast_gb_per_s": round(size / 1e9 / broadcast_s, 3),
        "disk_save_s": [round(s, 4) for s in save],
        "disk_load_s": [round(s, 4) for s in load],
        "disk_median_s": round(disk_s, 4),
        "disk_gb_per_s": round(size / 1e9 / disk_s, 3),
        "disk_over_broadcast": round(disk_s / broadcast_s, 2),
        "bitwise_checked": True,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    name = f"weight_broadcast_{args.shape}_{args.backend}_{args.device.replace(':', '')}.json"
    (args.out / name).write_text(json.dumps(result, indent=1))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
