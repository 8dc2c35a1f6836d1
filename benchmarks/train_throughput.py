"""Training throughput of the torch and megatron backends on the same model shape and batch.

Builds a random Qwen2 of the chosen shape (Qwen2.5-0.5B or -1.5B, or the tiny test shape), saves it
as a HF checkpoint, and runs each backend's real ``train_step`` (GRPO policy loss, AdamW/Adam, packed
micro-batches of ``--micro-batch-tokens``) on ``--batch`` samples of ``--seq`` tokens. Reports seconds
per step, tokens per second and MFU, ``6 x params x tokens / time`` over ``--peak-tflops`` (790: a
bf16 dense matmul measured on one H200), for each backend and megatron over torch, then one JSON line.

On CUDA the megatron backend runs its SDPA layer spec (fused attention) and none of the CPU patches;
with ``--dtype bf16`` torch trains bf16 weights with plain AdamW, megatron bf16 weights with fp32
master weights (its mixed-precision optimizer). A backend that fails is reported with its error and
the other still runs.

    python -m benchmarks.train_throughput --shape 0.5b --batch 8 --seq 1024 --steps 5 --dtype bf16 --device cuda
    python -m benchmarks.train_throughput --shape tiny --batch 4 --seq 64 --steps 2 --dtype float32 --device cpu
"""

from __future__ import annotations

import argparse
import gc
import json
import tempfile
import time
import traceback
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM

from benchmarks.random_model import SHAPES, random_qwen2
from learner.sample import Sample
from learner.trainers import TrainConfig

DTYPES = {"bf16": torch.bfloat16, "float32": torch.float32}


def build_checkpoint(shape: str, dtype: torch.dtype, folder: Path, device: str = "cpu") -> int:
    """A random Qwen2 of ``shape`` saved in ``folder`` (initialised on ``device``: a 7B shape takes
    minutes on the host); its parameter count."""
    model = random_qwen2(shape, folder, dtype=dtype, device=device)
    params = sum(p.numel() for p in model.parameters())
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    return params


