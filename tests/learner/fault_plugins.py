"""CUSTOM_LOSS plugins (``TANDEM_LEARN_CUSTOM_LOSS_PATH``) that make training fail on purpose.

Failure handling is tested end to end through the extension point users have, so the settings carry
no test-only switch: the plugin runs inside the training child, after the model is loaded.
"""

from __future__ import annotations

import os
import time
from typing import Any

from tests.learner.plugins_examples import loss_vanilla_policy_gradient

CRASH = "tests.learner.fault_plugins:crash_last_rank"
HANG = "tests.learner.fault_plugins:hang"
CRASH_EXIT_CODE = 3


def crash_last_rank(args: Any, batch: dict[str, Any], logits: Any, sum_of_sample_mean: Any) -> Any:
    """Exit hard (no cleanup, no outcome: like an OOM kill) on the last rank of the training world;
    the other ranks are left waiting for it in a collective."""
    if int(os.environ.get("RANK", "0")) == int(os.environ.get("WORLD_SIZE", "1")) - 1:
        os._exit(CRASH_EXIT_CODE)
    return loss_vanilla_policy_gradient(args, batch, logits, sum_of_sample_mean)


def hang(args: Any, batch: dict[str, Any], logits: Any, sum_of_sample_mean: Any) -> Any:
    """Never return: the training child's timeout (or a cancel) has to end it."""
    while True:
        time.sleep(60)
