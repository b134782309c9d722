"""KV bytes per token from model shapes (the figures the demo and the planner size with)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvbridge.tools._models import PRESETS, from_hf_config


def test_presets_match_the_published_shapes() -> None:
    # Llama-3-8B: 32 layers x 8 KV heads x 128 x 2 (K and V) x 2 bytes.
    assert PRESETS["llama-3-8b"].kv_bytes_per_token == 131_072
    assert PRESETS["llama-3-70b"].kv_bytes_per_token == 327_680
    # OPT-66B: a 512-token request carries about 1.13 GiB of KV cache.
    assert PRESETS["opt-66b"].block_bytes(512) == 1_207_959_552
    # DeepSeek-V3 MLA: 61 layers x (512 latent + 64 rope) x 2 bytes.
    assert PRESETS["deepseek-v3"].kv_bytes_per_token == 70_272


def test_hugging_face_configs(tmp_path: Path) -> None:
    mla = tmp_path / "mla.json"
    mla.write_text(
        json.dumps({"num_hidden_layers": 61, "kv_lora_rank": 512, "qk_rope_head_dim": 64})
    )
    assert from_hf_config(mla).kv_bytes_per_token == PRESETS["deepseek-v3"].kv_bytes_per_token
    gqa = tmp_path / "gqa.json"
    gqa.write_text(
        json.dumps(
            {
                "num_hidden_layers": 32,
                "num_attention_heads": 32,
                "num_key_value_heads": 8,
                "hidden_size": 4096,
                "torch_dtype": "float32",
            }
        )
    )
    assert from_hf_config(gqa).kv_bytes_per_token == 2 * 131_072
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"hidden_size": 1}))
    with pytest.raises(ValueError, match="num_hidden_layers"):
        from_hf_config(bad)
