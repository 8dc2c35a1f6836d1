"""The SDPA core attention against megatron's own local attention, and packed rows against padded ones."""

from __future__ import annotations

from pathlib import Path

import torch
from megatron.core.packed_seq_params import PackedSeqParams

from learner.megatron.model import build_model
from learner.megatron.sdpa_attention import SDPAttention
from learner.megatron.weights import load_hf_weights
from learner.megatron_config import MegatronConfig
from tests.learner.megatron.conftest import FAMILIES, random_hf, saved_state


def test_sdpa_spec_matches_the_local_spec_and_packs(world: MegatronConfig, tmp_path: Path) -> None:
    config = FAMILIES["qwen2"]()
    saved_state(random_hf(config), tmp_path)
    models = {}
    for attention in ("local", "sdpa"):
        models[attention] = build_model(config, world, attention=attention).eval()
        load_hf_weights(models[attention], tmp_path, config, world)
    assert isinstance(models["sdpa"].decoder.layers[0].self_attention.core_attention, SDPAttention)
    tokens = torch.randint(0, config.vocab_size, (2, 40), generator=torch.Generator().manual_seed(3))
    positions = torch.arange(40)[None].expand(2, -1)
    with torch.no_grad():
        local = models["local"](tokens, positions, None)
        sdpa = models["sdpa"](tokens, positions, None)
        # The two rows packed end to end as one thd row: each must still see only itself.
        cu_seqlens = torch.tensor([0, 40, 80], dtype=torch.int32)
        packed_params = PackedSeqParams(
            qkv_format="thd", cu_seqlens_q=cu_seqlens, cu_seqlens_kv=cu_seqlens, max_seqlen_q=40, max_seqlen_kv=40
        )
        packed = models["sdpa"](tokens.reshape(1, 80), positions.reshape(1, 80), None, packed_seq_params=packed_params)
    torch.testing.assert_close(sdpa, local, rtol=0, atol=1e-5)
    assert not torch.equal(sdpa, local)  # two different kernels really ran
    torch.testing.assert_close(packed.reshape(2, 40, -1), sdpa, rtol=0, atol=1e-5)
