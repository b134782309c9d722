"""How many KV-cache bytes a token costs, from a model's shape.

Standard attention keeps a key and a value per layer and KV head: ``2 * layers * kv_heads *
head_dim * dtype_bytes`` per token. Multi-head latent attention (DeepSeek-V2/V3) keeps one
compressed latent plus the decoupled RoPE key per layer: ``layers * (kv_lora_rank +
qk_rope_head_dim) * dtype_bytes``. Figures are for the whole model on one worker (no
tensor-parallel split).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1, "fp8": 1}


@dataclass(frozen=True)
class ModelShape:
    name: str
    layers: int
    kv_heads: int = 0
    head_dim: int = 0
    dtype_bytes: int = 2
    latent_dim: int = 0
    """MLA: ``kv_lora_rank + qk_rope_head_dim``; 0 for standard attention."""

    @property
    def kv_bytes_per_token(self) -> int:
        if self.latent_dim:
            return self.layers * self.latent_dim * self.dtype_bytes
        return 2 * self.layers * self.kv_heads * self.head_dim * self.dtype_bytes

    def block_bytes(self, block_tokens: int) -> int:
        return self.kv_bytes_per_token * block_tokens


PRESETS = {
    "llama-3-8b": ModelShape("llama-3-8b", layers=32, kv_heads=8, head_dim=128),
    "llama-3-70b": ModelShape("llama-3-70b", layers=80, kv_heads=8, head_dim=128),
    "opt-13b": ModelShape("opt-13b", layers=40, kv_heads=40, head_dim=128),
    "opt-66b": ModelShape("opt-66b", layers=64, kv_heads=72, head_dim=128),
    "deepseek-v3": ModelShape("deepseek-v3", layers=61, latent_dim=512 + 64),
}
"""Shapes from the models' published ``config.json`` files, bf16/fp16 KV cache."""


def from_hf_config(path: str | Path) -> ModelShape:
    """Read a Hugging Face ``config.json`` (Llama-style, OPT-style or DeepSeek MLA)."""
    try:
        config: dict[str, Any] = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path}: not a readable JSON config ({exc})") from None
    name = str(config.get("_name_or_path") or config.get("model_type") or Path(path).stem)
    dtype_bytes = _DTYPE_BYTES.get(str(config.get("torch_dtype", "bfloat16")), 2)
    try:
        layers = int(config["num_hidden_layers"])
        if "kv_lora_rank" in config:
            latent = int(config["kv_lora_rank"]) + int(config.get("qk_rope_head_dim", 0))
            return ModelShape(name, layers, dtype_bytes=dtype_bytes, latent_dim=latent)
        heads = int(config["num_attention_heads"])
        kv_heads = int(config.get("num_key_value_heads", heads))
        hidden = int(config["hidden_size"])
        head_dim = int(config.get("head_dim") or hidden // heads)
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"{path}: missing or bad field {exc}") from None
    return ModelShape(name, layers, kv_heads=kv_heads, head_dim=head_dim, dtype_bytes=dtype_bytes)