def make_samples(batch: int, seq: int, vocab: int) -> list[Sample]:
    """``batch`` samples of ``seq`` tokens (a quarter prompt), two groups with rewards 0 and 1."""
    generator = torch.Generator().manual_seed(1)
    prompt = seq // 4
    return [
        Sample(
            prompt_token_ids=torch.randint(0, vocab, (prompt,), generator=generator).tolist(),
            response_token_ids=torch.randint(0, vocab, (seq - prompt,), generator=generator).tolist(),
            group_index=i % 2,
            index=i,
            reward=float((i // 2) % 2),
        )
        for i in range(batch)
    ]


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def timed_steps(step: Callable[[], dict[str, float]], warmup: int, steps: int, device: str) -> dict[str, float]:
    for _ in range(warmup):
        step()
    _sync(device)
    if PROFILE:
        _profile(step, device)
    started = time.perf_counter()
    metrics: dict[str, float] = {}
    for _ in range(steps):
        metrics = step()
    _sync(device)
    return {"s_per_step": (time.perf_counter() - started) / steps, "loss": metrics["loss"]}


PROFILE = False  # --profile: print where one step's time goes (torch.profiler) before timing
TRACE: str | None = None  # --trace: save two steps' timeline instead (Chrome trace; .gz compresses)


def _profile(step: Callable[[], dict[str, float]], device: str) -> None:
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    # Python stacks name the call sites but slow the host several-fold: a saved timeline goes without
    with torch.profiler.profile(activities=activities, with_stack=not TRACE) as profiler:
        for _ in range(2 if TRACE else 1):  # two steps: the timeline shows what lies between them too
            step()
        _sync(device)
    if TRACE:
        profiler.export_chrome_trace(TRACE)
    averages = profiler.key_averages()
    for key in ("self_cpu_time_total", "self_device_time_total" if device == "cuda" else None):
        if key:
            print(averages.table(sort_by=key, row_limit=25, max_name_column_width=60))
    # where the host waits for the device: each item() / tolist() / float() of a device tensor
    reads = Counter(_call_site(event) for event in profiler.events() if event.name == "aten::_local_scalar_dense")
    print(f"{sum(reads.values())} device-to-host scalar reads:")
    for site, count in reads.most_common(15):
        print(f"  {count:4d}  {site}")


def _call_site(event: Any) -> str:
    """The innermost frame of tandem's or megatron's code that led to ``event`` (the profiler records
    Python frames as parent events)."""
    while event is not None and (
        not any(root in event.name for root in ("learner/", "megatron/")) or "cpu_compat" in event.name
    ):
        event = event.cpu_parent
    return "?" if event is None else event.name


def torch_backend(
    folder: Path, samples: list[Sample], config: TrainConfig, args: argparse.Namespace
) -> dict[str, float]:
    from learner.trainers import train_step

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=DTYPES[args.dtype], attn_implementation="sdpa")
    model = model.to(args.device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6, fused=args.device == "cuda")
    return timed_steps(lambda: train_step(model, optimizer, samples, config), args.warmup, args.steps, args.device)


def megatron_backend(
    folder: Path, samples: list[Sample], config: TrainConfig, args: argparse.Namespace
) -> dict[str, float]:
    from learner.megatron.backend import MegatronPolicy, OptimizerSettings
    from learner.megatron.runtime import parallel
    from learner.megatron_config import MegatronConfig

    layout = MegatronConfig(**{"bf16": args.dtype == "bf16", **json.loads(args.megatron)})
    with parallel(layout):
        policy = MegatronPolicy(folder, layout, optimizer=OptimizerSettings(learning_rate=1e-6))
        return timed_steps(lambda: policy.train_step(samples, config), args.warmup, args.steps, args.device)


BACKENDS = {"torch": torch_backend, "megatron": megatron_backend}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="0.5b")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument(
        "--micro-batch-tokens", type=int, default=0, help="token cap per micro-batch; 0: the whole batch in one"
    )
    parser.add_argument("--peak-tflops", type=float, default=790.0)
    parser.add_argument("--backends", default="torch,megatron")
    parser.add_argument(
        "--megatron",
        default="{}",
        help='MegatronConfig fields as JSON, e.g. \'{"distributed_optimizer": true, "optimizer_cpu_offload": true}\'',
    )
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads; 0: torch's default")
    parser.add_argument("--profile", action="store_true", help="print a torch.profiler table of one step first")
    parser.add_argument("--trace", help="with --profile: save two steps as a Chrome trace here (no Python stacks)")
    args = parser.parse_args()
    global PROFILE, TRACE
    PROFILE, TRACE = args.profile, args.trace
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda but torch sees no GPU")
    if args.threads:
        torch.set_num_threads(args.threads)

    tokens_per_step = args.batch * args.seq
    config = TrainConfig(max_tokens_per_micro_batch=args.micro_batch_tokens or tokens_per_step)
    samples = make_samples(args.batch, args.seq, SHAPES[args.shape]["vocab_size"])
    report: dict[str, Any] = {k: getattr(args, k) for k in ("shape", "batch", "seq", "steps", "dtype", "device")}
    report["micro_batch_tokens"] = config.max_tokens_per_micro_batch
    with tempfile.TemporaryDirectory(prefix="tandem-throughput-") as scratch:
        folder = Path(scratch)
        report["params"] = params = build_checkpoint(args.shape, DTYPES[args.dtype], folder, args.device)
        print(f"{args.shape}: {params / 1e6:.1f} M params, {args.batch} x {args.seq} tokens per step, {args.dtype}")
        for name in args.backends.split(","):
            if args.device == "cuda":
                torch.cuda.reset_peak_memory_stats()
            try:
                result = BACKENDS[name](folder, samples, config, args)
            except Exception as exc:  # a benchmark run reports a failing backend and goes on
                report[name] = {"error": f"{type(exc).__name__}: {exc}"}
                traceback.print_exc()
                continue
            finally:
                gc.collect()
                if args.device == "cuda":
                    torch.cuda.empty_cache()
            if args.device == "cuda":
                result["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
            tokens_per_s = tokens_per_step / result["s_per_step"]
            result |= {"tokens_per_s": tokens_per_s, "mfu": 6 * params * tokens_per_s / (args.peak_tflops * 1e12)}
            report[name] = result
            print(
                f"{name:>9}: {result['s_per_step']:.3f} s/step, {tokens_per_s:,.0f} tokens/s, "
                f"MFU {result['mfu']:.1%}, loss {result['loss']:.4f}"
                + (f", peak {result['peak_gib']:.1f} GiB" if "peak_gib" in result else "")
            )
    both = [report.get(n, {}).get("tokens_per_s") for n in ("megatron", "torch")]
    if all(both):
        report["megatron_over_torch"] = both[0] / both[1]
        print(f"megatron / torch: {report['megatron_over_torch']:.2f}x")
    print(json.dumps(report))


if __name__ == "__main__":
    main()
