"""Prefill/decode disaggregation of hybrid models (``tiny.py``'s shapes) through
``kvbridge proxy``, two real vLLM OpenAI servers and one ``kvbridge serve``:

- the Gemma-3 shape (a sliding-window group beside a full-attention one): prefill saves
  every group's blocks, decode loads them and computes at most the last block of each
  prompt; completions equal a single vLLM's;
- the Qwen3-Next shape (a recurrent-state group): prefill tells decode of no saved block
  (it saves none: ``test_vllm_hybrid.py``), so no hit is claimed and decode computes the
  whole prompt; completions equal a single vLLM's.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from harness import BLOCK, PROMPTS, run_engine, tokens
from pd_deployment import complete, deployment
from serve import ServeProcess
from tiny import make_gemma3, make_qwen3_next

SHAPES: dict[str, tuple[Callable[[Path], Path], str]] = {
    "gemma3": (lambda path: make_gemma3(path, window=64), "float32"),
    "qwen3-next": (make_qwen3_next, "bfloat16"),
}


@pytest.mark.parametrize("shape", list(SHAPES))
def test_pd_of_a_hybrid_model_through_the_proxy_equals_a_single_instance(
    shape: str, tmp_path: Path
) -> None:
    make, dtype = SHAPES[shape]
    model = str(make(tmp_path / shape))
    alone = run_engine({"model": model, "prompts": PROMPTS, "connector": None, "dtype": dtype})
    loadable = shape == "gemma3"
    server = ServeProcess("--host-capacity", "64MiB")
    try:
        with deployment(model, server.address, {}, dtype) as urls:
            for prompt, expected in zip(PROMPTS, tokens(alone), strict=True):
                answer, computed = complete(urls.proxies["proxy"], model, prompt)
                assert answer == expected
                if loadable:
                    assert 1 <= computed <= BLOCK  # decode loaded every full block but the last
                else:
                    assert computed == len(prompt)  # no hit claimed: decode computed it all
    finally:
        server.kill()
