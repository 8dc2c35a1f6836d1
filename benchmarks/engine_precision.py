"""What faster CPU number formats do to the answers: greedy agreement and log-prob error against fp32.

    .venv/bin/python -m benchmarks.engine_precision [--model smollm2-135m-instruct] [--tokens 48]

For each variant of the model (fp32 with oneDNN-packed linears, as the local engine serves; bf16
weights and activations; weight-only int8 linears with bf16 inputs, as ``TANDEM_LINEAR_WEIGHTS=int8``
serves; int8 dynamic quantization of the linear layers, torch.ao's per-tensor default), on the eight chat prompts of ``benchmarks.engine_decode``: the share of fp32's greedy
tokens the variant reproduces before its first different token, and the mean absolute difference
of the log-probability it gives fp32's greedy tokens (teacher-forced, nats per token).
"""

from __future__ import annotations

import argparse
import copy
from collections.abc import Callable

import torch
from torch import nn
from transformers import AutoModelForCausalLM

from benchmarks.common import console, load_model_and_tokenizer, model_arg, progress
from benchmarks.engine_decode import chat_prompts
from server.engines.local.int8_linear import int8_linears
from server.engines.local.packed_linear import pack_linears


def packed(model: nn.Module) -> nn.Module:
    pack_linears(model, rows_hint=8)
    return model


def int8_dynamic(model: nn.Module) -> nn.Module:
    from torch.ao.quantization import quantize_dynamic

    return quantize_dynamic(model, {nn.Linear}, dtype=torch.qint8)


VARIANTS: dict[str, Callable[[nn.Module], nn.Module]] = {
    "fp32, packed linears": packed,
    "bf16": lambda model: model.to(torch.bfloat16),
    "int8 weights (linears), as served": lambda model: (int8_linears(model), model)[1],
    "int8 dynamic (linears)": int8_dynamic,
}


@torch.inference_mode()
def token_log_probs(model: nn.Module, ids: torch.Tensor, prompt_length: int) -> torch.Tensor:
    logits = model(input_ids=ids).logits[0, prompt_length - 1 : -1].float()
    return torch.log_softmax(logits, -1).gather(-1, ids[0, prompt_length:, None])[:, 0]


@torch.inference_mode()
def greedy(model: nn.Module, prompt: torch.Tensor, tokens: int) -> torch.Tensor:
    return model.generate(prompt, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    model_arg(parser)
    parser.add_argument("--tokens", type=int, default=48)
    args = parser.parse_args()
    path, tokenizer = load_model_and_tokenizer(args)
    prompts = [torch.tensor([p]) for p in chat_prompts(tokenizer)]
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    expected = [greedy(reference, p, args.tokens) for p in prompts]
    rows = []
    with progress() as bar:
        task = bar.add_task("variants", total=len(VARIANTS))
        for name, make in VARIANTS.items():
            variant = make(copy.deepcopy(reference))
            agreed = errors = 0.0
            for prompt, want in zip(prompts, expected, strict=True):
                got = greedy(variant, prompt, args.tokens)[0, prompt.shape[1] :]
                differ = (got != want[0, prompt.shape[1] :]).nonzero()
                agreed += int(differ[0, 0]) if len(differ) else args.tokens
                ours = token_log_probs(variant, want, prompt.shape[1])
                errors += (ours - token_log_probs(reference, want, prompt.shape[1])).abs().mean().item()
            rows.append((name, agreed / (args.tokens * len(prompts)), errors / len(prompts)))
            bar.advance(task)
    console.print(f"model {path.name}, {len(prompts)} prompts x {args.tokens} greedy tokens, fp32 as reference")
    for name, agreement, error in rows:
        print(f"{name:<24} greedy agreement {agreement:6.1%}   mean |d logprob| {error:.4f} nats/token")


if __name__ == "__main__":
    main()
