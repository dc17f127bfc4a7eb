"""The engine on the Triton backend (interpreted on CPU) produces the torch backend's greedy tokens.

Runs in a child process: on CPU ``TRITON_INTERPRET=1`` must be in the environment before triton is
imported, which this session may already have done.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

from .conftest import DEVICE, require_modules

SCRIPT = textwrap.dedent(
    """
    import json, random, sys
    from kvpilot.engine import LLM, SamplingParams

    model, device = sys.argv[1], sys.argv[2]
    rng = random.Random(0)
    # Lengths around the block size (8), one long enough to be prefilled in several 32-token chunks.
    prompts = [[rng.randrange(5, 1000) for _ in range(n)] for n in (1, 7, 8, 9, 17, 45)]
    result = {}
    for backend in ("torch", "triton"):
        llm = LLM(model, device=device, attention_backend=backend, block_size=8, max_num_batched_tokens=32,
                  num_gpu_blocks_override=64, enable_prefix_caching=False)
        assert llm.llm_engine.backend.name == backend
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(temperature=0.0, max_tokens=6))
        result[backend] = [o.outputs[0].token_ids for o in outs]
    print(json.dumps(result))
    """
)


def test_engine_greedy_tokens_match_torch_backend(tiny_llama, tmp_path):
    require_modules("triton")
    env = dict(os.environ)
    if DEVICE == "cpu":
        require_modules("numpy")
        env["TRITON_INTERPRET"] = "1"
    # Run outside the repository so that its top-level ``operator/`` folder cannot shadow the stdlib.
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tiny_llama), DEVICE],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["triton"] == result["torch"]
    assert all(len(tokens) == 6 for tokens in result["torch"])
