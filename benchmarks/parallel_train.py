"""The megatron backend's training step under parallel layouts, against one device on the same batch.

Builds a random Qwen2 of the chosen shape (``benchmarks.random_model``'s shapes), then runs each
layout in ``--layouts`` as its own world of ranks, one process per device, started the way the
training child starts them (``learner.child_process``: NCCL on GPUs, gloo on the CPU; the ranks run
``benchmarks.parallel_rank``). Each layout
loads the same checkpoint, scores the batch (every response token's log-prob) and takes
``--warmup`` + ``--steps`` optimizer steps on it. Reported per layout: the first step's loss and
gradient norm, the batch's mean response NLL (the language-model loss: the first step's policy
loss is the same for any weights, its ratios being 1), s/step, tokens/s (whole layout) and MFU over
its devices; for every layout but ``one``, how far its log-probs, NLL and gradient norm are from
``one``'s, and ``matches_one``: NLL and gradient norm within ``--rtol`` (bf16: 2e-2, a few bf16
roundings; float32: 1e-4).

Layout names: ``one``, or sizes joined, e.g. ``tp2``, ``pp2``, ``dp2``, ``tp2pp2`` (devices = the
product). One JSON line at the end. Imports only torch, transformers, megatron-core and learner
modules that need no database or server packages.

    python -m benchmarks.parallel_train --shape 1.5b --batch 8 --seq 1024 --dtype bf16 --layouts one,tp2,pp2
    python -m benchmarks.parallel_train --shape tiny --batch 4 --seq 64 --dtype float32 --steps 2 --threads 1
"""

from __future__ import annotations

import argparse
import json
import re
import tempfile
from pathlib import Path
from typing import Any

import torch

from benchmarks.random_model import SHAPES
from benchmarks.train_throughput import DTYPES, build_checkpoint
from learner.child_process import run_child
from learner.megatron_config import MegatronConfig

_LAYOUT = re.compile(r"^(?:(tp|pp|dp)(\d+))+$")
_SIZE = re.compile(r"(tp|pp|dp)(\d+)")


def layout(name: str, bf16: bool) -> MegatronConfig:
    """``one``, or ``tp``/``pp``/``dp`` sizes joined (``tp2pp2``) as a megatron config over their product.

    Raises:
        ValueError: a name that is neither.
    """
    if name == "one":
        return MegatronConfig(bf16=bf16)
    if not _LAYOUT.match(name):
        raise ValueError(f"layout {name!r}: 'one' or sizes like tp2, pp2, dp2, tp2pp2")
    sizes = {"tp": 1, "pp": 1, "dp": 1} | {kind: int(n) for kind, n in _SIZE.findall(name)}
    return MegatronConfig(
        tensor_parallel=sizes["tp"],
        pipeline_parallel=sizes["pp"],
        devices=sizes["tp"] * sizes["pp"] * sizes["dp"],
        bf16=bf16,
    )


def compare(result: dict[str, Any], reference: dict[str, Any], rtol: float) -> dict[str, Any]:
    """How far a layout's scores are from the one-device run's, and whether that is within ``rtol``."""
    mine, theirs = torch.tensor(result["log_probs"]), torch.tensor(reference["log_probs"])
    diffs = {
        "log_prob_max_abs_diff": float((mine - theirs).abs().max()),
        "nll_rel_diff": abs(result["nll"] - reference["nll"]) / abs(reference["nll"]),
        "grad_norm_rel_diff": abs(result["grad_norm"] - reference["grad_norm"]) / reference["grad_norm"],
    }
    return diffs | {"matches_one": diffs["nll_rel_diff"] <= rtol and diffs["grad_norm_rel_diff"] <= rtol}


def run_layout(config: MegatronConfig, folder: Path, args: argparse.Namespace, device: str) -> dict[str, Any]:
    """One layout's results (``parallel_rank``'s, plus tokens/s and MFU), or its error."""
    if device == "cuda" and config.devices > torch.cuda.device_count():
        return {"error": f"needs {config.devices} GPUs, {torch.cuda.device_count()} seen"}
    request = {"folder": str(folder), "layout": config.to_dict(), "device": device} | vars(args)
    run = run_child(
        "benchmarks.parallel_rank",
        json.dumps(request),
        timeout_s=args.timeout,
        what="benchmark",
        processes=config.devices,
    )
    result = run.outcome or {"error": run.error}
    if "error" not in result:
        tokens_per_s = args.batch * args.seq / result["s_per_step"]
        mfu = 6 * args.params * tokens_per_s / (args.peak_tflops * 1e12 * config.devices)
        result |= {"devices": config.devices, "tokens_per_s": tokens_per_s, "mfu": mfu}
    return result


def describe(name: str, result: dict[str, Any]) -> str:
    if "error" in result:
        return f"{name:>8}: error: {result['error'][-2000:]}"
    line = (
        f"{name:>8}: {result['devices']} devices, {result['s_per_step']:.3f} s/step, "
        f"{result['tokens_per_s']:,.0f} tokens/s, MFU {result['mfu']:.1%}, "
        f"grad norm {result['grad_norm']:.6f}, NLL {result['nll']:.6f}"
    )
    if "matches_one" in result:
        line += (
            f"; vs one: log-prob max |diff| {result['log_prob_max_abs_diff']:.2e}, "
            f"NLL {result['nll_rel_diff']:.1e} rel, grad norm {result['grad_norm_rel_diff']:.1e} rel, "
            f"{'matches' if result['matches_one'] else 'DIFFERS FROM'} one"
        )
    return line


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="1.5b")
    parser.add_argument("--layouts", default="one,tp2,pp2", help="comma-separated; 'one' is the reference")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1, help="steps before timing (at least the scored first one)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--micro-batch-tokens", type=int, default=0, help="token cap per micro-batch; 0: --seq")
    parser.add_argument("--peak-tflops", type=float, default=790.0, help="per device")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads per rank; 0: torch's default")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per layout")
    parser.add_argument("--rtol", type=float, default=0.0, help="NLL and grad-norm tolerance vs one; 0: by dtype")
    args = parser.parse_args()
    rtol = args.rtol or (2e-2 if args.dtype == "bf16" else 1e-4)
    try:
        layouts = {name: layout(name, args.dtype == "bf16") for name in args.layouts.split(",")}
    except ValueError as exc:
        parser.error(str(exc))
    device = "cuda" if torch.cuda.is_available() else "cpu"

    report: dict[str, Any] = {k: getattr(args, k) for k in ("shape", "batch", "seq", "steps", "dtype")}
    report |= {"device": device, "gpus": torch.cuda.device_count(), "rtol": rtol}
    with tempfile.TemporaryDirectory(prefix="tandem-parallel-train-") as scratch:
        report["params"] = args.params = build_checkpoint(args.shape, DTYPES[args.dtype], Path(scratch))
        print(
            f"{args.shape}: {args.params / 1e6:.1f} M params, {args.batch} x {args.seq} tokens per step, {args.dtype}"
        )
        results = {name: run_layout(config, Path(scratch), args, device) for name, config in layouts.items()}
    reference = results.get("one", {})
    for name, result in results.items():
        if name != "one" and "error" not in result and "log_probs" in reference:
            result |= compare(result, reference, rtol)
    for name, result in results.items():
        print(describe(name, result))
    report["layouts"] = {name: {k: v for k, v in r.items() if k != "log_probs"} for name, r in results.items()}
    print(json.dumps(report))


if __name__ == "__main__":
    main()
