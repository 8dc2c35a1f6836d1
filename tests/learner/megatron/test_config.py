"""The megatron layout is checked when it is made: sizes, combinations, role overrides, model fit."""

from __future__ import annotations

import json

import pytest
import typer
from transformers import DeepseekV3Config, Qwen2Config, Qwen3MoeConfig

from learner.megatron_config import MegatronConfig, check_model
from learner.round_settings import check_learner_settings
from learner.trainers import TrainConfig
from tandem.commands.load_settings import load_settings
from tandem.settings import Settings


def test_defaults_are_one_device_with_nothing_split() -> None:
    config = MegatronConfig()
    assert (config.tensor_parallel, config.pipeline_parallel, config.data_parallel) == (1, 1, 1)
    assert TrainConfig().megatron == config and TrainConfig().backend == "torch"


def test_a_full_layout_divides_the_devices() -> None:
    config = MegatronConfig(
        devices=16,
        tensor_parallel=2,
        pipeline_parallel=2,
        expert_parallel=4,
        distributed_optimizer=True,
        optimizer_cpu_offload=True,
        recompute="full",
        recompute_num_layers=2,
        bf16=True,
        max_tokens_per_device=8192,
    )
    assert config.data_parallel == 4


def test_context_parallel_combines_with_the_other_sizes() -> None:
    config = MegatronConfig(devices=16, tensor_parallel=2, pipeline_parallel=2, context_parallel=2)
    assert config.data_parallel == 2
    with pytest.raises(ValueError, match=r"devices=6 is not a multiple of .* = 2 x 1 x 4 = 8"):
        MegatronConfig(devices=6, tensor_parallel=2, context_parallel=4)


def test_a_custom_loss_is_refused_with_context_parallel() -> None:
    plugin = "tests.learner.plugins_examples:loss_vanilla_policy_gradient"
    layout = MegatronConfig(devices=2, context_parallel=2)
    with pytest.raises(ValueError, match=r"custom_loss_path\) cannot run with context_parallel > 1: .*\[T, V\] logits"):
        TrainConfig(backend="megatron", megatron=layout, custom_loss_path=plugin)
    TrainConfig(backend="megatron", megatron=layout)  # the built-in losses gather per-token scores
    TrainConfig(backend="megatron", megatron=MegatronConfig(devices=2), custom_loss_path=plugin)
    TrainConfig(backend="torch", megatron=layout, custom_loss_path=plugin)  # the layout is not used


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"devices": 6, "tensor_parallel": 4}, "devices=6 is not a multiple of tensor_parallel x pipeline_parallel"),
        ({"devices": 4, "expert_parallel": 8}, "not a multiple of expert_parallel x tensor_parallel"),
        ({"sequence_parallel": True}, "sequence_parallel needs tensor_parallel > 1"),
        (
            {"sequence_parallel": True, "devices": 2, "tensor_parallel": 2},
            "sequence_parallel needs TransformerEngine or Apex",
        ),
        ({"optimizer_cpu_offload": True}, "optimizer_cpu_offload needs distributed_optimizer"),
        ({"optimizer_offload_fraction": 0.0}, "optimizer_offload_fraction must be in (0, 1], got 0.0"),
        ({"optimizer_offload_fraction": 1.5}, "optimizer_offload_fraction must be in (0, 1], got 1.5"),
        ({"recompute": "sometimes"}, "recompute must be one of"),
        ({"recompute_num_layers": 2}, "recompute_num_layers applies only to recompute='full'"),
        ({"tensor_parallel": 0}, "sizes must be integers >= 1 (tensor_parallel=0)"),
        ({"max_tokens_per_device": 0}, "max_tokens_per_device must be >= 1"),
    ],
)
def test_invalid_combinations_fail_with_the_reason(values: dict[str, object], message: str) -> None:
    with pytest.raises(
        ValueError, match="invalid megatron config: .*" + message.replace("(", r"\(").replace(")", r"\)")
    ):
        MegatronConfig(**values)  # type: ignore[arg-type]


def test_every_problem_is_reported_at_once() -> None:
    with pytest.raises(ValueError) as raised:
        MegatronConfig(sequence_parallel=True, optimizer_cpu_offload=True, recompute_num_layers=3)
    assert str(raised.value).count(";") == 3  # sequence parallel twice: no tensor parallel, no fused norm


