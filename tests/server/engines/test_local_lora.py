"""LoRA adapters in the local engine, checked against ``peft`` itself: adapters made and saved by
peft, served side by side in one batch, must give each row what peft's model gives for that adapter."""

from __future__ import annotations

import asyncio
import json
import shutil
from collections.abc import Iterator
from functools import cache
from pathlib import Path

import aiohttp
import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM, AutoTokenizer

from server.engines.base import AdapterRef, SamplingParams
from server.engines.local.engine import LocalEngine
from server.engines.local.lora import AdapterCache, AdapterError, check_adapter_folder, read_adapter
from server.engines.sglang_client import SGLangClient
from server.engines.sglang_server import create_engine_app
from tests.server.engines.helpers import collect, greedy, greedy_reference
from tests.support.uvicorn_thread import serve_in_thread

TARGETS = (["q_proj", "v_proj"], ["q_proj", "k_proj", "v_proj", "o_proj"], ["gate_proj", "up_proj", "down_proj"])


def make_adapter(base: Path, folder: Path, seed: int, targets: list[str], rank: int = 4, **extra: object) -> Path:
    """A peft LoRA with random A and B (peft's default B is zero, which would change nothing)."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets, init_lora_weights=False, **extra)
    peft_model = get_peft_model(model, config)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_" in name:
                param.mul_(4.0)  # big enough to change greedy answers of the tiny model
    peft_model.save_pretrained(folder)
    return folder


@cache
def peft_reference(base: Path, adapter: Path) -> PeftModel:
    return PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), adapter).eval()


@torch.no_grad()
def peft_greedy(base: Path, adapter: Path, prompt: list[int], new_tokens: int) -> list[int]:
    out = peft_reference(base, adapter).generate(
        input_ids=torch.tensor([prompt]),
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        eos_token_id=None,
    )
    return out[0, len(prompt) :].tolist()


@pytest.fixture(scope="module")
def adapters(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    root = tmp_path_factory.mktemp("adapters")
    return [make_adapter(tiny_model, root / f"a{i}", seed=i, targets=t) for i, t in enumerate(TARGETS)]


@pytest.fixture(scope="module")
def prompts(tiny_model: Path) -> list[list[int]]:
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    texts = ["hello there, how are you?", "name a colour", "what is two plus two?", "tell me a story"]
    return [
        tokenizer.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True, return_dict=False)
        for t in texts
    ]


def ref(folder: Path) -> AdapterRef:
    return AdapterRef(key=folder.name, path=str(folder))


async def test_each_row_of_a_mixed_batch_decodes_with_its_own_adapter(
    engine: LocalEngine, tiny_model: Path, adapters: list[Path], prompts: list[list[int]]
) -> None:
    jobs = [(prompts[i], adapters[i] if i < len(adapters) else None) for i in range(len(prompts))]
    jobs += [(prompts[0], adapters[1]), (prompts[1], None)]  # one prompt, two adapters; the base too
    results = await asyncio.gather(
        *(collect(engine, prompt, greedy(12), adapter=ref(a) if a else None) for prompt, a in jobs)
    )
    for (prompt, adapter), result in zip(jobs, results, strict=True):
        want = peft_greedy(tiny_model, adapter, prompt, 12) if adapter else greedy_reference(tiny_model, prompt, 12)
        assert result.token_ids == want, adapter
    # The adapters do change the answers: the check above could not pass by ignoring them.
    assert peft_greedy(tiny_model, adapters[0], prompts[0], 12) != greedy_reference(tiny_model, prompts[0], 12)
    assert engine.adapters.loads == len(adapters)  # each folder read once, then served from memory


async def test_chunks_name_their_adapter(engine: LocalEngine, adapters: list[Path], prompts: list[list[int]]) -> None:
    seen = [chunk.adapter async for chunk in engine.generate(prompts[0], greedy(3), adapter=ref(adapters[0]))]
    assert set(seen) == {adapters[0].name}
    assert {chunk.adapter async for chunk in engine.generate(prompts[0], greedy(3))} == {None}


async def test_a_session_prefix_is_not_reused_across_adapters(
    engine: LocalEngine, tiny_model: Path, adapters: list[Path], prompts: list[list[int]]
) -> None:
    first = await collect(engine, prompts[0], greedy(6), session_key="s", adapter=ref(adapters[0]))
    follow_up = prompts[0] + first.token_ids + prompts[1]
    other = await collect(engine, follow_up, greedy(6), session_key="s", adapter=ref(adapters[1]))
    assert other.cached_tokens == 0
    assert other.token_ids == peft_greedy(tiny_model, adapters[1], follow_up, 6)
    again = await collect(engine, follow_up, greedy(6), session_key="s", adapter=ref(adapters[0]))
    assert again.cached_tokens > 0 and again.token_ids == peft_greedy(tiny_model, adapters[0], follow_up, 6)


async def test_a_folder_that_is_not_a_plain_lora_is_refused(
    engine: LocalEngine, tiny_model: Path, tmp_path: Path, prompts: list[list[int]]
) -> None:
    dora = make_adapter(tiny_model, tmp_path / "dora", seed=7, targets=["q_proj"], use_dora=True)
    with pytest.raises(AdapterError, match="DoRA"):
        await collect(engine, prompts[0], greedy(2), adapter=ref(dora))
    with pytest.raises(AdapterError, match="not a PEFT adapter folder"):
        await collect(engine, prompts[0], greedy(2), adapter=AdapterRef("missing", str(tmp_path / "missing")))
    other_model = make_adapter(tiny_model, tmp_path / "wide", seed=8, targets=["q_proj"])
    config = json.loads((other_model / "adapter_config.json").read_text())
    (other_model / "adapter_config.json").write_text(json.dumps({**config, "bias": "all"}))
    with pytest.raises(AdapterError, match="trained biases"):
        await collect(engine, prompts[0], greedy(2), adapter=ref(other_model))
    assert (await collect(engine, prompts[0], greedy(2))).finish is not None  # the engine serves on


def test_the_model_free_check_refuses_what_loading_refuses(
    tiny_model: Path, adapters: list[Path], tmp_path: Path
) -> None:
    """The admin API checks a folder with check_adapter_folder before recording it: it must refuse
    every folder read_adapter refuses for reasons that need no model, with the same reason."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    config = json.loads((adapters[0] / "adapter_config.json").read_text())

    def variant(name: str, config_text: str | None = None, weights: bytes | None = None) -> Path:
        folder = shutil.copytree(adapters[0], tmp_path / name)
        if config_text is not None:
            (folder / "adapter_config.json").write_text(config_text)
        if weights is not None:
            (folder / "adapter_model.safetensors").write_bytes(weights)
        return folder

    cases = {
        "missing": tmp_path / "missing",
        "dora": make_adapter(tiny_model, tmp_path / "dora", seed=9, targets=["q_proj"], use_dora=True),
        "prompt": variant("prompt", json.dumps({**config, "peft_type": "PROMPT_TUNING"})),
        "no-alpha": variant("no-alpha", json.dumps({k: v for k, v in config.items() if k != "lora_alpha"})),
        "rank-text": variant("rank-text", json.dumps({**config, "r": "4"})),
        "list": variant("list", "[]"),
        "truncated": variant("truncated", weights=(adapters[0] / "adapter_model.safetensors").read_bytes()[:20]),
        "empty": variant("empty", weights=b""),
    }
    for name, folder in cases.items():
        with pytest.raises(AdapterError) as checked:
            check_adapter_folder(folder)
        with pytest.raises(AdapterError) as loaded:
            read_adapter(name, folder, model)
        assert str(checked.value) == str(loaded.value), name
    for folder in adapters:
        check_adapter_folder(folder)
        assert read_adapter(folder.name, folder, model).modules


