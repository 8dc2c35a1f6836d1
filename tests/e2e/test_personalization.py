"""Personal rounds end to end: simulated users in three cohorts chat and rate through the official
``openai`` client and ``/v1/feedback`` only; personal rounds train one adapter per cohort from that
cohort's ratings, then one for a single user, and the gateway serves each to its own people (user,
else cohort, else the base) while streaming clients of two cohorts run through every swap.

Then the base changes: the adapters trained over the old base stop serving at once, and the next
personal round continues the stored adapter on the new base (docs/adapters.md).

``test_each_cohort_is_served_answers_closer_to_its_own_taste`` proves the direction: cohort A likes
answers rich in k and v rather than c and p, cohort B the opposite, cohort C rates at random; after
personal rounds A's served answers score higher under A's taste and B's under B's, C's and the
base's within the measured noise. The spread it was set from is in that test's comments.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import httpx
import pytest
import torch
from openai import OpenAI

from benchmarks.simulated_users import (
    ContrastPreference,
    LetterPreference,
    OppositePreference,
    Population,
    RandomPreference,
    evaluate,
    questions,
)
from learner.evaluation import EvalConfig
from learner.personal_round import PersonalRoundConfig, PersonalRoundResult, run_personal_round
from learner.round import RoundConfig
from learner.training_request import AdapterSpec
from storage import get_adapter
from tests.e2e.test_eval_gate import eval_file
from tests.fixtures.tiny_model import perturb_weights, tiny_model_path
from tests.server.conftest import ADMIN_KEY, Gateway, gateway_settings, run_gateway
from tests.support.streaming_load import StreamingLoad

TENANT = "people"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
RATINGS_PER_COHORT = 24  # per round
MAX_TOKENS = 12

LIKES_KV = LetterPreference()
COHORTS = {
    "a": Population.make(LIKES_KV, size=3, seed=1, prefix="a"),
    "b": Population.make(OppositePreference(LIKES_KV), size=3, seed=2, prefix="b"),
    "c": Population.make(RandomPreference(seed=3), size=3, seed=3, prefix="c"),
}


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    torch.set_num_threads(1)
    settings = gateway_settings(tmp_path_factory.mktemp("personal"), tiny_model_path(), admin_key=ADMIN_KEY)
    with run_gateway(settings, tenants=(TENANT,)) as gw:
        yield gw


def personal_config(gateway: Gateway, checkpoints: Path, *kinds: str) -> PersonalRoundConfig:
    return PersonalRoundConfig(
        base=RoundConfig(
            server_url=gateway.url,
            admin_key=ADMIN_KEY,
            database_url=gateway.settings.resolved_database_url,
            checkpoint_dir=checkpoints,
            num_threads=1,
            evaluation=EvalConfig(gate="off"),
        ),
        adapter=AdapterSpec(rank=8, alpha=16),
        learning_rate=5e-2,
        num_steps=2,
        min_ratings=4,
        scope_kinds=kinds,  # type: ignore[arg-type]
    )


def served_adapter(client: OpenAI, gateway: Gateway, user: str) -> tuple[str | None, str]:
    """The adapter that answers ``user`` (X-Tandem-Adapter) and its greedy answer."""
    raw = client.chat.completions.with_raw_response.create(
        model=gateway.model,
        messages=[{"role": "user", "content": "Tell me about rivers."}],
        max_tokens=MAX_TOKENS,
        temperature=0,
        user=user,
    )
    return raw.headers.get("x-tandem-adapter"), raw.parse().choices[0].message.content or ""


def trained(result: PersonalRoundResult) -> dict[str, str]:
    assert [s.error for s in result.scopes if s.status == "failed"] == []
    return {s.scope: s.adapter_id or "" for s in result.trained}


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_personal_rounds_serve_each_scope_its_own_adapter_through_swaps(gateway: Gateway, tmp_path: Path) -> None:
    client = gateway.client(gateway.keys[TENANT])
    for name, population in COHORTS.items():
        response = httpx.put(
            f"{gateway.url}/admin/tenants/{TENANT}/cohorts/{name}",
            json={"users": [u.name for u in population.users]},
            headers=ADMIN,
        )
        assert response.status_code == 200, response.text
    a_user, b_user, c_user = (p.users[0].name for p in COHORTS.values())
    nobody, base_answer = "in-no-cohort", served_adapter(client, gateway, "in-no-cohort")[1]
    cohorts = personal_config(gateway, tmp_path / "checkpoints", "cohort")
    rounds: list[dict[str, str]] = []
    with (
        StreamingLoad(client, gateway.model, clients=1, user=a_user) as load_a,
        StreamingLoad(client, gateway.model, clients=1, user=b_user) as load_b,
    ):
        for index in range(2):
            for name, population in COHORTS.items():
                population.chat_and_rate(
                    client, gateway.model, RATINGS_PER_COHORT, seed=100 * index + ord(name), max_tokens=MAX_TOKENS
                )
            rounds.append(trained(run_personal_round(cohorts)))
    assert [set(r) for r in rounds] == [{"a", "b", "c"}] * 2  # every cohort trained in every round
    assert load_a.failures == load_b.failures == []
    # Each client was answered by its own cohort's adapters only, and by both versions: it ran through the swap.
    assert load_a.adapters - {None} == {r["a"] for r in rounds}
    assert load_b.adapters - {None} == {r["b"] for r in rounds}

    latest = rounds[-1]
    for user, cohort in ((a_user, "a"), (b_user, "b"), (c_user, "c")):
        assert served_adapter(client, gateway, user)[0] == latest[cohort]
    assert served_adapter(client, gateway, nobody) == (None, base_answer)  # the base is nobody's adapter
    assert served_adapter(client, gateway, a_user)[1] != base_answer  # the adapter changes the answer

    # One user's own adapter, over their cohort's: the most specific scope serves.
    mine = personal_config(gateway, tmp_path / "checkpoints", "user")
    users = trained(run_personal_round(mine))
    assert set(users) == {u.name for p in COHORTS.values() for u in p.users}  # everyone who rated enough
    for user in (a_user, COHORTS["b"].users[1].name):
        assert served_adapter(client, gateway, user)[0] == users[user]
    assert served_adapter(client, gateway, nobody)[0] is None

    # A new base: adapters trained over the old one stop serving at once ...
    new_base = perturb_weights(tiny_model_path(), tmp_path / "new-base")
    swapped = httpx.post(
        f"{gateway.url}/admin/weights",
        json={"model_path": str(new_base), "weight_version": "base-2"},
        headers=ADMIN,
        timeout=120,
    )
    assert swapped.status_code == 200, swapped.text
    assert served_adapter(client, gateway, a_user)[0] is None and served_adapter(client, gateway, b_user)[0] is None
    # ... and the next round continues each stored adapter on the new base, from all of its ratings.
    again = run_personal_round(cohorts)
    assert again.base_version == "base-2" and set(trained(again)) == {"a", "b", "c"}
    adapter, _ = served_adapter(client, gateway, b_user)
    assert adapter == trained(again)["b"]
    with gateway.sessions()() as session:
        row = get_adapter(session, adapter_id=adapter or "")
    assert row.base_version_id == "base-2" and row.parent_id == latest["b"]
    assert row.metrics["continued_from"] == latest["b"] and row.ratings > RATINGS_PER_COHORT  # both rounds' ratings


@pytest.fixture
def fresh_gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    settings = gateway_settings(tmp_path_factory.mktemp("gated"), tiny_model_path(), admin_key=ADMIN_KEY)
    with run_gateway(settings, tenants=(TENANT,)) as gw:
        yield gw


def rated_answers(gateway: Gateway, user: str) -> list[tuple[str, str, str]]:
    """``user`` asks four questions twice, likes one answer of each and not the other; (question,
    answer, rating) as logged."""
    client = gateway.client(gateway.keys[TENANT])
    rated = []
    for index, question in enumerate(["Describe the sea.", "Describe a cat.", "Describe a dog.", "Name a colour."] * 2):
        reply = client.chat.completions.create(
            model=gateway.model, messages=[{"role": "user", "content": question}], max_tokens=8, seed=index, user=user
        )
        rating = "up" if index < 4 else "down"  # a group of two per question: advantages +1 and -1
        client.post("/feedback", body={"completion_id": reply.id, "rating": rating}, cast_to=object)
        rated.append((question, reply.choices[0].message.content or "", rating))
    client.get(f"/completions/{reply.id}", cast_to=object)  # flushes the conversation log
    return rated


@pytest.mark.parametrize("flip", [True, False], ids=["worse: held back", "better: promoted"])
def test_the_gate_holds_back_an_adapter_worse_than_what_serves_the_scope(
    fresh_gateway: Gateway, tmp_path: Path, flip: bool
) -> None:
    gateway = fresh_gateway
    rated = rated_answers(gateway, "gated-user")
    # Training on the ratings moves the adapter the ratings' way; a file calling good what the user
    # disliked (flip) scores it below the base, the same file unflipped above it.
    prompts = eval_file(tmp_path / "eval.jsonl", rated, flip=flip)
    config = personal_config(gateway, tmp_path / "checkpoints", "user")
    gated = replace(config.base, evaluation=EvalConfig(prompts_path=prompts, margin=0.0))
    config = replace(config, base=gated, num_steps=8)  # far enough from the base for the scores to differ
    (scope,) = run_personal_round(config).scopes
    with gateway.sessions()() as session:
        row = get_adapter(session, adapter_id=scope.adapter_id or "")
    record = row.evaluation
    assert record["serving_version"] is None and record["n"] == 8  # against the base: no adapter served yet
    served = served_adapter(gateway.client(gateway.keys[TENANT]), gateway, "gated-user")[0]
    if flip:
        assert scope.status == "held_back" and row.status == "candidate" and record["passed"] is False
        assert row.status_reason == scope.error and served is None
    else:
        assert scope.status == "succeeded" and row.status == "serving" and record["passed"] is True
        assert served == row.id


def test_a_canary_round_serves_the_new_adapter_to_a_share_of_the_scope_first(
    fresh_gateway: Gateway, tmp_path: Path
) -> None:
    gateway = fresh_gateway
    rated_answers(gateway, "canary-user")
    config = replace(personal_config(gateway, tmp_path / "checkpoints", "user"), canary_share=0.5)
    (scope,) = run_personal_round(config).scopes
    assert scope.status == "canary", scope.error
    admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
    listed = httpx.get(f"{gateway.url}/admin/canaries", headers=admin, params={"status": "running"}, timeout=30)
    [canary] = [c for c in listed.json()["data"] if c["scope"] == "canary-user"]
    assert canary["candidate_id"] == scope.adapter_id and canary["control_id"] is None and canary["share"] == 0.5
    with gateway.sessions()() as session:
        assert get_adapter(session, adapter_id=scope.adapter_id or "").status == "candidate"
    raw = gateway.client(gateway.keys[TENANT]).chat.completions.with_raw_response.create(
        model=gateway.model, messages=[{"role": "user", "content": "Hi"}], max_tokens=2, user="canary-user"
    )
    arm = raw.headers["x-tandem-canary"].removeprefix(f"{canary['id']}; arm=")
    assert raw.headers.get("x-tandem-adapter") == (scope.adapter_id if arm == "canary" else None), arm


# The directional proof's settings. A taste of letters is a choice of output tokens: the adapter must
# reach the output layer (lm_head), as full-weight rounds do; over the attention and MLP projections
# alone, measured on 2026-12-05 over 8 rounds, neither taste was learnt (every cohort's answers,
# the random raters' too, drifted the same way). Learning rate 1e-2: at 5e-2 the cohorts that did
# not win collapsed to answers with none of the letters within 5 rounds.
TASTE = ContrastPreference()
DIRECTION_ROUNDS = 6
DIRECTION_RATINGS = 48  # per cohort per round
DIRECTION_ADAPTER = AdapterSpec(rank=16, alpha=32, target_modules=(*AdapterSpec().target_modules, "lm_head"))
DIRECTION_LR = 1e-2
# Measured on 2026-12-05, two copies of this test at once on the 2-core machine (scores of 48 seeded
# answers; before: +0.44 for A, C and the base under A's taste, -0.44 for B under its own): A rose by
# +0.36 and +0.27, B by +1.10 and +1.08; the gap between A's answers and B's under A's taste went
# from 0 to +1.47 and +1.35; the base stayed at +0.44 exactly (alone on the machine: A +0.48, B +1.30,
# gap +1.78, C -0.27). The random raters' answers moved by
# -0.52 and -0.58 under A's taste (and by -0.02 and +0.29 with the benchmark's seeds): random ratings
# still train, and Adam's steps are the learning rate's size whatever the gradient, so a random
# cohort's adapter walks about as far as a learning one, in a direction its ratings happen to set.
# A KL loss to the base (0.3 and 1.0) did not hold C (-0.42, -0.38) and stopped A learning (-0.07,
# +0.02). Broken learning moves A and B like C: each alone may drift by 0.6 either way, so the gap
# (which needs both to move their own way) is the sharper check.
RISE = 0.2  # A's and B's least rise under their own taste
GAP = 0.9  # A's answers over B's under A's taste: 0 before, 1.35 to 1.78 measured after
DRIFT = 0.75  # how far the random raters' answers may move under A's taste (0.58 measured)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_each_cohort_is_served_answers_closer_to_its_own_taste(fresh_gateway: Gateway, tmp_path: Path) -> None:
    gateway = fresh_gateway
    client = gateway.client(gateway.keys[TENANT])
    cohorts = {
        "a": (Population.make(TASTE, size=3, seed=11, prefix="a"), TASTE),
        "b": (Population.make(OppositePreference(TASTE), size=3, seed=12, prefix="b"), OppositePreference(TASTE)),
        "c": (Population.make(RandomPreference(seed=13), size=3, seed=13, prefix="c"), TASTE),  # judged by A's taste
    }
    for name, (population, _) in cohorts.items():
        response = httpx.put(
            f"{gateway.url}/admin/tenants/{TENANT}/cohorts/{name}",
            json={"users": [u.name for u in population.users]},
            headers=ADMIN,
        )
        assert response.status_code == 200, response.text
    held_out = questions(12, seed=1000)
    judges = {name: (population.users[0].name, taste) for name, (population, taste) in cohorts.items()}
    judges["base"] = ("in-no-cohort", TASTE)
    judges["b under a's taste"] = (judges["b"][0], TASTE)

    def scores() -> dict[str, float]:
        return {
            name: evaluate(
                client, gateway.model, taste, held_out, samples_per_prompt=4, max_tokens=MAX_TOKENS, user=user
            )
            for name, (user, taste) in judges.items()
        }

    config = replace(
        personal_config(gateway, tmp_path / "checkpoints", "cohort"),
        adapter=DIRECTION_ADAPTER,
        learning_rate=DIRECTION_LR,
        num_steps=4,
    )
    before, late = scores(), []
    for index in range(DIRECTION_ROUNDS):
        for name, (population, _) in cohorts.items():
            population.chat_and_rate(
                client, gateway.model, DIRECTION_RATINGS, seed=1000 * index + ord(name), max_tokens=MAX_TOKENS
            )
        assert set(trained(run_personal_round(config))) == {"a", "b", "c"}
        if index >= DIRECTION_ROUNDS - 2:
            late.append(scores())
    after = {name: (late[0][name] + late[1][name]) / 2 for name in judges}  # the last two rounds' mean
    print("before", before, "after", after)
    assert after["a"] >= before["a"] + RISE, (before, after)
    assert after["b"] >= before["b"] + RISE, (before, after)
    assert after["a"] - after["b under a's taste"] >= GAP, (before, after)
    assert abs(after["c"] - before["c"]) <= DRIFT, (before, after)
    assert abs(after["base"] - before["base"]) <= 0.1  # nobody's adapter: the same seeded answers (batching aside)
