"""The megatron trainer against the torch trainer on the same batch: loss, gradients, Adam step, export."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, PreTrainedModel

from learner.algorithms import PolicyLossConfig
from learner.megatron.backend import MegatronPolicy, OptimizerSettings
from learner.megatron.hf_convert import to_hf
from learner.megatron.runtime import parallel
from learner.megatron_config import MegatronConfig
from learner.trainers import TrainConfig, TrainingDiverged, compute_advantages, train_step
from learner.trainers.checkpoint import checkpoint_dtype, export_state_dict
from tests.fixtures.tiny_model import tiny_model_path
from tests.learner.megatron.conftest import MOE, random_hf, saved_state
from tests.learner.trainers.conftest import random_samples

CONFIGS = {
    "sample_mean+entropy, micro-batched": TrainConfig(
        loss=PolicyLossConfig(entropy_coef=0.01), clip_grad=None, max_tokens_per_micro_batch=24
    ),
    "token_mean+tis": TrainConfig(loss=PolicyLossConfig(reduction="token_mean", use_tis=True), clip_grad=None),
    "kl to a reference": TrainConfig(
        loss=PolicyLossConfig(kl_loss_coef=0.1, kl_loss_type="low_var_kl"), clip_grad=None
    ),
    "custom loss": TrainConfig(
        clip_grad=None,
        max_tokens_per_micro_batch=24,
        custom_loss_path="tests.learner.plugins_examples:loss_vanilla_policy_gradient",
    ),
}


class GradientRecorder(torch.optim.SGD):
    """An optimizer whose step keeps the gradients it was given and changes nothing."""

    def __init__(self, model: PreTrainedModel) -> None:
        super().__init__(model.parameters(), lr=0.0)
        self.named = dict(model.named_parameters())
        self.grads: dict[str, torch.Tensor] = {}

    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        self.grads = {name: p.grad.clone() for name, p in self.named.items() if p.grad is not None}


@pytest.fixture(scope="module")
def base_dir() -> Path:
    return tiny_model_path()


def load_torch(base_dir: Path) -> PreTrainedModel:
    return AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32, attn_implementation="sdpa")


@pytest.fixture
def layout() -> Iterator[MegatronConfig]:
    config = MegatronConfig()
    with parallel(config):
        yield config


def policy_grads(policy: MegatronPolicy) -> dict[str, torch.Tensor]:
    """Every tensor's gradient under its HF name: zero for saved buffers (DeepSeek-V3's routing bias)."""
    state = policy.model.state_dict()
    grads = {name: torch.zeros_like(t) for name, t in state.items() if not name.endswith("_extra_state")}
    return to_hf(grads | {name: p.main_grad for name, p in policy.model.named_parameters()}, policy.hf)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_same_loss_and_gradients_as_the_torch_backend(base_dir: Path, layout: MegatronConfig, name: str) -> None:
    config = CONFIGS[name]
    samples = random_samples(8, seed=3, with_log_probs=True)
    model = load_torch(base_dir)
    recorder = GradientRecorder(model)
    reference = load_torch(base_dir).requires_grad_(False)
    if config.loss.kl_loss_coef:  # the reference must differ from the policy for a non-zero KL
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.01)
        trained_dir = base_dir.parent / f"{base_dir.name}-kl-perturbed"
        if not trained_dir.exists():
            export = {n: t.detach().to(checkpoint_dtype(base_dir)) for n, t in model.state_dict().items()}
            export_state_dict(export, base_dir, trained_dir, dtype=checkpoint_dtype(base_dir))
        model = load_torch(trained_dir)
        recorder = GradientRecorder(model)
    else:
        trained_dir = base_dir
    expected = train_step(model, recorder, samples, config, ref_model=reference)

    policy = MegatronPolicy(trained_dir, layout, optimizer=OptimizerSettings(1e-3, clip_grad=None))
    ref = MegatronPolicy(base_dir, layout) if config.loss.kl_loss_coef else None
    totals = policy.accumulate_gradients(samples, config, ref=ref)
    assert set(totals) == set(expected) - {"grad_norm", "perf/tokens_per_sec"} - {
        k for k in expected if k.startswith("rollout/")
    }
    for key, value in totals.items():
        assert value == pytest.approx(expected[key], rel=1e-5, abs=1e-6), key
    grads = policy_grads(policy)
    assert grads.keys() == recorder.grads.keys()
    for key, grad in recorder.grads.items():
        torch.testing.assert_close(grads[key], grad, rtol=1e-4, atol=1e-7, msg=key)
    assert policy.apply_gradients() == pytest.approx(expected["grad_norm"], rel=1e-5)


def per_expert(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers' fused expert tensors (``experts.gate_up_proj`` [E, 2I, H], ``experts.down_proj``
    [E, H, I]) as it saves them: a gate, up and down projection per expert."""
    out = {}
    for name, tensor in tensors.items():
        base, _, kind = name.rpartition("experts.")
        if kind == "gate_up_proj":
            for j, rows in enumerate(tensor):
                gate, up = rows.chunk(2)
                out |= {f"{base}experts.{j}.gate_proj.weight": gate, f"{base}experts.{j}.up_proj.weight": up}
        elif kind == "down_proj":
            out |= {f"{base}experts.{j}.down_proj.weight": rows for j, rows in enumerate(tensor)}
        else:
            out[name] = tensor
    return out


