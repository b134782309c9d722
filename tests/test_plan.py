"""`kvbridge plan`: the formulas against published reference points."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvbridge.tools._models import PRESETS
from kvbridge.tools._plan import Traffic, make_plan

GIB = 2**30


def test_llama_3_70b_is_320_kib_per_token() -> None:  # the Mooncake paper
    plan = make_plan(PRESETS["llama-3-70b"], Traffic(1, 1, 1.0))
    assert plan.kv_bytes_per_token == 320 * 1024


def test_opt_66b_512_tokens_and_ten_a_second() -> None:  # DistServe: "1.13GB", "90 Gbps"
    plan = make_plan(PRESETS["opt-66b"], Traffic(512, 128, 10.0), link_gbps=100)
    assert plan.kv_bytes_per_request == 1.125 * GIB
    assert plan.link_bytes_per_second == 11.25 * GIB
    assert plan.link_bytes_per_second * 8 / GIB == 90.0  # Gibit/s
    assert plan.transfer_seconds == pytest.approx(1.125 * GIB * 8 / 100e9)
    assert PRESETS["opt-13b"].kv_bytes_per_token == 2 * 40 * 5120 * 2


def test_pools_and_the_link_budget() -> None:
    traffic = Traffic(prompt_tokens=2000, output_tokens=200, rps=4.0, hit_rate=0.5)
    plan = make_plan(
        PRESETS["llama-3-8b"], traffic, prefill_tps=10_000, decode_tps=400, fraction=0.25
    )
    assert plan.prefill_seconds == pytest.approx(0.1)  # 1,000 computed tokens at 10k/s
    assert plan.prefill_instances == pytest.approx(0.4)
    assert plan.prefill_instances_without_cache == pytest.approx(0.8)
    assert plan.decode_instances == pytest.approx(2.0)
    assert plan.prefill_to_decode == pytest.approx(0.2)
    # 2,000 x 128 KiB must cross in 25 ms
    assert plan.link_gbps_for_fraction == pytest.approx(2000 * 131072 * 8 / 1e9 / 0.025)
    with pytest.raises(ValueError):
        make_plan(PRESETS["llama-3-8b"], Traffic(1, 1, 1.0, hit_rate=1.5))


@pytest.mark.slow
def test_plan_command_json_and_dtype() -> None:
    done = subprocess.run(
        [
            *(sys.executable, "-m", "kvbridge", "plan", "--model", "opt-66b"),
            *("--kv-dtype", "fp8", "--prompt-tokens", "512", "--rps", "10", "--json"),
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    plan = json.loads(done.stdout)
    assert plan["kv_bytes_per_token"] == 2 * 64 * 72 * 128  # one byte per value
    assert plan["kv_bytes_per_request"] == 512 * plan["kv_bytes_per_token"]
    assert plan["link_bytes_per_second"] == 10 * plan["kv_bytes_per_request"]
    text = subprocess.run(
        [sys.executable, "-m", "kvbridge", "plan", "--model", "opt-66b", "--link-gbps", "100"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "90.0 Gibit/s" in text and "1.125 GiB" in text
