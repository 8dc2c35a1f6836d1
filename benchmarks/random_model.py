"""Random Qwen2 checkpoints of published shapes, for benchmarks that must not download a model.

Imports only torch and transformers: ``benchmarks.parallel_train``'s ranks load it, and they stay
clear of the database and server packages (``benchmarks.common`` imports those).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

# Qwen2.5's published configs (hidden, intermediate, layers, heads, kv heads, vocab, tied embeddings),
# and the tiny test shape.
SHAPES: dict[str, dict[str, Any]] = {
    "tiny": {"hidden_size": 64, "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
             "num_key_value_heads": 2, "vocab_size": 2048, "tie_word_embeddings": False},
    "0.5b": {"hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24, "num_attention_heads": 14,
             "num_key_value_heads": 2, "vocab_size": 151936, "tie_word_embeddings": True},
    "1.5b": {"hidden_size": 1536, "intermediate_size": 8960, "num_hidden_layers": 28, "num_attention_heads": 12,
             "num_key_value_heads": 2, "vocab_size": 151936, "tie_word_embeddings": True},
    "3b": {"hidden_size": 2048, "intermediate_size": 11008, "num_hidden_layers": 36, "num_attention_heads": 16,
           "num_key_value_heads": 2, "vocab_size": 151936, "tie_word_embeddings": True},
    "7b": {"hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28, "num_attention_heads": 28,
           "num_key_value_heads": 4, "vocab_size": 152064, "tie_word_embeddings": False},
}  # fmt: skip


def random_qwen2(
    shape: str, folder: Path, *, dtype: torch.dtype, device: str = "cpu", max_positions: int = 32768
) -> Qwen2ForCausalLM:
    """A random Qwen2 of ``shape`` (seed 0) on ``device``, saved in ``folder`` (config and weights only)."""
    rope = {"rope_type": "default", "rope_theta": 1e6}
    config = Qwen2Config(**SHAPES[shape], max_position_embeddings=max_positions, rope_parameters=rope)
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen2ForCausalLM(config).to(dtype)
    model.save_pretrained(folder)
    return model
