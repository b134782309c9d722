"""A tiny random Llama for the vLLM tests (no download): weights from a fixed seed, so
greedy outputs are deterministic; vLLM runs it on CPU in seconds."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM


def make_model(path: Path, *, layers: int = 2, hidden: int = 128, vocab: int = 1000) -> Path:
    """Write the model to ``path`` (once) and return it. head_dim 32 (CPU attention
    supports 32, 64, ...), 4 query heads over 2 KV heads."""
    if (path / "config.json").exists():
        return path
    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 32,
        num_key_value_heads=max(1, hidden // 64),
        vocab_size=vocab,
        max_position_embeddings=2048,
        torch_dtype="float32",
    )
    LlamaForCausalLM(config).save_pretrained(path)
    return path
