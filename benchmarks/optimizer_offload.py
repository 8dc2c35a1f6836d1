"""The torch backend's optimizer CPU offload on a GPU: AdamW on the device against AdamW with its
state on the host (learner/trainers/host_optimizer.py), on Qwen2.5-shaped models of growing size,
in the same run.

    python benchmarks/optimizer_offload.py [--sizes 1.5B 3B 7B] [--tokens 2048] [--steps 3]

Random weights in float32 (as the torch backend trains), one sequence of ``--tokens`` per step,
activation checkpointing on. Reports per size and optimizer: fits or out of memory, peak device
memory, seconds per step (forward, backward, step) and the host step's share. Needs only torch and
transformers (the GPU machine has nothing else): it loads the optimizer module from its file.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, Qwen2Config

SHAPES = {  # Qwen2.5's published shapes: hidden, layers, heads, kv heads, intermediate
    "0.5B": (896, 24, 14, 2, 4864),
    "1.5B": (1536, 28, 12, 2, 8960),
    "3B": (2048, 36, 16, 2, 11008),
    "7B": (3584, 28, 28, 4, 18944),
    "14B": (5120, 48, 40, 8, 13824),
}


def host_adamw() -> type:
    path = Path(__file__).resolve().parents[1] / "learner" / "trainers" / "host_optimizer.py"
    spec = importlib.util.spec_from_file_location("host_optimizer", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.HostAdamW  # type: ignore[no-any-return]


def run(size: str, offload: bool, tokens: int, steps: int) -> str:
    hidden, layers, heads, kv_heads, intermediate = SHAPES[size]
    config = Qwen2Config(
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        intermediate_size=intermediate,
        vocab_size=151936,
        tie_word_embeddings=size in ("0.5B", "1.5B", "3B"),
    )
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    try:
        with torch.device("cuda"):
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa")
        model.gradient_checkpointing_enable()
        model.train()
        params = sum(p.numel() for p in model.parameters())
        groups = [{"params": list(model.parameters())}]
        optimizer = host_adamw()(groups, lr=1e-6, weight_decay=0.0) if offload else torch.optim.AdamW(groups, lr=1e-6)
        ids = torch.randint(0, config.vocab_size, (1, tokens), device="cuda")
        times, step_times = [], []
        for _ in range(steps):
            torch.cuda.synchronize()
            began = time.perf_counter()
            model(ids, labels=ids).loss.backward()
            torch.cuda.synchronize()
            stepping = time.perf_counter()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - began)
            step_times.append(time.perf_counter() - stepping)
        seconds, step_s = min(times[1:] or times), min(step_times[1:] or step_times)
        peak = torch.cuda.max_memory_allocated() / 2**30
        result = f"| {size} ({params / 1e9:.2f} B) | {'host' if offload else 'device'} | fits | {peak:.1f} | {seconds:.2f} | {step_s:.2f} |"
    except torch.OutOfMemoryError:
        result = f"| {size} | {'host' if offload else 'device'} | out of memory | - | - | - |"
    finally:
        model = optimizer = None  # free before the next size
        gc.collect()
        torch.cuda.empty_cache()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", nargs="+", default=["1.5B", "3B", "7B"], choices=list(SHAPES))
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, {args.tokens} tokens per step, float32")
    print("| model | AdamW state | | peak GiB | s/step | of which optimizer s |")
    print("|---|---|---|---|---|---|")
    for size in args.sizes:
        for offload in (False, True):
            print(run(size, offload, args.tokens, args.steps), flush=True)


if __name__ == "__main__":
    main()
