"""Quantized checkpoints (tandem/quantized_weights.py) and INT4 quantization-aware training: the error
bound of e4m3 per block, the layouts SGLang and vLLM load, the local engine serving them (weights
multiplied back out), and the served INT4 model computing exactly what QAT trained."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from learner.trainers.int4_qat import apply_int4_qat, remove_int4_qat, write_int4_copy
from server.engines.local.weights import load_model, read_state_dict
from tandem.quantized_weights import (
    BLOCK,
    FP8,
    FP8_MAX,
    dequantize,
    pack_int4,
    quantize,
    unpack_int4,
    write_quantized_checkpoint,
)
from tests.fixtures.tiny_model import tiny_model_path


def test_each_block_keeps_e4m3s_precision() -> None:
    torch.manual_seed(0)
    # Rows and columns not multiples of the block; blocks of very different magnitudes; an all-zero block.
    weight = torch.randn(300, 200) * torch.logspace(-4, 1, 300)[:, None]
    weight[:BLOCK, :BLOCK] = 0
    quantized, scale_inv = quantize(weight)
    assert quantized.dtype == FP8 and quantized.shape == weight.shape and scale_inv.shape == (3, 2)
    restored = dequantize(quantized, scale_inv, torch.float32)
    scales = scale_inv.repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)[:300, :200]
    # Round to nearest with 3 mantissa bits: half an ulp is 2^-4 of the value; below e4m3's smallest
    # normal (2^-6) the step is 2^-9 of the block's scale.
    bound = weight.abs() * 2**-4 + scales * 2**-10
    assert ((restored - weight).abs() <= bound * (1 + 1e-6)).all()
    assert restored[:BLOCK, :BLOCK].eq(0).all()
    # The scale puts each block's largest value on e4m3's largest.
    for i in range(3):
        for j in range(2):
            block = quantized[i * BLOCK : (i + 1) * BLOCK, j * BLOCK : (j + 1) * BLOCK].float()
            assert block.abs().max() == (FP8_MAX if (i, j) != (0, 0) else 0)


@pytest.fixture(scope="module")
def fp8_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    source = tiny_model_path()
    out = tmp_path_factory.mktemp("fp8") / "model"
    write_quantized_checkpoint(read_state_dict(source), source, out, "fp8", torch.bfloat16)
    return out


def test_the_checkpoint_has_deepseek_v3s_layout(fp8_checkpoint: Path) -> None:
    config = json.loads((fp8_checkpoint / "config.json").read_text())
    assert config["quantization_config"] == {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": [128, 128],
    }
    tensors = load_file(fp8_checkpoint / "model.safetensors")
    linear = "model.layers.0.mlp.down_proj.weight"
    rows, cols = tensors[linear].shape
    assert tensors[linear].dtype == FP8
    assert tensors[linear + "_scale_inv"].shape == (-(-rows // BLOCK), -(-cols // BLOCK))
    assert tensors[linear + "_scale_inv"].dtype == torch.float32
    # Embeddings, norms and biases stay as they were.
    kept = [name for name, t in tensors.items() if t.dtype != FP8 and not name.endswith("_scale_inv")]
    assert "model.embed_tokens.weight" in kept and "model.norm.weight" in kept
    assert all(tensors[name].dtype != FP8 for name in kept)
    assert (fp8_checkpoint / "tokenizer.json").is_file()


def test_the_local_engine_serves_it_with_logits_close_to_the_originals(fp8_checkpoint: Path) -> None:
    original = AutoModelForCausalLM.from_pretrained(tiny_model_path(), dtype=torch.float32).eval()
    served = load_model(fp8_checkpoint, device="cpu", dtype=torch.float32)
    ids = torch.randint(0, original.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected, got = original(ids).logits, served(ids).logits
    # Measured on the tiny model: relative error 0.026 (bf16 weights: 0.0045). Its random weights
    # leave the top two logits 0.035 apart on average, so greedy picks flip (12 % here); the
    # original's pick is always among the FP8 model's five best.
    assert (got - expected).norm() / expected.norm() < 0.05
    assert (got.topk(5, -1).indices == expected.argmax(-1, keepdim=True)).any(-1).all()
    # And the difference is the quantization's: a checkpoint unchanged would match exactly.
    assert (got - expected).abs().max() > 0


def test_int4_packs_eight_values_to_an_int32_first_in_the_lowest_bits() -> None:
    row = torch.tensor([[0, 1, 2, 3, 4, 5, 6, 7, -8, -7, -6, -5, -4, -3, -2, -1]], dtype=torch.int8)
    packed = pack_int4(row)
    assert packed.dtype == torch.int32 and packed.shape == (1, 2)
    # Shifted by 8 to 0..15: the first word holds 8..15, the second 0..7, nibble by nibble from the bottom.
    assert packed[0, 0].item() == 0xFEDCBA98 - (1 << 32) and packed[0, 1].item() == 0x76543210
    values = torch.randint(-8, 8, (5, 64), dtype=torch.int8, generator=torch.Generator().manual_seed(0))
    assert torch.equal(unpack_int4(pack_int4(values), 64), values)


def test_the_served_int4_model_computes_what_qat_trained(tmp_path: Path) -> None:
    """Fake-quantized training, a step that moves the weights, the INT4 export, the local engine: the
    same logits, bit for bit (non-quantized tensors kept in float32 to compare exactly)."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path(), dtype=torch.float32)
    assert apply_int4_qat(model, torch.bfloat16, group=32) == 2 * 7  # every linear of both layers
    ids = torch.randint(0, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    model(ids, labels=ids).loss.backward()
    latent = model.model.layers[0].mlp.down_proj.parametrizations.weight.original
    assert latent.grad is not None and latent.grad.abs().sum() > 0  # straight through to the real weights
    optimizer.step()
    with torch.no_grad():
        trained = model(ids).logits
    remove_int4_qat(model)
    checkpoint = tmp_path / "checkpoint"
    model.save_pretrained(checkpoint)  # float32
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (checkpoint / name).write_bytes((tiny_model_path() / name).read_bytes())
    served = load_model(write_int4_copy(model, checkpoint, torch.bfloat16, group=32), device="cpu", dtype=torch.float32)
    with torch.no_grad():
        assert torch.equal(served(ids).logits, trained)
        assert not torch.equal(model(ids).logits, trained)  # the full-precision weights differ from INT4's
    config = json.loads((checkpoint.parent / "checkpoint-int4" / "config.json").read_text())
    weights = config["quantization_config"]["config_groups"]["group_0"]["weights"]
    assert (config["quantization_config"]["format"], weights["num_bits"], weights["group_size"]) == (
        "pack-quantized",
        4,
        32,
    )
