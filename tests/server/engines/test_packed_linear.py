"""oneDNN-packed linear layers: the same outputs as plain ones, and a weight changed in place is used."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM

from server.engines.local.packed_linear import PackedLinear, pack_linears
from server.engines.local.torch_threads import off_engine_thread
from server.engines.local.weights import copy_weights, read_state_dict

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="this torch build has no oneDNN")


def load(path: Path) -> nn.Module:
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@torch.inference_mode()
def logits(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids).logits


def test_packed_layers_compute_what_plain_ones_do_and_follow_in_place_swaps(
    tiny_model: Path, perturbed_model: Path
) -> None:
    plain, packed = load(tiny_model), load(tiny_model)
    assert pack_linears(packed, rows_hint=8) == sum(type(m) is nn.Linear for m in plain.modules()) > 0
    assert all(type(m) is not nn.Linear for m in packed.modules())
    assert all(isinstance(m, nn.Linear) for m in packed.modules() if isinstance(m, PackedLinear))  # LoRA hooks see them
    assert packed.state_dict().keys() == plain.state_dict().keys()
    ids = torch.tensor([[1, 287, 201, 268, 318, 81, 638, 2]])
    torch.testing.assert_close(logits(packed, ids), logits(plain, ids), rtol=1e-4, atol=1e-4)

    swapped = read_state_dict(perturbed_model)
    copy_weights(packed, swapped)  # what a weight swap does: copy_ into the parameters
    torch.testing.assert_close(logits(packed, ids), logits(load(perturbed_model), ids), rtol=1e-4, atol=1e-4)
    assert not torch.allclose(logits(packed, ids), logits(plain, ids), atol=1e-3)


def test_a_dtype_without_a_packed_path_is_left_plain(tiny_model: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float16).eval()
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(8, 8, dtype=torch.float16), 1)
    except RuntimeError:
        assert pack_linears(model, rows_hint=8) == 0
        assert all(type(m) is nn.Linear for m in model.modules() if isinstance(m, nn.Linear))
    else:
        pytest.skip("this CPU packs fp16: no dtype to refuse here")


def test_work_off_the_engine_thread_runs_torch_single_threaded() -> None:
    seen: list[int] = []

    def probe() -> str:
        seen.append(torch.get_num_threads())
        return threading.current_thread().name

    name = asyncio.run(off_engine_thread(probe))
    assert seen == [1] and name != threading.main_thread().name
