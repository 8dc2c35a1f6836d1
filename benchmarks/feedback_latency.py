"""Feedback-to-served latency: from the rating that makes a round due to every replica serving the result.

A real `tandem serve` with its embedded learner worker (beat included; SQLite broker, or Redis with
--redis), the round due after --min-feedback new ratings, beat checking every --check-interval
seconds. Each iteration: chat and rate min-feedback - 1 answers, chat once more, then time from the
POST of the last rating until GET /admin/weights reports a new serving version (a rolling update
returns only when every replica serves it). The round's own row gives the split by stage; "due" is
the time from the rating to the round's start (beat's check, the task's dispatch, the worker start).

    python -m benchmarks.feedback_latency --model tiny --iterations 5
    python -m benchmarks.feedback_latency --model tiny --iterations 5 --redis redis://127.0.0.1:6379/5
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from datetime import UTC
from pathlib import Path
from typing import Any

import httpx
from openai import OpenAI

from benchmarks.common import console, free_port, model_path, start, tenant_key
from learner.round_config import STAGES
from storage import get_round, list_rounds, make_engine, make_session_factory

ADMIN_KEY = "feedback-latency-admin"


def serving_version(url: str) -> str:
    response = httpx.get(f"{url}/admin/weights", headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=30)
    response.raise_for_status()
    return response.json()["weight_version"]


def run(args: argparse.Namespace, workdir: Path) -> list[dict[str, Any]]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    database_url = f"sqlite:///{workdir / 'tandem.db'}"
    api_key = tenant_key(database_url)
    env = {
        **os.environ,
        "TANDEM_DATA_DIR": str(workdir),
        "TANDEM_MODEL": str(model_path(args.model)),
        "TANDEM_PORT": str(port),
        "TANDEM_ADMIN_KEY": ADMIN_KEY,
        "TANDEM_LEARNER": "embedded",
        "TANDEM_REDIS_URL": args.redis or "",
        "TANDEM_REDIS_KEY_PREFIX": f"latency-{port}:",
        "TANDEM_LEARN_CHECK_INTERVAL_S": str(args.check_interval),
        "TANDEM_LEARN_MIN_FEEDBACK": str(args.min_feedback),
        "TANDEM_LEARN_MIN_INTERVAL_S": "0",
        "TANDEM_LEARN_LEARNING_RATE": str(args.lr),
        "TANDEM_LEARN_THREADS": str(args.threads),
        "TANDEM_TORCH_THREADS": str(args.threads),
        "TANDEM_LOG_LEVEL": "WARNING",
    }
    server = start(["serve"], env, f"{url}/health")
    db = make_engine(database_url)
    try:
        client = OpenAI(base_url=f"{url}/v1", api_key=api_key, timeout=120)
        model = client.models.list().data[0].id
        results = []
        for iteration in range(args.iterations):
            ids = [
                client.chat.completions.create(
                    model=model,
                    messages=[{"role": "user", "content": f"Question {iteration}.{i}?"}],
                    max_tokens=16,
                    user=f"user-{i % 3}",
                ).id
                for i in range(args.min_feedback)
            ]
            for completion_id in ids[:-1]:
                client.post("/feedback", body={"completion_id": completion_id, "rating": "up"}, cast_to=object)
            before = serving_version(url)
            rated_at = time.time()
            client.post("/feedback", body={"completion_id": ids[-1], "rating": "down"}, cast_to=object)
            while (now := serving_version(url)) == before:
                if time.time() - rated_at > args.timeout:
                    raise RuntimeError(f"no new version {args.timeout} s after the rating; logs in {workdir}")
                time.sleep(0.05)
            served = time.time() - rated_at
            results.append(round_split(db, model, now, rated_at, served))
            console.print(f"iteration {iteration + 1}: served {now} {served:.2f} s after the rating")
        return results
    finally:
        server.terminate()
        server.wait(timeout=60)
        db.dispose()


def round_split(db: Any, model: str, version: str, rated_at: float, served: float) -> dict[str, Any]:
    with make_session_factory(db)() as session:
        rounds = [r for r in list_rounds(session, model=model) if r.produced_version_id == version]
        row = get_round(session, round_id=rounds[0].id)
    started = (
        row.started_at.replace(tzinfo=UTC).timestamp() if row.started_at.tzinfo is None else row.started_at.timestamp()
    )
    return {"served": served, "due": started - rated_at, **row.metrics.get("seconds", {})}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--iterations", type=int, default=5)
    parser.add_argument("--min-feedback", type=int, default=8)
    parser.add_argument("--check-interval", type=float, default=1.0, help="beat's due check, seconds")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--redis", default="", help="Redis URL for the broker; default: embedded SQLite")
    parser.add_argument("--timeout", type=float, default=600.0)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="tandem-latency-") as workdir:
        results = run(args, Path(workdir))
    columns = ["served", "due", *STAGES]
    print(f"broker: {'redis' if args.redis else 'sqlite'}, model {Path(args.model).name}, {len(results)} rounds")
    print("| | " + " | ".join(columns) + " |")
    print("|---|" + "---|" * len(columns))
    for name, pick in (("median", statistics.median), ("max", max)):
        print(f"| {name} | " + " | ".join(f"{pick(r.get(c, 0.0) for r in results):.2f}" for c in columns) + " |")


if __name__ == "__main__":
    main()
