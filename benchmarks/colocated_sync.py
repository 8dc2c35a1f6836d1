"""Colocated weight sync: hand new weights to an engine process on the same device, IPC vs disk.

This process plays the trainer: it holds the model's weights on ``--device`` and, for each new
version, hands them to a `tandem engine` process on the same device two ways, alternating:

- IPC: SGLang's update_weights_from_tensor idea (``server.engines.tensor_ipc``): CUDA IPC handles
  (or named shared-memory CPU tensors) in a small HTTP body; the engine maps them and copies them
  into its parameters on the device, then answers.
- disk: save the weights as safetensors (device -> host, write), then update_weights_from_disk
  (read, host -> device). Freshly written files are read back from the page cache.

Each handoff is checked bitwise afterwards (the engine's GET /weights_checksum against this process's
tensors). The model is random, built from a config of the named shape; no hub download. The
tokenizer is the tiny test model's (the engine needs one to start; nothing is generated).

    python -m benchmarks.colocated_sync --device cuda --shape qwen2.5-0.5b --repeats 5
    python -m benchmarks.colocated_sync --device cuda --shape qwen2.5-1.5b --repeats 5
    python -m benchmarks.colocated_sync --device cpu --shape tiny --repeats 3
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import torch
from safetensors.torch import save_file

from benchmarks.common import console, start_engine
from benchmarks.random_model import random_qwen2
from server.engines.tensor_ipc import serialize_named_tensors
from server.weight_delta import tensor_sha256
from tests.fixtures.tiny_model import tiny_model_path

SHAPES = {"tiny": "tiny", "qwen2.5-0.5b": "0.5b", "qwen2.5-1.5b": "1.5b"}  # --shape: benchmarks.random_model's
DTYPE = torch.bfloat16


def build_model(shape: str, device: str, folder: Path) -> dict[str, torch.Tensor]:
    """Write a random model of ``shape`` (``benchmarks.random_model``) to ``folder`` (config, weights,
    tiny tokenizer); its weights on ``device``."""
    model = random_qwen2(shape, folder, dtype=DTYPE, device=device, max_positions=4096)
    tokenizer = tiny_model_path()
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (tokenizer / name).is_file():
            shutil.copy2(tokenizer / name, folder / name)
    # named_parameters leaves out a tied lm_head: it is the embedding, sent once.
    return {name: param.detach() for name, param in model.named_parameters()}


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def new_version(tensors: dict[str, torch.Tensor], step: int) -> None:
    """An optimizer step's worth of change, in place (every element moves a little)."""
    generator = torch.Generator(device=next(iter(tensors.values())).device).manual_seed(step)
    with torch.no_grad():
        for tensor in tensors.values():
            tensor.add_(
                torch.randn(tensor.shape, generator=generator, device=tensor.device, dtype=tensor.dtype), alpha=1e-3
            )


def check_served(http: httpx.Client, url: str, tensors: dict[str, torch.Tensor], version: str) -> None:
    served = http.get(f"{url}/weights_checksum").json()
    if served["weight_version"] != version:
        raise RuntimeError(f"the engine serves {served['weight_version']}, not {version}")
    wrong = [name for name, t in tensors.items() if served["tensors"][name]["sha256"] != tensor_sha256(t)]
    if wrong:
        raise RuntimeError(f"the engine's weights differ from the trainer's: {wrong[:3]}")


def post(http: httpx.Client, url: str, path: str, body: dict[str, Any]) -> None:
    response = http.post(f"{url}{path}", json=body)
    if response.status_code != 200:
        raise RuntimeError(f"{path}: {response.status_code} {response.text[:500]}")


def handoff_ipc(http: httpx.Client, url: str, tensors: dict[str, torch.Tensor], version: str, device: str) -> float:
    sync(device)
    started = time.perf_counter()
    payload = serialize_named_tensors(list(tensors.items()))
    post(http, url, "/update_weights_from_tensor", {"serialized_named_tensors": [payload], "weight_version": version})
    seconds = time.perf_counter() - started  # the engine synchronised before answering
    if device.startswith("cuda"):
        torch.cuda.ipc_collect()  # release this side of the handles the engine has let go of
    return seconds


def handoff_disk(
    http: httpx.Client, url: str, tensors: dict[str, torch.Tensor], version: str, device: str, model: Path, out: Path
) -> tuple[float, float]:
    """Seconds to save the checkpoint, and to load it into the engine."""
    folder = out / version
    shutil.copytree(model, folder, ignore=shutil.ignore_patterns("*.safetensors"))
    sync(device)
    started = time.perf_counter()
    save_file(
        {name: t.to("cpu") for name, t in tensors.items()}, folder / "model.safetensors", metadata={"format": "pt"}
    )
    saved = time.perf_counter()
    post(http, url, "/update_weights_from_disk", {"model_path": str(folder), "weight_version": version})
    return saved - started, time.perf_counter() - saved


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", help="cpu or cuda (the engine process uses the same one)")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    with tempfile.TemporaryDirectory(prefix="tandem-colocated-") as tmp:
        work = Path(tmp)
        model = work / "model"
        tensors = build_model(SHAPES[args.shape], args.device, model)
        size = sum(t.numel() * t.element_size() for t in tensors.values())
        console.print(f"{args.shape}: {len(tensors)} tensors, {size / 1e9:.2f} GB ({DTYPE}) on {args.device}")
        engine, url = start_engine(model, work / "engine", args.device, DTYPE, args.threads)
        ipc, save, load = [], [], []
        try:
            with httpx.Client(timeout=600) as http:
                for step in range(args.repeats):
                    new_version(tensors, 2 * step)
                    ipc.append(handoff_ipc(http, url, tensors, f"ipc-{step}", args.device))
                    check_served(http, url, tensors, f"ipc-{step}")
                    new_version(tensors, 2 * step + 1)
                    saved, loaded = handoff_disk(http, url, tensors, f"disk-{step}", args.device, model, work / "ckpt")
                    save.append(saved)
                    load.append(loaded)
                    check_served(http, url, tensors, f"disk-{step}")
                    shutil.rmtree(work / "ckpt" / f"disk-{step}")
                    console.print(f"step {step}: ipc {ipc[-1]:.3f} s, disk {saved:.3f} + {loaded:.3f} s")
        finally:
            engine.terminate()
            engine.wait(timeout=60)

    ipc_s, disk_s = statistics.median(ipc), statistics.median(s + lo for s, lo in zip(save, load, strict=True))
    gpu = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    result = {
        "args": vars(args) | {"out": str(args.out)},
        "device_name": gpu,
        "bytes": size,
        "tensors": len(tensors),
        "ipc_s": ipc,
        "disk_save_s": save,
        "disk_load_s": load,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"colocated_sync_{args.shape}_{args.device}.json").write_text(json.dumps(result, indent=1))
    print("| shape | device | GB | IPC s (median) | IPC GB/s | disk save + load s | disk GB/s | disk / IPC |")
    print("|---|---|---|---|---|---|---|---|")
    print(
        f"| {args.shape} | {gpu} | {size / 1e9:.2f} | {ipc_s:.3f} | {size / 1e9 / ipc_s:.1f} | "
        f"{statistics.median(save):.2f} + {statistics.median(load):.2f} | {size / 1e9 / disk_s:.2f} | {disk_s / ipc_s:.1f}x |"
    )


if __name__ == "__main__":
    main()
