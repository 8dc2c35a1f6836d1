"""Proof that tandem learns: simulated users with a hidden preference chat and rate through the public
API only, rounds learn from their ratings, and fresh answers please them more.

The preference (``LetterPreference``: answers rich in the letters k and v) is one the tiny model with
random weights can learn from ratings; the users differ in leniency and some give scores instead of
up/down. The curve first dips (rounds 2-4 went to -0.1..-0.47 in the runs measured) and then
saturates at +1.00; after round 5 or 6 it is still mid-climb (+0.11..+0.72 after round 5 in one
loaded pair of runs), which is why an earlier version of this test, measuring there, failed now and
then. So it runs 8 rounds and takes the best fresh score after rounds 6, 7 and 8.

Why the best and not the last: with the gate and guards off and Adam at a high learning rate, a
round past saturation can throw the model off again. Once nearly every rating is positive the
advantages shrink to noise and Adam still takes full-size steps; one CI run (2026-12-07) scored
+1.000 after round 7 and -0.125 after round 8, the candidate's held-out loglik margin 1.9 nats below
the serving version's, which is what the evaluation gate exists to hold back (its own tests:
test_eval_gate.py). This test proves that ratings move fresh answers toward the preference.

Measured on 2026-12-05, two copies of this test at once on the 2-core machine (so each ran loaded),
10 runs: the score before was +0.042 in every run; the average after rounds 7 and 8 was 0.73 to
1.00 (rise 0.69 to 0.96, mean 0.89; the lowest single scores +0.47 and +0.63), so the best of the
last three rounds rose at least 0.69. Broken learning (a sign error, ratings not reaching the round,
the new version not served) leaves the score at its start, 0 +- 0.15 in every evaluation.
``RISE`` = 0.45 sits between the two: 0.24 below the lowest rise measured, 0.3 above what broken
learning reaches.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from benchmarks.simulated_users import LetterPreference, Population, evaluate, questions
from learner.evaluation import EvalConfig
from learner.evaluation.guard import GuardConfig
from learner.round import RoundConfig, run_round
from learner.trainers.drift import DriftConfig
from tests.fixtures.tiny_model import tiny_model_path
from tests.server.conftest import ADMIN_KEY, Gateway, gateway_settings, run_gateway
from tests.support.streaming_load import StreamingLoad

SEED = 0
ROUNDS = 8
SCORED_ROUNDS = 3  # fresh answers are scored after each of the last three rounds
RATINGS_PER_ROUND = 64
LEARNING_RATE = 5e-2  # the random tiny model's weights are ~0.02; Adam moves each by about this per step
MAX_TOKENS = 16
# The gate runs as deployed (10 % of prompts held out and scored every round) with a margin that
# lets every round through: at this learning rate the held-out loglik margin of consecutive versions
# swings by up to 0.45 nats/token in the first rounds and by several past saturation (measured: a
# serving 2.13 vs a candidate 0.81), so a real margin would freeze the model wherever it stood (one
# run held rounds 6-8 back at a fresh score of +0.29). The gate's decisions are tested in test_eval_gate.py.
EVAL_MARGIN = 100.0
RISE = 0.45  # from the measured spread in the module docstring


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    torch.set_num_threads(1)
    settings = gateway_settings(tmp_path_factory.mktemp("proof"), tiny_model_path(), admin_key=ADMIN_KEY)
    with run_gateway(settings, tenants=("sim",)) as gw:
        yield gw


@pytest.mark.slow
@pytest.mark.timeout(900)  # 8 rounds took up to 281 s on a loaded machine, near the 300 s default
def test_fresh_answers_improve_under_the_hidden_preference(gateway: Gateway, tmp_path: Path) -> None:
    client = gateway.client(gateway.keys["sim"])
    preference = LetterPreference()
    population = Population.make(preference, size=8, seed=SEED)
    held_out = questions(12, seed=SEED + 1000)

    def fresh_score() -> float:
        return evaluate(client, gateway.model, preference, held_out, samples_per_prompt=4, max_tokens=MAX_TOKENS)

    before = fresh_score()
    scores = []
    # Two streaming clients keep the server busy through every hot swap: none may fail.
    with StreamingLoad(gateway.client(gateway.keys["sim"]), gateway.model, clients=2) as load:
        versions = learn_rounds(gateway, population, tmp_path, ROUNDS - SCORED_ROUNDS)
        for round_index in range(ROUNDS - SCORED_ROUNDS, ROUNDS):
            versions += learn_rounds(gateway, population, tmp_path, 1, first=round_index)
            scores.append(fresh_score())
            print(f"fresh score after round {round_index + 1}: {scores[-1]:+.3f} (before learning {before:+.3f})")

    assert load.failures == [] and load.completed > 0
    assert len(set(versions)) >= ROUNDS // 2
    assert len(load.fingerprints & set(versions)) >= 2  # the load was served by several of the new versions
    best = max(scores)
    assert best >= before + RISE, f"fresh answers scored {before:+.3f} before learning, at best {best:+.3f} after"


def learn_rounds(gateway: Gateway, population: Population, tmp_path: Path, count: int, first: int = 0) -> list[str]:
    client = gateway.client(gateway.keys["sim"])
    versions = []
    for round_index in range(first, first + count):
        population.chat_and_rate(
            client, gateway.model, RATINGS_PER_ROUND, seed=SEED * 100 + round_index, max_tokens=MAX_TOKENS
        )
        result = run_round(
            RoundConfig(
                server_url=gateway.url,
                admin_key=ADMIN_KEY,
                database_url=gateway.settings.resolved_database_url,
                checkpoint_dir=tmp_path / "checkpoints",
                learning_rate=LEARNING_RATE,
                num_threads=1,
                evaluation=EvalConfig(margin=EVAL_MARGIN, guard=GuardConfig(guard="off")),
                # A random model has no abilities to keep: it learns the letters by leaving its start
                # far behind, which the guards exist to stop (their own tests: test_guards.py).
                drift=DriftConfig(guard="off"),
            )
        )
        print(f"round {round_index + 1}: {result.status}, {result.metrics.get('eval/reason')}")
        # Held back: the gate kept an overshooting candidate out (past saturation the loglik margins
        # grow to several nats, and so do their swings); the served version is then the last one.
        assert result.status in ("succeeded", "held_back"), result.error
        # every rating reached the round, none twice: trained, or held out for evaluation
        assert result.samples + result.metrics["eval/held_out"] == RATINGS_PER_ROUND
        assert "evaluate" in result.seconds
        assert result.version_id is not None
        if result.status == "succeeded":
            versions.append(result.version_id)
    return versions
