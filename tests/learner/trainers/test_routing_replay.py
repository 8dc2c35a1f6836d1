"""Routing replay (R3) on a tiny random Qwen3-MoE: the local engine records which experts every token
went through, and training computes the rollout's log-probs through those experts even after the
router has moved (without replay, the moved router sends the tokens elsewhere)."""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

from learner.batching import PackingError, collate_micro_batch, pack_samples
from learner.rollout import RolloutConfig, rollout_groups
from learner.sample import Sample
from learner.slime_args import slime_args
from learner.trainers import response_log_probs
from learner.trainers.torch_backend import forward_logits
from server.app import create_app
from server.engines.base import SamplingParams
from server.engines.local.engine import LocalEngine
from server.engines.sglang_client import SGLangClient
from server.engines.sglang_server import create_engine_app
from tandem.moe_routing import RouteRecorder, moe_routers
from tests.fixtures.tiny_model import tiny_model_path
from tests.server.conftest import ADMIN_KEY, gateway_settings
from tests.support.uvicorn_thread import serve_in_thread

LAYERS, EXPERTS, TOP_K = 2, 32, 2
PROMPT = [5, 17, 260, 99, 1024, 7]


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("tiny-moe")
    tokenizer_source = tiny_model_path()
    config = Qwen3MoeConfig(
        vocab_size=2048,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_experts=EXPERTS,
        num_experts_per_tok=TOP_K,
        norm_topk_prob=True,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(config)
    with torch.no_grad():  # experts that matter: at init their output is small beside the residual
        for layer in model.model.layers:
            layer.mlp.experts.down_proj.mul_(20)
    model.save_pretrained(folder)
    for name in tokenizer_source.iterdir():
        if name.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(name, folder / name.name)
    return folder


async def _rollout(model: Path) -> tuple[list[int], list[float], list[list[int]]]:
    engine = await LocalEngine.open(model, torch_threads=1)
    try:
        sampling = SamplingParams(max_new_tokens=10, temperature=0, ignore_eos=True, return_routed_experts=True)
        output, logprobs, routes = [], [], None
        async for chunk in engine.generate(PROMPT, sampling, session_key="s", cache_salt="t"):
            output += chunk.token_ids
            logprobs += chunk.logprobs
            routes = chunk.routed_experts if chunk.finish else routes
    finally:
        await engine.close()
    assert routes is not None
    return output, logprobs, routes


async def test_training_replays_the_rollouts_routing_after_the_router_moved(tiny_moe: Path) -> None:
    output, rollout_log_probs, routes = await _rollout(tiny_moe)
    tokens = PROMPT + output
    assert len(routes) == len(tokens) - 1 and {len(row) for row in routes} == {LAYERS * TOP_K}

    model = AutoModelForCausalLM.from_pretrained(tiny_moe, dtype=torch.float32).eval()
    recorder = RouteRecorder(model)
    with torch.no_grad(), recorder.recording() as whole:
        model(input_ids=torch.tensor([tokens[:-1]]))
    assert whole[0].tolist() == routes  # decoding token by token routed as one forward over them all

    sample = Sample(prompt_token_ids=PROMPT, response_token_ids=output, rollout_routed_experts=routes)
    unrecorded = dataclasses.replace(sample, rollout_routed_experts=None)
    rollout = torch.tensor(rollout_log_probs)

    def trained(s: Sample) -> torch.Tensor:
        return response_log_probs(model, [s], 4096)[0]

    assert torch.allclose(trained(sample), rollout, atol=1e-4)
    assert torch.allclose(trained(unrecorded), rollout, atol=1e-4)

    # The router moves: every expert no token went to (in a layer) now outbids the chosen ones.
    chosen = torch.tensor(routes).view(len(routes), LAYERS, TOP_K)
    with torch.no_grad():
        for layer, router in enumerate(moe_routers(model)):
            unused = sorted(set(range(EXPERTS)) - set(chosen[:, layer].flatten().tolist()))
            router.weight[unused] = 50 * torch.randn(len(unused), router.weight.shape[1])
    moved = (trained(unrecorded) - rollout).abs().max()
    replayed = (trained(sample) - rollout).abs().max()
    print(f"largest log-prob difference from the rollout's: {moved:.3f} unreplayed, {replayed:.2e} replayed")
    assert moved > 0.05, moved  # other experts: another policy
    assert replayed < 1e-4, replayed  # the rollout's experts, weighted by the moved router: the same


def test_routes_that_do_not_fit_the_sample_are_refused(tiny_moe: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_moe, dtype=torch.float32)
    short = Sample(prompt_token_ids=PROMPT, response_token_ids=[3, 4], rollout_routed_experts=[[0, 1, 2, 3]] * 3)
    with pytest.raises(PackingError, match=r"rollout_routed_experts is \[3, 4\], expected \[7, 4\]"):
        response_log_probs(model, [short], 4096)


async def test_the_router_still_learns_under_replay(tiny_moe: Path) -> None:
    output, _, routes = await _rollout(tiny_moe)
    model = AutoModelForCausalLM.from_pretrained(tiny_moe, dtype=torch.float32)
    sample = Sample(prompt_token_ids=PROMPT, response_token_ids=output, rollout_routed_experts=routes)
    batch = collate_micro_batch([sample], pack_samples([sample], 4096)[0])
    forward_logits(model, batch).logsumexp(-1).sum().backward()
    assert all(router.weight.grad is not None and router.weight.grad.abs().sum() > 0 for router in moe_routers(model))


@pytest.mark.parametrize(
    "generate", [None, "slime.rollout.sglang_rollout.generate"], ids=["rollouts", "slime-generate"]
)
def test_rollouts_through_the_gateway_carry_routes_that_replay_exactly(
    tiny_moe: Path, tmp_path: Path, generate: str | None
) -> None:
    """A round's rollouts with routing_replay (tandem's own, or slime's default generate function
    through the learner's router): the engine is asked for routes, the samples keep them, and their
    training log-probs through them are the rollout's."""
    settings = gateway_settings(tmp_path, tiny_moe, admin_key=ADMIN_KEY)
    config = RolloutConfig(n_samples_per_prompt=2, max_new_tokens=6, routing_replay=True, custom_generate_path=generate)
    with serve_in_thread(create_app(settings)) as url:
        # What a round hands plugins: the serving checkpoint too (slime's generate reads its tokenizer).
        args = slime_args(config.slime_args(), server_url=url, admin_key=ADMIN_KEY, hf_checkpoint=str(tiny_moe))
        (group,) = rollout_groups(url, ADMIN_KEY, [Sample(prompt_token_ids=PROMPT)], config, args=args)
    model = AutoModelForCausalLM.from_pretrained(tiny_moe, dtype=torch.float32)
    for sample in group:
        assert sample.rollout_routed_experts is not None
        assert len(sample.rollout_routed_experts) == sample.total_length - 1
        trained = response_log_probs(model, [sample], 4096)[0]
        assert torch.allclose(trained, torch.tensor(sample.rollout_log_probs), atol=1e-4)
    unasked = RolloutConfig(n_samples_per_prompt=1, max_new_tokens=2)
    with serve_in_thread(create_app(settings)) as url:
        (group,) = rollout_groups(url, ADMIN_KEY, [Sample(prompt_token_ids=PROMPT)], unasked)
    assert group[0].rollout_routed_experts is None


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
async def test_an_sglang_style_engine_server_returns_the_routes(tiny_moe: Path, stream: bool) -> None:
    """`tandem engine`'s /generate answers return_routed_experts in SGLang's meta_info form, and the
    gateway's SGLang client reads them back as the in-process engine records them."""
    _, _, direct = await _rollout(tiny_moe)
    app = create_engine_app(lambda: LocalEngine.open(tiny_moe, torch_threads=1))
    with serve_in_thread(app) as url:
        client = await SGLangClient.open(url)
        try:
            sampling = SamplingParams(max_new_tokens=10, temperature=0, ignore_eos=True, return_routed_experts=True)
            chunks = [chunk async for chunk in client.generate(PROMPT, sampling, stream=stream)]
        finally:
            await client.close()
    assert chunks[-1].routed_experts == direct
    assert all(chunk.routed_experts is None for chunk in chunks[:-1])
