"""DeepSeek-V3 on megatron-core: multi-latent attention (MLA), its RoPE, and its router.

``mla_fields`` and ``router_fields`` map a transformers ``DeepseekV3Config`` onto
``MLATransformerConfig``: the latent ranks and the nope/rope/value head sizes with their latent
RMSNorms; routed experts picked by a sigmoid score plus ``e_score_correction_bias`` (megatron's
expert bias) within the best expert groups, weighted by the renormalised sigmoid scores times
``routed_scaling_factor``; shared experts beside them. ``refusals`` names the configs megatron-core
computes otherwise. ``install_rope`` gives every layer's attention transformers' RoPE frequencies
(and YaRN's cos/sin factor).

transformers never updates ``e_score_correction_bias`` while training, so megatron's bias update
(DeepSeek's auxiliary-loss-free balancing) is off: the bias stays as loaded.

megatron-core 0.16's ``DotProductAttention`` does not take MLA's key and value head sizes;
``MLADotProductAttention`` does, so MLA also runs on the local (unfused) core attention.
"""

from __future__ import annotations

from typing import Any

from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer.dot_product_attention import DotProductAttention
from torch import Tensor
from transformers import PretrainedConfig

from learner.megatron.hf_convert import moe_layer_pattern

__all__ = ["MLADotProductAttention", "install_rope", "mla_fields", "refusals", "router_fields"]

# transformers' latent RMSNorms (q_a_layernorm, kv_a_layernorm) are built without the config's epsilon.
_LATENT_NORM_EPS = 1e-6


def _groups_limit(hf: PretrainedConfig) -> bool:
    """Whether routing is limited to ``topk_group`` of ``n_group`` expert groups (not all of them)."""
    return bool(hf.n_group and hf.topk_group and hf.topk_group < hf.n_group)


def refusals(hf: PretrainedConfig) -> list[str]:
    """What megatron-core would compute otherwise than transformers for this DeepSeek-V3 config."""
    found = []
    if hf.num_key_value_heads != hf.num_attention_heads:
        found.append("num_key_value_heads != num_attention_heads (MLA expands keys and values to every head)")
    if hf.rms_norm_eps != _LATENT_NORM_EPS:
        found.append(
            f"rms_norm_eps={hf.rms_norm_eps}: transformers' latent norms use {_LATENT_NORM_EPS}, megatron's the config's"
        )
    if not hf.rope_interleave:
        found.append("rope_interleave=False (megatron's MLA always de-interleaves the rope half)")
    if not hf.n_shared_experts:
        found.append("no shared experts (n_shared_experts=0)")
    top_k = hf.num_experts_per_tok
    if bool(hf.norm_topk_prob) != (top_k > 1):
        found.append(
            f"norm_topk_prob={hf.norm_topk_prob} with num_experts_per_tok={top_k}: megatron's sigmoid router "
            "renormalises the chosen weights exactly when it chooses more than one expert"
        )
    if _groups_limit(hf) and top_k // hf.topk_group != 2:
        found.append(
            f"group-limited routing with num_experts_per_tok // topk_group = {top_k // hf.topk_group}: transformers "
            "scores a group by its best 2 experts, megatron by its best num_experts_per_tok // topk_group"
        )
    return found


def mla_fields(hf: PretrainedConfig) -> dict[str, Any]:
    """``MLATransformerConfig`` fields for the attention (the rest are shared with the other families)."""
    rope = hf.rope_parameters
    scaled = rope["rope_type"] != "default"
    return {
        "q_lora_rank": hf.q_lora_rank,
        "kv_lora_rank": hf.kv_lora_rank,
        "qk_head_dim": hf.qk_nope_head_dim,
        "qk_pos_emb_head_dim": hf.qk_rope_head_dim,
        "v_head_dim": hf.v_head_dim,
        "kv_channels": hf.v_head_dim,  # the local core attention's output width per head
        "num_query_groups": hf.num_attention_heads,
        "qk_layernorm": True,  # MLA's q/kv layernorms are the latent RMSNorms
        # "yarn" makes MLA apply the cos/sin factor that install_rope's embedding returns
        "rope_type": "yarn" if rope["rope_type"] == "yarn" else "rope",
        "rotary_base": rope["rope_theta"],
        # MLA's softmax scale is mscale(factor, mscale_all_dim)^2 / sqrt(head size), as transformers'
        "rotary_scaling_factor": rope["factor"] if scaled else 1.0,
        "mscale_all_dim": (rope.get("mscale_all_dim") or 0.0) if scaled else 0.0,
        "original_max_position_embeddings": rope.get("original_max_position_embeddings") or 4096,
    }


def router_fields(hf: PretrainedConfig) -> dict[str, Any]:
    """The router and shared-expert fields of ``MLATransformerConfig`` (experts and sizes are shared)."""
    limit = _groups_limit(hf)
    return {
        "moe_router_score_function": "sigmoid",
        "moe_router_enable_expert_bias": True,
        "moe_router_bias_update_rate": 0.0,  # transformers keeps the bias fixed
        "moe_router_num_groups": hf.n_group if limit else None,
        "moe_router_group_topk": hf.topk_group if limit else None,
        "moe_router_topk_scaling_factor": hf.routed_scaling_factor,
        "moe_shared_expert_intermediate_size": hf.moe_intermediate_size * hf.n_shared_experts,
        "moe_layer_freq": moe_layer_pattern(hf),
    }


class _TransformersRope(RotaryEmbedding):
    """Megatron's rotary embedding with transformers' inverse frequencies; with a cos/sin factor it
    answers as megatron's YaRN embedding does: (frequencies, factor)."""

    def __init__(self, inv_freq: Tensor, cos_sin_factor: float | None, cp_group: Any) -> None:
        super().__init__(
            kv_channels=2 * inv_freq.numel(), rotary_percent=1.0, use_cpu_initialization=True, cp_group=cp_group
        )
        self.inv_freq = inv_freq
        self.cos_sin_factor = cos_sin_factor

    def forward(  # type: ignore[override]
        self, max_seq_len: int, offset: int = 0, packed_seq: bool = False, cp_group: Any = None
    ) -> Tensor | tuple[Tensor, float]:
        emb = super().forward(max_seq_len, offset, packed_seq, cp_group)
        return emb if self.cos_sin_factor is None else (emb, self.cos_sin_factor)


def install_rope(model: GPTModel, inv_freq: Tensor, cos_sin_factor: float) -> None:
    """Every MLA layer of ``model`` gets transformers' RoPE (``inv_freq`` and, under YaRN, the factor
    on cos and sin). Call it before the first forward: rotary embeddings cache their output."""
    for layer in model.decoder.layers:
        attention = layer.self_attention
        yarn = attention.config.rope_type == "yarn"
        attention.rotary_pos_emb = _TransformersRope(
            inv_freq, cos_sin_factor if yarn else None, attention.rotary_pos_emb.cp_group
        )


class MLADotProductAttention(DotProductAttention):
    """megatron-core's unfused core attention as MLA's: it reads the key and value head sizes off the
    tensors, and its output width per head is ``kv_channels`` (``mla_fields`` sets it to v_head_dim)."""

    def __init__(self, *args: Any, k_channels: int | None = None, v_channels: int | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