def test_the_cache_keeps_the_most_recent_adapters_within_its_bytes(tiny_model: Path, adapters: list[Path]) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    sizes = [read_adapter(a.name, a, model).nbytes for a in adapters]
    cache = AdapterCache(capacity_bytes=sizes[1] + sizes[2])
    for folder in adapters:
        cache.get(folder.name, folder, model)
    assert cache.resident == [adapters[1].name, adapters[2].name] and cache.loads == 3
    cache.get(adapters[1].name, adapters[1], model)  # a hit: now the most recent
    cache.get(adapters[0].name, adapters[0], model)
    assert cache.resident == [adapters[1].name, adapters[0].name] and cache.loads == 4
    assert cache.nbytes <= cache.capacity_bytes


async def test_sampling_with_an_adapter_is_seeded(
    engine: LocalEngine, adapters: list[Path], prompts: list[list[int]]
) -> None:
    sampling = SamplingParams(max_new_tokens=10, temperature=1.0, seed=5, ignore_eos=True)
    runs = await asyncio.gather(*(collect(engine, prompts[2], sampling, adapter=ref(adapters[2])) for _ in range(3)))
    assert runs[0].token_ids == runs[1].token_ids == runs[2].token_ids


@pytest.fixture(scope="module")
def engine_url(tiny_model: Path) -> Iterator[str]:
    app = create_engine_app(lambda: LocalEngine.open(tiny_model, torch_threads=1, max_batch_size=8))
    with serve_in_thread(app) as url:
        yield url


async def test_sglang_clients_load_adapters_on_first_use_and_evict_idle_ones(
    engine_url: str, tiny_model: Path, adapters: list[Path], prompts: list[list[int]]
) -> None:
    """The SGLang path (``/load_lora_adapter``, ``lora_path``) against `tandem engine`'s routes."""
    client = await SGLangClient.open(engine_url, max_loaded_adapters=2)
    try:
        # One after the other, so the least recently used of the two is known: the first.
        results = [await collect(client, prompts[i], greedy(8), adapter=ref(a)) for i, a in enumerate(adapters[:2])]
        for i, result in enumerate(results):
            assert result.token_ids == peft_greedy(tiny_model, adapters[i], prompts[i], 8)
        assert sorted(client.adapters.loaded) == [adapters[0].name, adapters[1].name]
        third = await collect(client, prompts[2], greedy(8), adapter=ref(adapters[2]))
        assert third.token_ids == peft_greedy(tiny_model, adapters[2], prompts[2], 8)
        assert client.adapters.loaded == [adapters[1].name, adapters[2].name]  # the least recent went
        async with aiohttp.ClientSession() as http:
            body = {"input_ids": prompts[0], "sampling_params": {"max_new_tokens": 2}, "lora_path": adapters[0].name}
            async with http.post(engine_url + "/generate", json=body) as unloaded:
                assert unloaded.status == 400 and "not a loaded adapter" in await unloaded.text()
            bad = {"lora_name": "bad", "lora_path": str(adapters[0].parent / "nothing")}
            async with http.post(engine_url + "/load_lora_adapter", json=bad) as refused:
                assert refused.status == 400 and (await refused.json())["success"] is False
    finally:
        await client.close()
