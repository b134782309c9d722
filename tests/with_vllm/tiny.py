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


def _hybrid_geometry(hidden: int, vocab: int) -> dict[str, int]:
    """What the two hybrid shapes share: 4 layers, head_dim 32, 4 query heads over 2 KV
    heads at the default width (as ``make_model``'s Llama)."""
    return {
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": 2 * hidden,
        "num_hidden_layers": 4,
        "num_attention_heads": hidden // 32,
        "num_key_value_heads": max(1, hidden // 64),
        "head_dim": 32,
    }


def make_gemma3(path: Path, *, window: int = 64, hidden: int = 128, vocab: int = 1000) -> Path:
    """A Gemma-3-shaped model: 4 layers, a sliding window of ``window`` tokens on layers 0
    and 2, full attention on 1 and 3 (vLLM keeps one KV cache group of each)."""
    if (path / "config.json").exists():
        return path
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig  # noqa: PLC0415

    torch.manual_seed(0)
    config = Gemma3TextConfig(
        **_hybrid_geometry(hidden, vocab),
        query_pre_attn_scalar=32,
        sliding_window=window,
        layer_types=["sliding_attention", "full_attention"] * 2,
        max_position_embeddings=2048,
        torch_dtype="float32",
    )
    Gemma3ForCausalLM(config).save_pretrained(path)
    return path


def make_qwen3_next(path: Path, *, hidden: int = 128, vocab: int = 1000) -> Path:
    """A Qwen3-Next-shaped model: gated delta-net linear attention on layers 0 and 2, full
    attention on 1 and 3, a small MoE (bfloat16: vLLM's CPU linear attention needs it)."""
    if (path / "config.json").exists():
        return path
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM  # noqa: PLC0415

    torch.manual_seed(0)
    config = Qwen3NextConfig(
        **_hybrid_geometry(hidden, vocab),
        layer_types=["linear_attention", "full_attention"] * 2,
        linear_conv_kernel_dim=4,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
        shared_expert_intermediate_size=64,
        decoder_sparse_step=1,
        max_position_embeddings=2048,
        torch_dtype="bfloat16",
    )
    Qwen3NextForCausalLM(config).to(torch.bfloat16).save_pretrained(path)
    return path
