"""A megatron-core ``GPTModel`` that computes what a Hugging Face Qwen2/Qwen3/Llama/Qwen3-MoE/DeepSeek-V3 model does.

``transformer_config`` maps the HF config onto megatron's (shared/reference/megatron-core-cpu.md §5:
RMSNorm epsilon, SwiGLU, q/k/v bias, q/k norm, no dropout, grouped-query attention, experts and
their router); ``build_model`` builds the model with the local layer spec, its core attention swapped
for ``SDPAttention`` unless ``attention="local"``, and RoPE frequencies taken from transformers'
own formula so scaled variants (``llama3``, ``linear``; ``yarn`` for DeepSeek-V3) match exactly,
applied by ``rope`` in fewer kernels than megatron's own unfused path.
DeepSeek-V3's multi-latent attention and router come from ``deepseek``.

Features with no exact megatron counterpart here are refused with the reason (sliding windows,
YaRN/LongRoPE attention scaling outside MLA, biases on the output or MLP projections, non-SiLU
activations, quantized checkpoints, and DeepSeek-V3's own list in ``deepseek.refusals``).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

import torch
import torch.nn.functional as F
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
from megatron.core.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    set_tensor_model_parallel_attributes,
)
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig
from transformers import PretrainedConfig

from learner.megatron import deepseek
from learner.megatron.cpu_compat import on_cpu
from learner.megatron.hf_convert import UnsupportedModel, family_of, moe_layer_pattern, num_experts
from learner.megatron.rope import install_rope
from learner.megatron.sdpa_attention import SDPAttention
from learner.megatron_config import MegatronConfig

__all__ = ["AttentionKind", "UnsupportedModel", "build_model", "transformer_config"]

# ``sdpa``: torch's scaled_dot_product_attention (fused kernels on GPU, packed rows: what the trainer
# runs); ``local``: megatron-core's unfused DotProductAttention (padded batches only; the reference
# the SDPA path is tested against).
AttentionKind = Literal["sdpa", "local"]

# RoPE variants whose frequencies transformers computes once and applies without extra scaling.
_ROPE_TYPES = ("default", "linear", "llama3")


def _rope_parameters(hf: PretrainedConfig) -> dict[str, Any]:
    params = dict(getattr(hf, "rope_parameters", None) or {})
    params.setdefault("rope_theta", getattr(hf, "rope_theta", 10000.0))
    params.setdefault("rope_type", "default")
    return params


def _refusals(hf: PretrainedConfig) -> list[str]:
    family = family_of(hf)
    rope = _rope_parameters(hf)
    # MLA applies YaRN's cos/sin factor and softmax scale (transformers' DeepSeek-V3 formula)
    rope_types = (*_ROPE_TYPES, "yarn") if family.mla else _ROPE_TYPES
    refusals = deepseek.refusals(hf) if family.mla else []
    if rope["rope_type"] not in rope_types:
        refusals.append(f"rope_type {rope['rope_type']!r} (supported: {', '.join(rope_types)})")
    if rope.get("partial_rotary_factor", 1.0) != 1.0:
        refusals.append("partial rotary embeddings")
    if getattr(hf, "hidden_act", "silu") != "silu":
        refusals.append(f"hidden_act {hf.hidden_act!r} (only silu)")
    if getattr(hf, "use_sliding_window", False) or "sliding_attention" in (getattr(hf, "layer_types", None) or ()):
        refusals.append("sliding-window attention")
    if getattr(hf, "mlp_bias", False) or (family.attention_bias_is_config and hf.attention_bias):
        refusals.append("biases on the output or MLP projections")
    if getattr(hf, "quantization_config", None):
        refusals.append("quantized checkpoints (quantization_config)")
    return refusals


def transformer_config(hf: PretrainedConfig, parallel: MegatronConfig, *, fused: bool = False) -> TransformerConfig:
    """The megatron ``TransformerConfig`` equivalent to ``hf`` under ``parallel``'s layout; ``fused``:
    SwiGLU as megatron's ``torch.compile``'d kernel (``megatron.core.jit``).

    Raises:
        UnsupportedModel: a model type or feature this backend does not reproduce exactly.
    """
    family = family_of(hf)
    refusals = _refusals(hf)
    if refusals:
        raise UnsupportedModel(f"{hf.model_type}: not supported by the megatron backend: {'; '.join(refusals)}")
    dtype = torch.bfloat16 if parallel.bf16 else torch.float32
    heads = hf.num_attention_heads
    moe: dict[str, Any] = {}
    if family.moe:
        moe = {
            "num_moe_experts": num_experts(hf),
            "moe_ffn_hidden_size": hf.moe_intermediate_size,
            "moe_router_topk": hf.num_experts_per_tok,
            "moe_layer_freq": moe_layer_pattern(hf),
            "moe_router_load_balancing_type": "none",
            "moe_aux_loss_coeff": 0.0,
            "moe_grouped_gemm": False,
            "moe_router_dtype": "fp32",
        }
        if family.shared_experts:
            moe |= deepseek.router_fields(hf)
        else:
            # HF: softmax over all experts, top-k, renormalised when norm_topk_prob. Megatron's softmax
            # over the top-k logits is that renormalised form; pre-softmax is the plain one.
            moe |= {"moe_router_pre_softmax": not hf.norm_topk_prob, "moe_router_topk_scaling_factor": None}
    attention: dict[str, Any] = {
        "num_query_groups": getattr(hf, "num_key_value_heads", None) or heads,
        "kv_channels": getattr(hf, "head_dim", None) or hf.hidden_size // heads,
        "add_qkv_bias": family.qkv_bias(hf),
        "qk_layernorm": family.qk_norm,
    }
    if family.mla:
        attention |= deepseek.mla_fields(hf)
    recompute: dict[str, Any] = {}
    if parallel.recompute == "full":
        recompute = {
            "recompute_granularity": "full",
            "recompute_method": "uniform",
            "recompute_num_layers": parallel.recompute_num_layers,
        }
    elif parallel.recompute == "selective":
        recompute = {"recompute_granularity": "selective"}
    config_class = MLATransformerConfig if family.mla else TransformerConfig
    config = config_class(
        num_layers=hf.num_hidden_layers,
        hidden_size=hf.hidden_size,
        num_attention_heads=heads,
        ffn_hidden_size=hf.intermediate_size,
        normalization="RMSNorm",
        layernorm_epsilon=hf.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        # SwiGLU as one compiled kernel on CUDA (build_model); the other fusions need TE or Apex
        bias_activation_fusion=fused,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        attention_softmax_in_fp32=True,
        tensor_model_parallel_size=parallel.tensor_parallel,
        pipeline_model_parallel_size=parallel.pipeline_parallel,
        context_parallel_size=parallel.context_parallel,
        expert_model_parallel_size=parallel.expert_parallel,
        sequence_parallel=parallel.sequence_parallel,
        bf16=parallel.bf16,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        variable_seq_lengths=True,  # packed micro-batches differ in length
        moe_token_dispatcher_type="alltoall",  # the default (allgather) refuses variable lengths
        use_cpu_initialization=True,
        perform_initialization=False,  # every weight is loaded from the checkpoint
        **attention,
        **recompute,
        **moe,
    )
    return config


def _layer_specs(config: TransformerConfig, attention: AttentionKind) -> TransformerBlockSubmodules:
    block = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization="RMSNorm")
    if attention == "sdpa":
        core: type = SDPAttention
    elif config.multi_latent_attention:
        core = deepseek.MLADotProductAttention
    else:
        return block
    specs = []
    for layer in block.layer_specs:
        attention_spec = layer.submodules.self_attention
        attention_spec = dataclasses.replace(
            attention_spec, submodules=dataclasses.replace(attention_spec.submodules, core_attention=core)
        )
        specs.append(
            ModuleSpec(layer.module, layer.params, dataclasses.replace(layer.submodules, self_attention=attention_spec))
        )
    return dataclasses.replace(block, layer_specs=specs)


def _hf_rope(hf: PretrainedConfig, head_dim: int) -> tuple[torch.Tensor, float]:
    """transformers' inverse frequencies and the factor it puts on cos and sin (YaRN's attention factor)."""
    rope = _rope_parameters(hf)
    if rope["rope_type"] == "default":
        exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
        return 1.0 / (rope["rope_theta"] ** exponents), 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    inv_freq, attention_scaling = ROPE_INIT_FUNCTIONS[rope["rope_type"]](hf, torch.device("cpu"))
    return inv_freq.float(), attention_scaling


def build_model(
    hf: PretrainedConfig,
    parallel: MegatronConfig,
    *,
    attention: AttentionKind = "sdpa",
    pre_process: bool = True,
    post_process: bool = True,
    fused: bool | None = None,
) -> GPTModel:
    """An unloaded ``GPTModel`` for ``hf`` (weights come from ``hf_convert``), on the CPU.

    ``fused``: the compiled SwiGLU kernel, by default on CUDA machines (the CPU keeps the eager code:
    no compile time in CI). Without TransformerEngine that is the one fusion worth its host time on
    an H200: a compiled RoPE saved 8 ms of device time per 1.5B step and cost more in host time
    (each compiled call's guards and autograd wrapper), with the step already waiting on the host.
    Needs ``megatron.core.parallel_state`` initialised (``runtime.init_parallel``).
    """
    fused = not on_cpu() if fused is None else fused
    config = transformer_config(hf, parallel, fused=fused)
    install_rope()
    model = GPTModel(
        config=config,
        transformer_layer_spec=_layer_specs(config, attention),
        vocab_size=hf.vocab_size,
        max_sequence_length=hf.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        share_embeddings_and_output_weights=bool(getattr(hf, "tie_word_embeddings", False)),
        position_embedding_type="rope",
        rotary_percent=1.0,
        rotary_base=int(_rope_parameters(hf)["rope_theta"]),
    )
    # Before the first forward: RotaryEmbedding.forward caches its result.
    if isinstance(config, MLATransformerConfig):
        deepseek.install_rope(model, *_hf_rope(hf, config.qk_pos_emb_head_dim))
    else:
        inv_freq, attention_scaling = _hf_rope(hf, config.kv_channels)
        if attention_scaling != 1.0:
            raise UnsupportedModel(
                f"rope_type {_rope_parameters(hf)['rope_type']!r} scales attention by {attention_scaling}"
            )
        model.rotary_pos_emb.inv_freq = inv_freq
    _mark_split_weights(model, config)
    _cast_to_params_dtype(model, config.params_dtype)
    if post_process and not config.sequence_parallel:
        _batch_first_logits(model.output_layer)
    return model


def _batch_first_logits(output_layer: torch.nn.Module) -> None:
    """Have the output layer compute ``[b, s, V]`` logits, handed on as an ``[s, b, V]`` view.

    ``GPTModel`` returns ``logits.transpose(0, 1).contiguous()``: for ``[s, b, V]`` logits a copy of the
    largest tensor of the step (2.5 GB for 8 x 1024 tokens of a 152k vocabulary), and its backward
    another one to make the gradient contiguous for the weight-gradient GEMM, 6 ms of a 1.5B step on
    an H200. Transposing the hidden states instead moves a ``V / h`` times smaller tensor, and the
    final ``.contiguous()`` finds the logits already in order. Not under sequence parallel: there the
    layer gathers its input along the sequence dimension.
    """

    def hidden_batch_first(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        hidden, *rest = args
        return (hidden.transpose(0, 1).contiguous(), *rest), kwargs

    def logits_sequence_first(module: torch.nn.Module, args: tuple[Any, ...], output: Any) -> Any:
        logits, bias = output
        return logits.transpose(0, 1), bias

    output_layer.register_forward_pre_hook(hidden_batch_first, with_kwargs=True)
    output_layer.register_forward_hook(logits_sequence_first)


def _cast_to_params_dtype(model: GPTModel, dtype: torch.dtype) -> None:
    """Every weight in ``dtype``, as megatron's ``Float16Module`` leaves them for its own training loop.

    Without TransformerEngine the norms are torch's, built in the default float32: a bf16 activation
    through a float32 norm weight misses torch's fused RMSNorm kernel.
    """
    for parameter in model.parameters():
        if parameter.is_floating_point() and parameter.dtype != dtype:
            parameter.data = parameter.data.to(dtype)


def _mark_split_weights(model: GPTModel, config: TransformerConfig) -> None:
    """Tag each tensor-parallel weight as split, as megatron's weight initialisers do.

    With ``perform_initialization=False`` (every weight comes from the checkpoint) megatron-core 0.16
    skips the initialisers and with them these tags; the optimizer then takes split weights for
    copies and counts only tensor rank 0's part in the gradient norm.
    """
    for name, module in model.named_modules():
        if isinstance(module, ColumnParallelLinear | VocabParallelEmbedding):
            dim = 0
        elif isinstance(module, RowParallelLinear):
            dim = 1
        else:
            continue
        weight = getattr(module, "weight", None)
        if weight is None or hasattr(weight, "tensor_model_parallel"):
            continue
        # gated MLPs hold [gate; up] rows per rank (see sharding.py): megatron's stride 2
        stride = 2 if name.endswith("linear_fc1") and config.gated_linear_unit else 1
        set_tensor_model_parallel_attributes(weight, True, dim, stride)
