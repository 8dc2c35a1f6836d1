"""The drift guard: a round stops before export when the policy moves past bounds while it trains.

After every optimizer step the training child probes the policy on the round's own batch
(``learner.training.child``) and hands the numbers to a ``DriftWatch``:

- ``kl_to_root``: the mean per-token k3 estimate of KL(policy || lineage root) on the batch's
  response tokens (the root's log-probs are taken once, before the first step);
- ``entropy``: the policy's mean entropy on those tokens, against the root's (``min_entropy_ratio``):
  a policy sure of every token has collapsed;
- ``grad_norm`` spikes: a step's gradient norm (before clipping) above ``grad_spike`` times the median
  of the round's earlier steps;
- and non-finite values, which the step itself refuses (``TrainingDiverged``).

The mean response length is the round's input, not the policy's: ``length_change`` compares it with
the lineage's earlier rounds before training (``learner.round``). A drift raises ``PolicyDrifted``;
the round fails with its reason and the schedule that fired it pauses until an admin resumes it.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Literal, get_args

__all__ = ["DriftConfig", "DriftWatch", "PolicyDrifted", "length_change"]

DriftSwitch = Literal["on", "off"]
MIN_SPIKE_HISTORY = 2  # steps before a spike can be told from the round's normal gradient scale


class PolicyDrifted(RuntimeError):
    """The policy crossed a drift bound while training; the message says which, by how much."""


@dataclass(frozen=True, slots=True)
class DriftConfig:
    """Bounds on how far one round may move the policy (``TANDEM_LEARN_DRIFT_*``)."""

    guard: DriftSwitch = "on"
    max_kl: float = 1.0  # nats per response token, policy || lineage root
    min_entropy_ratio: float = 0.25  # policy entropy over the root's, on the batch
    grad_spike: float = 20.0  # a step's grad norm over the median of the round's earlier ones
    max_length_change: float = 3.0  # the batch's mean response length vs earlier rounds', either way

    def __post_init__(self) -> None:
        errors = []
        if self.guard not in get_args(DriftSwitch):
            errors.append(f"guard must be one of {get_args(DriftSwitch)}, got {self.guard!r}")
        if not (self.max_kl > 0 and 0 <= self.min_entropy_ratio < 1):
            errors.append("max_kl must be > 0 and min_entropy_ratio in [0, 1)")
        if not (self.grad_spike > 1 and self.max_length_change > 1):
            errors.append("grad_spike and max_length_change must be > 1")
        if errors:
            raise ValueError("invalid drift guard: " + "; ".join(errors))

    @property
    def on(self) -> bool:
        return self.guard == "on"


@dataclass(slots=True)
class DriftWatch:
    """Checks each step's probe against ``config``; ``root_entropy`` is the root's on the same batch."""

    config: DriftConfig
    root_entropy: float
    grad_norms: list[float] = field(default_factory=list)

    def step(self, step: int, *, kl_to_root: float, entropy: float, grad_norm: float) -> dict[str, float]:
        """The step's drift metrics. Raises ``PolicyDrifted`` naming every bound it crossed."""
        config, crossed = self.config, []
        if not math.isfinite(kl_to_root) or kl_to_root > config.max_kl:
            crossed.append(f"KL to the lineage root {kl_to_root:.3f} > {config.max_kl:g} per token")
        ratio = entropy / self.root_entropy if self.root_entropy > 0 else 1.0
        if not math.isfinite(ratio) or ratio < config.min_entropy_ratio:
            crossed.append(
                f"entropy {entropy:.3f} is {ratio:.2f} of the root's {self.root_entropy:.3f} "
                f"(< {config.min_entropy_ratio:g}: collapsing)"
            )
        if len(self.grad_norms) >= MIN_SPIKE_HISTORY:
            usual = statistics.median(self.grad_norms)
            if usual > 0 and grad_norm > config.grad_spike * usual:
                crossed.append(
                    f"gradient norm {grad_norm:.3g} > {config.grad_spike:g} x the round's median {usual:.3g}"
                )
        self.grad_norms.append(grad_norm)
        if crossed:
            raise PolicyDrifted(f"step {step}: " + "; ".join(crossed))
        return {"drift/kl_to_root": kl_to_root, "drift/entropy": entropy, "drift/entropy_ratio": ratio}


def length_change(mean_length: float, earlier: list[float], config: DriftConfig) -> str | None:
    """Why the batch's mean response length is a drift (vs the median of ``earlier`` rounds'), or None."""
    if not earlier or mean_length <= 0:
        return None
    usual = statistics.median(earlier)
    if usual <= 0:
        return None
    change = mean_length / usual
    if 1 / config.max_length_change <= change <= config.max_length_change:
        return None
    return (
        f"mean response length {mean_length:.1f} tokens is {change:.2f}x the earlier rounds' median "
        f"{usual:.1f} (bound {config.max_length_change:g}x either way)"
    )
