"""Hugging Face <-> megatron-core weight names and layouts, per model family.

Works on plain state dicts: HF names as they are stored in safetensors files (per-expert tensors
for mixture-of-experts models, which is how transformers saves them), megatron names as in the
local-spec ``GPTModel``'s ``state_dict()`` with a whole (unsplit) layout. Conversions are pure
re-arrangements, so HF -> megatron -> HF gives back every tensor bit for bit.

Fused tensors (shared/reference/megatron-core-cpu.md §6):

* ``linear_qkv`` rows are grouped per KV head: for each of the ``g`` groups, its ``heads / g``
  query heads, then its key head, then its value head (bias likewise). This is the layout that
  splits evenly over tensor-parallel ranks and matches HF's ``repeat_kv``.
* ``linear_fc1`` is ``[gate; up]``.

Multi-latent attention (DeepSeek-V3) only changes names: megatron's MLA projections hold their rows
in transformers' order (per head ``[nope; rope]`` for queries and ``[nope; v]`` for the key/value
up-projection, ``[latent; rope]`` for the key/value down-projection), and both de-interleave the
rope half the same way at run time.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

__all__ = [
    "FAMILIES",
    "Family",
    "UnsupportedModel",
    "family_of",
    "moe_layer_pattern",
    "num_experts",
    "to_hf",
    "to_megatron",
]


class UnsupportedModel(ValueError):
    """A HF model this backend cannot reproduce exactly."""


@dataclass(frozen=True, slots=True)
class Family:
    """What sets a model family apart from plain Llama, as far as conversion and config go."""

    model_type: str
    fixed_qkv_bias: bool  # Qwen2 always has q/k/v biases and no others
    qk_norm: bool  # Qwen3: RMSNorm over each head's queries and keys
    moe: bool  # routed experts
    mla: bool = False  # DeepSeek-V3: multi-latent attention instead of q/k/v projections
    shared_experts: bool = False  # DeepSeek-V3: shared experts, a router with a score-correction bias

    def qkv_bias(self, hf: Any) -> bool:
        return self.fixed_qkv_bias

    @property
    def attention_bias_is_config(self) -> bool:
        """Whether ``attention_bias`` in the config adds biases (to q/k/v and the output projection)."""
        return not self.fixed_qkv_bias


FAMILIES: dict[str, Family] = {
    family.model_type: family
    for family in (
        Family("qwen2", fixed_qkv_bias=True, qk_norm=False, moe=False),
        Family("llama", fixed_qkv_bias=False, qk_norm=False, moe=False),
        Family("qwen3", fixed_qkv_bias=False, qk_norm=True, moe=False),
        Family("qwen3_moe", fixed_qkv_bias=False, qk_norm=True, moe=True),
        Family("deepseek_v3", fixed_qkv_bias=False, qk_norm=False, moe=True, mla=True, shared_experts=True),
    )
}


def family_of(hf: Any) -> Family:
    """The family of a transformers config, by its ``model_type``.

    Raises:
        UnsupportedModel: a model type with no registered family.
    """
    family = FAMILIES.get(hf.model_type)
    if family is None:
        raise UnsupportedModel(
            f"model_type {hf.model_type!r} has no megatron conversion (known: {', '.join(FAMILIES)})"
        )
    return family


def moe_layer_pattern(hf: Any) -> list[int]:
    """1 for a layer with routed experts, 0 for a dense one (Qwen3-MoE's sparse step and MLP-only
    layers, DeepSeek-V3's first ``first_k_dense_replace`` layers)."""
    if family_of(hf).shared_experts:
        return [int(i >= hf.first_k_dense_replace) for i in range(hf.num_hidden_layers)]
    step = getattr(hf, "decoder_sparse_step", 1) or 1
    dense = set(getattr(hf, "mlp_only_layers", None) or ())
    return [int(i not in dense and (i + 1) % step == 0) for i in range(hf.num_hidden_layers)]


def num_experts(hf: Any) -> int:
    """Routed experts per MoE layer (0 for a dense model)."""
    if not family_of(hf).moe:
        return 0
    return getattr(hf, "num_experts", None) or hf.n_routed_experts


def _head_dim(hf: Any) -> int:
    return getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads


def _fuse_qkv(q: Tensor, k: Tensor, v: Tensor, hf: Any) -> Tensor:
    groups, head_dim = hf.num_key_value_heads, _head_dim(hf)
    tail = q.shape[1:]  # (hidden,) for weights, () for biases
    grouped = [q.reshape(groups, -1, *tail), k.reshape(groups, head_dim, *tail), v.reshape(groups, head_dim, *tail)]
    return torch.cat(grouped, dim=1).reshape(-1, *tail)


def _split_qkv(qkv: Tensor, hf: Any) -> tuple[Tensor, Tensor, Tensor]:
    groups, head_dim = hf.num_key_value_heads, _head_dim(hf)
    per_group = hf.num_attention_heads // groups * head_dim
    tail = qkv.shape[1:]
    q, k, v = qkv.reshape(groups, per_group + 2 * head_dim, *tail).split([per_group, head_dim, head_dim], dim=1)
    return q.reshape(-1, *tail), k.reshape(-1, *tail), v.reshape(-1, *tail)


# (megatron suffix, HF suffix) for tensors that only change name, relative to a layer.
_LAYER_RENAMES = (
    ("input_layernorm.weight", "input_layernorm.weight"),
    ("self_attention.linear_proj.weight", "self_attn.o_proj.weight"),
    ("pre_mlp_layernorm.weight", "post_attention_layernorm.weight"),
)
_QK_NORM_RENAMES = (
    ("self_attention.q_layernorm.weight", "self_attn.q_norm.weight"),
    ("self_attention.k_layernorm.weight", "self_attn.k_norm.weight"),
)
_MLA_RENAMES = (
    ("self_attention.linear_kv_down_proj.weight", "self_attn.kv_a_proj_with_mqa.weight"),
    ("self_attention.kv_layernorm.weight", "self_attn.kv_a_layernorm.weight"),
    ("self_attention.linear_kv_up_proj.weight", "self_attn.kv_b_proj.weight"),
)
_MLA_Q_LORA_RENAMES = (
    ("self_attention.linear_q_down_proj.weight", "self_attn.q_a_proj.weight"),
    ("self_attention.q_layernorm.weight", "self_attn.q_a_layernorm.weight"),
    ("self_attention.linear_q_up_proj.weight", "self_attn.q_b_proj.weight"),
)
_MLA_Q_RENAMES = (("self_attention.linear_q_proj.weight", "self_attn.q_proj.weight"),)


def _attention_renames(hf: Any, family: Family) -> list[tuple[str, str]]:
    if family.mla:
        return list(_MLA_RENAMES + (_MLA_Q_LORA_RENAMES if hf.q_lora_rank is not None else _MLA_Q_RENAMES))
    return list(_QK_NORM_RENAMES) if family.qk_norm else []


def _mlp_pairs(hf: Any, family: Family, layer: int) -> list[tuple[str, str]]:
    """(megatron prefix, HF prefix) of each gated MLP in a layer: the dense one, or every expert and the
    shared experts (one MLP of n_shared_experts x moe_intermediate_size in both)."""
    if family.moe and moe_layer_pattern(hf)[layer]:
        experts = [(f"mlp.experts.local_experts.{j}.", f"mlp.experts.{j}.") for j in range(num_experts(hf))]
        return experts + ([("mlp.shared_experts.", "mlp.shared_experts.")] if family.shared_experts else [])
    return [("mlp.", "mlp.")]


_Pairs = list[tuple[str, str]]  # (megatron name, HF name)


def _layer_plan(hf: Any, family: Family, layer: int) -> tuple[_Pairs, _Pairs, _Pairs]:
    """This layer's plain renames, fused QKV tensors (the HF name with ``{}`` for q, k, v) and gated
    MLPs (prefixes), as full names."""
    m, h = f"decoder.layers.{layer}.", f"model.layers.{layer}."
    renames = list(_LAYER_RENAMES) + _attention_renames(hf, family)
    if family.moe and moe_layer_pattern(hf)[layer]:
        renames.append(("mlp.router.weight", "mlp.gate.weight"))
        if family.shared_experts:
            renames.append(("mlp.router.expert_bias", "mlp.gate.e_score_correction_bias"))
    kinds = () if family.mla else ("weight", "bias") if family.qkv_bias(hf) else ("weight",)
    qkv = [(f"{m}self_attention.linear_qkv.{kind}", f"{h}self_attn.{{}}_proj.{kind}") for kind in kinds]
    mlps = [(m + a, h + b) for a, b in _mlp_pairs(hf, family, layer)]
    return [(m + a, h + b) for a, b in renames], qkv, mlps


def _global_renames(hf: Any) -> _Pairs:
    renames = [
        ("embedding.word_embeddings.weight", "model.embed_tokens.weight"),
        ("decoder.final_layernorm.weight", "model.norm.weight"),
    ]
    if not getattr(hf, "tie_word_embeddings", False):
        renames.append(("output_layer.weight", "lm_head.weight"))
    return renames


def _plan(hf: Any) -> list[tuple[_Pairs, _Pairs, _Pairs]]:
    """The whole model as ``_layer_plan``s, in HF order: the global renames, then each layer.

    Raises:
        UnsupportedModel: an unknown family.
    """
    family = family_of(hf)
    return [(_global_renames(hf), [], [])] + [_layer_plan(hf, family, i) for i in range(hf.num_hidden_layers)]


def to_megatron(state: Mapping[str, Tensor], hf: Any) -> dict[str, Tensor]:
    """The whole-model megatron state dict for HF tensors ``state`` of a model with config ``hf``.

    Raises:
        UnsupportedModel: an unknown family.
        KeyError: a tensor the family needs is missing from ``state``.
    """
    out: dict[str, Tensor] = {}
    for renames, qkv, mlps in _plan(hf):
        out |= {m: state[h] for m, h in renames}
        out |= {m: _fuse_qkv(state[h.format("q")], state[h.format("k")], state[h.format("v")], hf) for m, h in qkv}
        for m, h in mlps:
            out[m + "linear_fc1.weight"] = torch.cat([state[h + "gate_proj.weight"], state[h + "up_proj.weight"]])
            out[m + "linear_fc2.weight"] = state[h + "down_proj.weight"]
    return out


def to_hf(state: Mapping[str, Tensor], hf: Any) -> dict[str, Tensor]:
    """The HF tensors (names as saved by transformers) for a whole-model megatron state dict.

    Tied embeddings are written once, as ``model.embed_tokens.weight`` (what ``save_pretrained`` does).
    Megatron's ``_extra_state`` entries carry no weights and are ignored.

    Raises:
        UnsupportedModel: an unknown family.
        KeyError: a tensor the family needs is missing from ``state``.
    """
    out: dict[str, Tensor] = {}
    for renames, qkv, mlps in _plan(hf):
        out |= {h: state[m] for m, h in renames}
        for m, h in qkv:
            for p, tensor in zip("qkv", _split_qkv(state[m], hf), strict=True):
                out[h.format(p)] = tensor.clone()  # its own storage: safetensors refuses views
        for m, h in mlps:
            gate, up = state[m + "linear_fc1.weight"].chunk(2)
            out |= {
                h + "gate_proj.weight": gate.clone(),
                h + "up_proj.weight": up.clone(),
                h + "down_proj.weight": state[m + "linear_fc2.weight"],
            }
    return out