@pytest.fixture(scope="module", params=sorted(MOE))
def moe_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random mixture-of-experts model (Qwen3-MoE, DeepSeek-V3) saved in float32."""
    folder = tmp_path_factory.mktemp(request.param)
    saved_state(random_hf(MOE[request.param]()), folder)
    return folder


def test_moe_models_give_the_torch_backends_loss_and_gradients(moe_dir: Path, layout: MegatronConfig) -> None:
    # Auxiliary losses are off in both (transformers adds one only with output_router_logits);
    # DeepSeek-V3's routing bias stays as loaded in both.
    config = TrainConfig(loss=PolicyLossConfig(entropy_coef=0.01), clip_grad=None, max_tokens_per_micro_batch=24)
    samples = random_samples(8, seed=3, with_log_probs=True, vocab=256)
    model = load_torch(moe_dir)
    recorder = GradientRecorder(model)
    expected = train_step(model, recorder, samples, config)

    policy = MegatronPolicy(moe_dir, layout, optimizer=OptimizerSettings(1e-3, clip_grad=None))
    totals = policy.accumulate_gradients(samples, config)
    for key, value in totals.items():
        assert value == pytest.approx(expected[key], rel=1e-5, abs=1e-6), key
    grads, expected_grads = policy_grads(policy), per_expert(recorder.grads)
    assert expected_grads.keys() <= grads.keys()
    for key, grad in grads.items():  # buffers (DeepSeek-V3's routing bias) have none in torch
        torch.testing.assert_close(grad, expected_grads.get(key, torch.zeros_like(grad)), rtol=1e-4, atol=1e-7, msg=key)
    assert policy.apply_gradients() == pytest.approx(expected["grad_norm"], rel=1e-5)


def test_an_adam_step_matches_torch_adamw_and_exports(base_dir: Path, layout: MegatronConfig, tmp_path: Path) -> None:
    samples = random_samples(6, seed=1)
    config = TrainConfig(max_tokens_per_micro_batch=32, clip_grad=0.5)
    model = load_torch(base_dir)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    expected = train_step(model, optimizer, samples, config)

    policy = MegatronPolicy(base_dir, layout, optimizer=OptimizerSettings(1e-3, clip_grad=0.5))
    metrics = policy.train_step(samples, config)
    assert metrics.keys() == expected.keys()
    assert metrics["loss"] == pytest.approx(expected["loss"], rel=1e-5, abs=1e-7)
    assert metrics["grad_norm"] == pytest.approx(expected["grad_norm"], rel=1e-5)
    state = policy.hf_state()
    assert state is not None
    base = load_torch(base_dir).state_dict()
    for name, tensor in model.state_dict().items():
        # Adam's first step is about lr x sign(gradient): where a gradient is rounding noise (a key
        # bias shifts a row's scores alike, so softmax ignores it) its sign is noise too. Compare the
        # update of each tensor as a whole.
        if name.endswith("k_proj.bias"):
            continue
        expected_update, update = tensor - base[name], state[name] - base[name]
        assert float((update - expected_update).norm() / expected_update.norm()) < 1e-2, name

    result = export_state_dict(state, base_dir, tmp_path / "trained", dtype=checkpoint_dtype(base_dir))
    base, trained = load_file(base_dir / "model.safetensors"), load_file(result.path / "model.safetensors")
    assert trained.keys() == base.keys() and all(trained[k].dtype == base[k].dtype for k in base)
    assert any(not torch.equal(trained[k], base[k]) for k in base)
    reloaded = AutoModelForCausalLM.from_pretrained(result.path)
    assert reloaded.dtype == torch.bfloat16


def test_a_nan_loss_is_refused_and_nothing_moves(base_dir: Path, layout: MegatronConfig) -> None:
    samples = random_samples(4)
    policy = MegatronPolicy(base_dir, layout, optimizer=OptimizerSettings(1e-1))
    before = {n: p.detach().clone() for n, p in policy.model.named_parameters()}
    advantages = compute_advantages(samples, TrainConfig())
    advantages[1] = math.nan
    with pytest.raises(TrainingDiverged, match="loss is nan"):
        policy.train_step(samples, TrainConfig(max_tokens_per_micro_batch=16), advantages=advantages)
    assert all(torch.equal(before[n], p) for n, p in policy.model.named_parameters())
    assert all(float(p.main_grad.abs().sum()) == 0 for p in policy.model.parameters())


LAYOUTS = {
    "recompute full": MegatronConfig(recompute="full"),
    "recompute selective": MegatronConfig(recompute="selective"),
    "distributed optimizer": MegatronConfig(distributed_optimizer=True),
}


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_layout_options_give_the_same_step(base_dir: Path, name: str) -> None:
    samples = random_samples(6, seed=2)
    config = TrainConfig(max_tokens_per_micro_batch=24)
    results = []
    for layout in (MegatronConfig(), LAYOUTS[name]):
        with parallel(layout):
            policy = MegatronPolicy(base_dir, layout, optimizer=OptimizerSettings(1e-3))
            metrics = policy.train_step(samples, config)
            results.append((metrics, policy.hf_state()))
    (plain, plain_state), (other, other_state) = results
    assert other["loss"] == pytest.approx(plain["loss"], rel=1e-5)
    assert other["grad_norm"] == pytest.approx(plain["grad_norm"], rel=1e-5)
    assert plain_state is not None and other_state is not None
    for key, tensor in plain_state.items():
        torch.testing.assert_close(other_state[key], tensor, rtol=0, atol=1e-6, msg=key)


def test_bf16_trains_close_to_float32(base_dir: Path) -> None:
    samples = random_samples(6, seed=2)
    config = TrainConfig(max_tokens_per_micro_batch=24)
    losses = []
    for layout in (MegatronConfig(), MegatronConfig(bf16=True)):
        with parallel(layout):
            policy = MegatronPolicy(base_dir, layout, optimizer=OptimizerSettings(1e-3))
            dtypes = {p.dtype for p in policy.model.parameters()}
            assert dtypes == {torch.bfloat16 if layout.bf16 else torch.float32}  # the norms too
            losses.append([policy.train_step(samples, config)["loss"] for _ in range(2)])
    assert losses[1] == pytest.approx(losses[0], abs=0.02)


def test_old_log_probs_equal_the_torch_backends(base_dir: Path, layout: MegatronConfig) -> None:
    from learner.trainers import response_log_probs

    samples = random_samples(5, seed=4)
    expected = response_log_probs(load_torch(base_dir), samples, 24)
    policy = MegatronPolicy(base_dir, layout)
    got = policy.response_log_probs(samples, TrainConfig(max_tokens_per_micro_batch=24))
    for mine, theirs in zip(got, expected, strict=True):
        assert mine is not None
        torch.testing.assert_close(mine, theirs, rtol=0, atol=1e-5)


def test_max_tokens_per_device_overrides_the_train_configs_cap(base_dir: Path) -> None:
    samples = random_samples(6, seed=2)
    layout = dataclasses.replace(MegatronConfig(), max_tokens_per_device=3)  # shorter than every sample
    with parallel(layout):
        policy = MegatronPolicy(base_dir, layout, optimizer=OptimizerSettings(1e-3))
        with pytest.raises(ValueError, match="exceed max_tokens_per_device=3"):
            policy.train_step(samples, TrainConfig(max_tokens_per_micro_batch=4096))


def test_cpu_offload_needs_a_gpu() -> None:
    layout = MegatronConfig(distributed_optimizer=True, optimizer_cpu_offload=True)
    with pytest.raises(ValueError, match="this process has no GPU"), parallel(layout):
        pass
