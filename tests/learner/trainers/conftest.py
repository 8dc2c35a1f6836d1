"""The tiny model in float32 (as the trainer loads it), one CPU thread, and sample builders."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

from learner.sample import Sample
from tests.fixtures.tiny_model import tiny_model_path


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def base_dir() -> Path:
    return tiny_model_path()


def load_tiny(path: Path, attn_implementation: str = "sdpa") -> PreTrainedModel:
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation=attn_implementation)


@pytest.fixture
def model(base_dir: Path) -> PreTrainedModel:
    return load_tiny(base_dir)


def random_samples(
    n: int, *, seed: int = 0, groups: int = 2, with_log_probs: bool = False, vocab: int = 2048
) -> list[Sample]:
    """``n`` samples of random lengths and tokens, rewards 0/1 alternating within each group.

    Behaviour log-probs, when asked for, are -9: well below the tiny model's (about -ln 2048 = -7.6).
    """
    generator = torch.Generator().manual_seed(seed)

    def ids(low: int, high: int) -> list[int]:
        length = int(torch.randint(low, high, (1,), generator=generator))
        return torch.randint(3, vocab, (length,), generator=generator).tolist()

    samples = []
    for i in range(n):
        response = ids(2, 9)
        samples.append(
            Sample(
                prompt_token_ids=ids(1, 7),
                response_token_ids=response,
                group_index=i % groups,
                index=i,
                reward=float((i // groups) % 2),
                rollout_log_probs=[-9.0] * len(response) if with_log_probs else None,
            )
        )
    return samples
