"""The ``args`` every plugin gets: one namespace, with slime's names for what tandem has.

slime hands its plugins the parsed command line, an ``argparse.Namespace``: plugins read settings
(``args.n_samples_per_prompt``, ``args.reward_key``), find the router (``args.sglang_router_ip`` and
``args.sglang_router_port``), load the tokenizer (``args.hf_checkpoint``), and some set attributes of
their own or deep-copy it (slime's multi-agent example). ``SlimeArgs`` is such a namespace. A round
fills it from its settings under slime's names (``RolloutConfig.slime_args``,
``TrainConfig.slime_args`` and the round's own), over ``SLIME_DEFAULTS``: slime's defaults for what
tandem fixes (one router, no partial rollout, no speculative decoding, text only). A name neither
set nor known raises an ``AttributeError`` that says so, where argparse's says nothing.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

__all__ = ["SLIME_DEFAULTS", "SlimeArgs", "slime_args"]

SLIME_DEFAULTS: Mapping[str, Any] = MappingProxyType(
    {
        # rollout: what tandem does not offer, at slime's defaults
        "rollout_batch_size": None,  # set to the round's prompt count when it rolls out
        "over_sampling_batch_size": None,
        "rollout_max_prompt_len": None,
        "rollout_max_context_len": None,
        "eval_max_context_len": None,
        "rollout_stop": None,
        "rollout_stop_token_ids": None,
        "rollout_skip_special_tokens": False,
        "partial_rollout": False,
        "mask_offpolicy_in_partial_rollout": False,
        "rollout_global_dataset": True,
        "use_rollout_routing_replay": False,
        "apply_chat_template": False,  # tandem's prompts arrive rendered: the logged token ids
        "input_key": "input",
        "label_key": None,
        "tool_key": "tools",
        "metadata_key": "metadata",
        "ci_test": False,
        "hf_checkpoint": None,  # the serving checkpoint, when the learner can read it
        # the router: a learner-side SGLang /generate in front of the gateway (learner.sglang_router)
        "sglang_router_ip": None,
        "sglang_router_port": None,
        "router_policy": None,
        "sglang_dp_size": 1,
        "sglang_speculative_algorithm": None,
        "sglang_enable_deterministic_inference": False,
        "rollout_num_engines": 1,
        "rollout_num_gpus_per_engine": 1,
        "use_distributed_post": False,
        # rewards
        "reward_key": None,
        "eval_reward_key": None,
        "group_rm": False,
        "rm_type": None,
        "rm_url": None,
        "custom_rm_path": None,
        # training
        "context_parallel_size": 1,
        "global_batch_size": None,
        "seed": 1234,
    }
)


class SlimeArgs(argparse.Namespace):
    """slime's ``args``: attributes by slime's names; plugins may add their own (and deep-copy it)."""

    def __getattr__(self, name: str) -> Any:
        # Called only for a missing attribute; dunder lookups (copy, pickle) must fail plainly.
        if name.startswith("__"):
            raise AttributeError(name)
        raise AttributeError(
            f"args.{name}: tandem has no setting of that name; plugins get slime's names for what tandem "
            "has (docs/slime.md, 'The args namespace') and may set attributes of their own"
        )


def slime_args(*parts: Mapping[str, Any], **values: Any) -> SlimeArgs:
    """A ``SlimeArgs`` of ``SLIME_DEFAULTS`` overlaid with ``parts`` in order, then ``values``."""
    merged: dict[str, Any] = dict(SLIME_DEFAULTS)
    for part in parts:
        merged.update(part)
    merged.update(values)
    return SlimeArgs(**merged)
