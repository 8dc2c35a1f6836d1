"""A reward model fitted to the accumulated feedback: a ridge head over the policy's own hidden states.

Fresh rollouts have no human rating; this scores them like the users would, as far as the policy's
own representation of an answer lets a linear model tell. Features come from the serving checkpoint
(the policy that produced the rollouts): the last layer's hidden states (after the final norm)
averaged over the response tokens, next to the state at the last response token, which has read the
whole answer. The head is ridge regression on standardised features, so it predicts the *expected*
rating on the feedback mapping's scale (+1 up, -1 down, scores as given), which is what a GRPO group
needs; an unsure prediction lands near the middle rather than at a confident +-1.

The ridge penalty is chosen by k-fold cross-validation over a small grid. Folds split by prompt:
answers to one prompt never sit on both sides, so the held-out metrics say how well the head ranks
answers to prompts it has not seen, not how well it remembers which prompts got bad ratings (a
prompt-level effect that group normalisation removes anyway). The metrics come from nested
cross-validation (the penalty chosen inside each outer training split), so they are not flattered by
the choice; ``quality`` is their rank correlation and ``trusted`` compares it with ``min_quality``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import random
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor
from transformers import AutoModelForCausalLM

from learner.sample import Sample

__all__ = [
    "FittedRewardModel",
    "HiddenStateFeatures",
    "RewardModelConfig",
    "RewardModelError",
    "fit_reward_model",
]

_FORMAT = 1
_HEAD_FILE, _META_FILE = "reward_head.safetensors", "reward_head.json"


class RewardModelError(ValueError):
    """Too few or constant rewards to fit, or a saved head that does not fit the feature model."""


@dataclass(frozen=True, slots=True)
class RewardModelConfig:
    """How the reward model is fitted and featurised.

    Attributes:
        folds: k of the k-fold cross-validation (penalty choice and held-out metrics).
        alphas: ridge penalties to try, per training sample (the penalty is ``alpha * n``).
        min_samples: fewer rated samples than this is refused (the metrics would be noise).
        min_quality: the held-out rank correlation below which ``trusted`` is False. With n samples,
            chance gives a correlation with standard deviation about ``1 / sqrt(n - 1)``.
        max_tokens: tokens per sample fed to the model; longer samples keep their last tokens.
        batch_tokens: padded tokens per forward pass (bounds activation memory).
        device: where the feature model runs.
    """

    folds: int = 5
    alphas: tuple[float, ...] = tuple(10.0 ** (k / 2) for k in range(-8, 7))  # 1e-4 .. 1e3
    min_samples: int = 32
    min_quality: float = 0.1
    max_tokens: int = 2048
    batch_tokens: int = 16384
    device: str = "cpu"

    def __post_init__(self) -> None:
        if self.folds < 2:
            raise ValueError(f"folds must be at least 2, got {self.folds}")
        if not self.alphas or any(not math.isfinite(a) or a <= 0 for a in self.alphas):
            raise ValueError(f"alphas must be positive finite numbers, got {self.alphas}")
        if self.min_samples < 2 * self.folds:
            raise ValueError(f"min_samples ({self.min_samples}) must be at least 2 * folds ({2 * self.folds})")
        if self.max_tokens < 1 or self.batch_tokens < self.max_tokens:
            raise ValueError(f"need 1 <= max_tokens ({self.max_tokens}) <= batch_tokens ({self.batch_tokens})")


@contextmanager
def _torch_threads(num_threads: int | None) -> Iterator[None]:
    # torch's thread count is process-wide: put it back for whatever else runs in this worker
    before = torch.get_num_threads()
    if num_threads is not None:
        torch.set_num_threads(num_threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


class HiddenStateFeatures:
    """``[n, 2 * hidden]`` features: mean response state, then last response state (last layer, normed).

    A sample without response tokens uses the state at its last prompt token for both halves.
    """

    def __init__(self, model_dir: Path, config: RewardModelConfig) -> None:
        lm = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        # The decoder alone: its last_hidden_state is the LM's last hidden state, without the
        # [tokens, vocab] logits a full forward would compute and throw away.
        self.model = lm.base_model.to(config.device).eval()
        self.dim = 2 * int(lm.config.hidden_size)
        self.config = config

    @torch.no_grad()
    def __call__(self, samples: Sequence[Sample]) -> Tensor:
        cap = self.config.max_tokens
        rows = []
        for s in samples:
            tokens = s.tokens[-cap:]
            rows.append((tokens, max(0, len(tokens) - s.response_length)))
        if any(not tokens for tokens, _ in rows):
            raise RewardModelError("a sample has no tokens at all")
        out = torch.empty(len(samples), self.dim, dtype=torch.float32)
        # Longest first, padded to the batch's longest: similar lengths share a batch, little padding.
        order = sorted(range(len(rows)), key=lambda i: -len(rows[i][0]))
        start = 0
        while start < len(order):
            width = len(rows[order[start]][0])
            size = max(1, self.config.batch_tokens // width)
            batch = order[start : start + size]
            out[batch] = self._forward(batch, rows, width)
            start += size
        return out

    def _forward(self, batch: list[int], rows: list[tuple[list[int], int]], width: int) -> Tensor:
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        mask = torch.zeros(len(batch), width, dtype=torch.long)
        for row, i in enumerate(batch):
            tokens = rows[i][0]
            ids[row, : len(tokens)] = torch.tensor(tokens)
            mask[row, : len(tokens)] = 1
        # Right padding: real tokens keep positions 0..len-1 and never attend to the padding.
        device = self.config.device
        states = self.model(input_ids=ids.to(device), attention_mask=mask.to(device)).last_hidden_state.float().cpu()
        features = []
        for row, i in enumerate(batch):
            tokens, response_start = rows[i]
            end = len(tokens)
            first = min(response_start, end - 1)  # no response: the last prompt state
            span = states[row, first:end]
            features.append(torch.cat([span.mean(dim=0), states[row, end - 1]]))
        return torch.stack(features)


# ridge regression


@dataclass(frozen=True, slots=True)
class _Head:
    mean: Tensor  # [d] feature means
    scale: Tensor  # [d] feature standard deviations (1 where constant)
    weight: Tensor  # [d] on standardised features
    bias: float
    low: float  # predictions are clipped to the training rewards' range
    high: float

    def predict(self, x: Tensor) -> Tensor:
        z = (x.double() - self.mean) / self.scale
        return (z @ self.weight + self.bias).clamp(self.low, self.high)


def _fit_heads(x: Tensor, y: Tensor, alphas: Sequence[float]) -> list[_Head]:
    """One ridge head per alpha, from a single SVD of the standardised features."""
    mean = x.mean(dim=0)
    scale = x.std(dim=0, correction=0)
    scale = torch.where(scale > 1e-12, scale, torch.ones_like(scale))
    z = (x - mean) / scale
    y_mean = float(y.mean())
    u, s, vh = torch.linalg.svd(z, full_matrices=False)
    uty = u.T @ (y - y_mean)
    n = x.shape[0]
    low, high = float(y.min()), float(y.max())
    heads = []
    for alpha in alphas:
        weight = vh.T @ (s / (s * s + alpha * n) * uty)
        heads.append(_Head(mean, scale, weight, y_mean, low, high))
    return heads


def _group_folds(groups: Sequence[object], folds: int, seed: int) -> list[int]:
    """A fold per sample; all samples of a group share one. Per sample when groups are too few."""
    unique = list(dict.fromkeys(groups))
    rng = random.Random(seed)
    if len(unique) < folds:
        fold_of = list(range(len(groups)))
        rng.shuffle(fold_of)
        return [f % folds for f in fold_of]
    rng.shuffle(unique)
    sizes = {g: 0 for g in unique}
    for g in groups:
        sizes[g] += 1
    load = [0] * folds
    assigned = {}
    for g in sorted(unique, key=lambda g: -sizes[g]):  # biggest first onto the lightest fold: balanced
        f = min(range(folds), key=lambda f: load[f])
        assigned[g] = f
        load[f] += sizes[g]
    return [assigned[g] for g in groups]


def _cv_mse(x: Tensor, y: Tensor, fold_of: list[int], alphas: Sequence[float]) -> Tensor:
    """Held-out mean squared error per alpha."""
    errors = torch.zeros(len(alphas), dtype=torch.float64)
    fold_tensor = torch.tensor(fold_of)
    for f in sorted(set(fold_of)):
        test = fold_tensor == f
        for k, head in enumerate(_fit_heads(x[~test], y[~test], alphas)):
            errors[k] += ((head.predict(x[test]) - y[test]) ** 2).sum()
    return errors / len(fold_of)


def _choose_alpha(x: Tensor, y: Tensor, groups: Sequence[object], config: RewardModelConfig, seed: int) -> float:
    errors = _cv_mse(x, y, _group_folds(groups, config.folds, seed), config.alphas)
    return config.alphas[int(errors.argmin())]


def _ranks(values: Sequence[float]) -> list[float]:
    """1-based ranks, ties sharing their average rank (binary ratings are nearly all ties)."""
    order = sorted(range(len(values)), key=lambda i: values[i])
    ranks = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return ranks


def _pearson(a: Sequence[float], b: Sequence[float]) -> float:
    ta, tb = torch.tensor(a, dtype=torch.float64), torch.tensor(b, dtype=torch.float64)
    ta, tb = ta - ta.mean(), tb - tb.mean()
    denominator = float(ta.norm() * tb.norm())
    return float(ta @ tb) / denominator if denominator > 0 else 0.0


def _held_out_metrics(
    x: Tensor, y: Tensor, groups: Sequence[object], config: RewardModelConfig, seed: int
) -> dict[str, float]:
    """Nested cross-validation: each outer fold predicted by a head whose alpha it had no say in."""
    n = len(groups)
    fold_of = _group_folds(groups, config.folds, seed)
    predicted = torch.zeros(n, dtype=torch.float64)
    baseline = torch.zeros(n, dtype=torch.float64)  # the training mean: what "no model" predicts
    fold_tensor = torch.tensor(fold_of)
    for f in sorted(set(fold_of)):
        test = fold_tensor == f
        train_groups = [g for g, k in zip(groups, fold_of, strict=True) if k != f]
        alpha = _choose_alpha(x[~test], y[~test], train_groups, config, seed + 1)
        predicted[test] = _fit_heads(x[~test], y[~test], [alpha])[0].predict(x[test])
        baseline[test] = float(y[~test].mean())
    pred, true = predicted.tolist(), y.tolist()
    middle = (float(y.min()) + float(y.max())) / 2  # 0 for up/down: the side of the middle is the verdict
    decided = [(p > middle, t > middle) for p, t in zip(pred, true, strict=True) if t != middle]
    positives = sum(t for _, t in decided)
    mse = float(((predicted - y) ** 2).mean())
    baseline_mse = float(((baseline - y) ** 2).mean())
    return {
        "cv_spearman": _pearson(_ranks(pred), _ranks(true)),
        "cv_pearson": _pearson(pred, true),
        "cv_accuracy": sum(p == t for p, t in decided) / len(decided) if decided else float("nan"),
        "cv_accuracy_chance": max(positives, len(decided) - positives) / len(decided) if decided else float("nan"),
        "cv_mse": mse,
        "cv_r2": 1 - mse / baseline_mse if baseline_mse > 0 else float("nan"),
        "chance_spearman_sd": 1 / math.sqrt(n - 1),
    }


# the fitted model


@dataclass(slots=True)
class FittedRewardModel:
    """A fitted head and the checkpoint whose hidden states it reads.

    Attributes:
        metrics: ``n``, ``alpha``, the held-out ``cv_*`` metrics and ``chance_spearman_sd``.
        quality: the held-out rank correlation between predicted and given rewards (0: chance).
        trusted: ``quality >= min_quality``; a caller should not score rollouts with an untrusted model.
    """

    model_dir: Path
    config: RewardModelConfig
    metrics: dict[str, float]
    _head: _Head
    _features: HiddenStateFeatures | None = field(default=None, repr=False)

    @property
    def quality(self) -> float:
        return self.metrics["cv_spearman"]

    @property
    def trusted(self) -> bool:
        return self.quality >= self.config.min_quality

    def score(self, samples: Sequence[Sample], *, num_threads: int | None = None) -> list[float]:
        """Predicted rewards, clipped to the range of the rewards it was fitted on ([-1, 1] by default)."""
        if not samples:
            return []
        with _torch_threads(num_threads):
            if self._features is None:
                self._features = HiddenStateFeatures(self.model_dir, self.config)
            if self._features.dim != self._head.weight.numel():
                raise RewardModelError(
                    f"{self.model_dir} gives {self._features.dim} features, the head expects {self._head.weight.numel()}"
                )
            return self._head.predict(self._features(samples)).tolist()

    def save(self, path: Path) -> None:
        """Write ``reward_head.safetensors`` and ``reward_head.json`` into the folder ``path``."""
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        head = self._head
        save_file({"mean": head.mean, "scale": head.scale, "weight": head.weight}, path / _HEAD_FILE)
        meta = {
            "format": _FORMAT,
            "model_dir": str(self.model_dir),
            "bias": head.bias,
            "low": head.low,
            "high": head.high,
            "metrics": self.metrics,
            "config": dataclasses.asdict(self.config),
        }
        (path / _META_FILE).write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")

    @classmethod
    def load(cls, path: Path, *, model_dir: Path | None = None) -> FittedRewardModel:
        """Read a saved head; ``model_dir`` overrides the checkpoint it was fitted with (same hidden size).

        Raises:
            RewardModelError: missing files or an unknown format.
        """
        path = Path(path)
        try:
            meta = json.loads((path / _META_FILE).read_text())
            tensors = load_file(path / _HEAD_FILE)
        except (OSError, ValueError) as exc:
            raise RewardModelError(f"{path}: no readable reward head ({exc})") from exc
        if meta.get("format") != _FORMAT:
            raise RewardModelError(f"{path}: reward head format {meta.get('format')!r}, expected {_FORMAT}")
        config = meta["config"]
        config["alphas"] = tuple(config["alphas"])
        head = _Head(tensors["mean"], tensors["scale"], tensors["weight"], meta["bias"], meta["low"], meta["high"])
        return cls(Path(model_dir or meta["model_dir"]), RewardModelConfig(**config), meta["metrics"], head)


def _prompt_key(sample: Sample) -> bytes:
    return hashlib.sha256(repr(sample.prompt_token_ids).encode()).digest()


def fit_reward_model(
    model_dir: Path,
    samples: Sequence[Sample],
    rewards: Sequence[float],
    *,
    config: RewardModelConfig | None = None,
    seed: int = 0,
    num_threads: int | None = None,
) -> FittedRewardModel:
    """Fit a ridge head over ``model_dir``'s hidden states to predict ``rewards`` of ``samples``.

    Args:
        model_dir: the Hugging Face checkpoint to read features with: the serving one, which also
            produced (or will produce) the rollouts the model scores.
        samples: every rated sample of the model so far (not just this round's).
        rewards: their rewards on the feedback mapping's scale, one per sample.
        config: fitting and featurising settings.
        seed: fold assignment (the fit itself is deterministic).
        num_threads: torch threads while featurising and fitting (None: leave as is).

    Returns:
        The fitted model; check ``trusted`` (and log ``metrics``) before scoring rollouts with it.

    Raises:
        RewardModelError: lengths differ, fewer than ``min_samples``, non-finite or constant rewards.
    """
    config = config or RewardModelConfig()
    if len(samples) != len(rewards):
        raise RewardModelError(f"{len(samples)} samples but {len(rewards)} rewards")
    if len(samples) < config.min_samples:
        raise RewardModelError(f"{len(samples)} rated samples; a reward model needs at least {config.min_samples}")
    y = torch.tensor([float(r) for r in rewards], dtype=torch.float64)
    if not bool(torch.isfinite(y).all()):
        raise RewardModelError("rewards must be finite")
    if float(y.max()) == float(y.min()):
        raise RewardModelError(f"every reward is {float(y[0])}: nothing to tell apart")
    with _torch_threads(num_threads):
        features = HiddenStateFeatures(Path(model_dir), config)
        x = features(samples).double()
        groups = [_prompt_key(s) for s in samples]
        metrics = _held_out_metrics(x, y, groups, config, seed)
        alpha = _choose_alpha(x, y, groups, config, seed)
        head = _fit_heads(x, y, [alpha])[0]
    metrics = {"n": float(len(samples)), "alpha": alpha, **metrics}
    return FittedRewardModel(Path(model_dir), config, metrics, head, features)