def test_role_overrides_resolve_and_are_checked() -> None:
    config = MegatronConfig(
        recompute="full",
        roles={"critic": {"recompute": "none", "max_tokens_per_device": 2048}, "reference": {"bf16": True}},
    )
    assert config.for_role("actor").recompute == "full"
    critic = config.for_role("critic")
    assert (critic.recompute, critic.max_tokens_per_device, critic.roles) == ("none", 2048, {})
    assert config.for_role("reference").bf16
    with pytest.raises(ValueError, match="unknown role 'judge'"):
        MegatronConfig(roles={"judge": {}})
    with pytest.raises(ValueError, match=r"roles.critic: cannot override \['tensor_parallel'\]"):
        MegatronConfig(devices=2, roles={"critic": {"tensor_parallel": 2}})
    with pytest.raises(ValueError, match=r"roles\.critic: recompute_num_layers applies only"):
        MegatronConfig(roles={"critic": {"recompute_num_layers": 2}})


def test_from_dict_refuses_unknown_keys_and_round_trips() -> None:
    with pytest.raises(ValueError, match=r"unknown keys \['tp'\]"):
        MegatronConfig.from_dict({"tp": 2})
    config = MegatronConfig(devices=4, tensor_parallel=2, roles={"critic": {"bf16": True}})
    assert MegatronConfig.from_dict(json.loads(json.dumps(config.to_dict()))) == config
    assert TrainConfig(megatron=config.to_dict()).megatron == config  # type: ignore[arg-type]


def test_the_layout_must_fit_the_model() -> None:
    dense = Qwen2Config(num_attention_heads=6, num_key_value_heads=2, num_hidden_layers=3, vocab_size=1001)
    with pytest.raises(ValueError) as raised:
        check_model(MegatronConfig(devices=8, tensor_parallel=4, pipeline_parallel=2, expert_parallel=1), dense)
    message = str(raised.value)
    for part in ("num_attention_heads=6", "num_key_value_heads=2", "vocab_size=1001", "num_hidden_layers=3"):
        assert part in message
    with pytest.raises(ValueError, match="expert_parallel=2 needs a mixture-of-experts model"):
        check_model(MegatronConfig(devices=2, expert_parallel=2), Qwen2Config())
    moe = Qwen3MoeConfig(num_experts=6)
    with pytest.raises(ValueError, match="6 experts are not divisible by expert_parallel=4"):
        check_model(MegatronConfig(devices=4, expert_parallel=4), moe)
    check_model(MegatronConfig(devices=2, expert_parallel=2), moe)
    mla = DeepseekV3Config(q_lora_rank=6, kv_lora_rank=6, qk_rope_head_dim=4)
    with pytest.raises(ValueError) as raised:
        check_model(MegatronConfig(devices=4, tensor_parallel=4), mla)
    assert "q_lora_rank=6" in str(raised.value) and "kv_lora_rank + qk_rope_head_dim = 10" in str(raised.value)
    check_model(MegatronConfig(devices=2, tensor_parallel=2), mla)


def test_commands_refuse_an_invalid_layout_at_start_up(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TANDEM_LEARN_BACKEND", "megatron")
    monkeypatch.setenv("TANDEM_LEARN_MEGATRON", '{"devices": 2, "tensor_parallel": 2, "recompute": "full"}')
    settings = load_settings("test")
    assert settings.learner.backend == "megatron" and settings.learner.megatron["tensor_parallel"] == 2
    monkeypatch.setenv("TANDEM_LEARN_MEGATRON", '{"sequence_parallel": true}')
    with pytest.raises(ValueError, match="sequence_parallel needs tensor_parallel > 1"):
        check_learner_settings(Settings())
    with pytest.raises(typer.Exit):
        load_settings("test")
    monkeypatch.setenv("TANDEM_LEARN_MEGATRON", '{"devices": 2, "context_parallel": 2}')
    assert load_settings("test").learner.megatron["context_parallel"] == 2
    monkeypatch.setenv("TANDEM_LEARN_CUSTOM_LOSS_PATH", "tests.learner.plugins_examples:loss_vanilla_policy_gradient")
    with pytest.raises(ValueError, match="cannot run with context_parallel > 1"):
        check_learner_settings(Settings())
