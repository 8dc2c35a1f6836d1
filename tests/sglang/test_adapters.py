"""Per-user adapters served by real SGLang on the CPU (its LoRA path, made to run here by the stand-in
folder's sitecustomize): through the gateway and the official openai client, each user's answers
are their own adapter's greedy answers as peft computes them, side by side in one batch, and a user
without an adapter gets the base's."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from openai import OpenAI

from learner.training_request import AdapterSpec
from tests.admin.test_adapters import ADAPTER_HEADER, promote, register
from tests.server.conftest import ADMIN_KEY, Gateway, gateway_settings, run_gateway
from tests.server.engines.helpers import greedy_reference
from tests.server.engines.test_local_lora import make_adapter, peft_greedy

pytestmark = pytest.mark.sglang

TENANT = "acme"


@pytest.fixture(scope="module")
def gateway(sglang_url: str, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    """A gateway with tenants and an admin key in front of the managed SGLang server."""
    settings = gateway_settings(
        tmp_path_factory.mktemp("sglang-adapters"),
        tiny_model,
        engine="sglang",
        engine_urls=[sglang_url],
        admin_key=ADMIN_KEY,
        adapter_refresh_s=3600,
        health_interval_s=3600,
    )
    with run_gateway(settings, tenants=(TENANT,)) as gw:
        yield gw


def chat(client: OpenAI, model: str, user: str) -> tuple[dict[str, Any], str | None]:
    """One greedy answer of 8 tokens for ``user``: the gateway's log of it and the adapter header."""
    raw = client.chat.completions.with_raw_response.create(
        model=model,
        messages=[{"role": "user", "content": f"Hello, I am {user}. Tell me a story."}],
        max_tokens=8,
        temperature=0,
        user=user,
        extra_body={"ignore_eos": True},
    )
    log = client.get(f"/completions/{raw.parse().id}", cast_to=object)
    return log, raw.headers.get(ADAPTER_HEADER)  # type: ignore[return-value]


def test_each_user_is_served_their_own_adapter_by_sglang(gateway: Gateway, sglang_url: str, tmp_path: Path) -> None:
    served = Path(httpx.get(f"{sglang_url}/model_info", timeout=30).json()["model_path"])
    folders = {
        "ann": make_adapter(served, tmp_path / "ann", seed=1, targets=["q_proj", "v_proj"]),
        # The personal rounds' default targets. (SGLang fuses q, k and v: an adapter over q and k but
        # not v fails to load there, KeyError on v_proj's factors.)
        "bob": make_adapter(served, tmp_path / "bob", seed=2, targets=list(AdapterSpec().target_modules), rank=8),
    }
    ids = {}
    for user, folder in folders.items():
        ids[user] = register(gateway, folder, TENANT, "user", user)
        promote(gateway, ids[user])
    client = gateway.client(gateway.keys[TENANT])
    users = ["ann", "bob", "cy", "ann", "bob", "cy"]  # concurrent: SGLang batches them, adapters mixed
    with ThreadPoolExecutor(len(users)) as pool:
        answers = list(pool.map(lambda user: chat(client, gateway.model, user), users))
    for user, (log, header) in zip(users, answers, strict=True):
        prompt, output = log["prompt_token_ids"], log["choices"][0]["token_ids"]
        if user in folders:
            assert header == ids[user]
            assert output == peft_greedy(served, folders[user], prompt, 8), user
            assert output != greedy_reference(served, prompt, 8)  # the adapter does change the answer
        else:
            assert header is None
            assert output == greedy_reference(served, prompt, 8)
