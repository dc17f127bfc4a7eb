"""The decoder layers without their attention kernel: the engine's path against inductor on the same maths.

Everything of every layer but the attention kernel (residual add + RMSNorm, the qkv projection,
rotary, ``o_proj``, add + RMSNorm, the MLP), at the token counts of a decode step and of a prefill
chunk, three ways, on the checkpoint's weights in bfloat16:

- ``engine``: the engine's own modules (oneDNN-prepacked linears and the ``cpu`` backend's fused ops);
- ``eager``: the same maths in plain torch ops, as transformers writes it;
- ``inductor``: that plain version through ``torch.compile`` (static shapes, inductor's freezing and
  weight prepacking on), with its first-call compile time.

The attention output is stood in for by the rotated queries (the rotated keys are returned, as the KV
write would take them), so the three do the same work. Prints median ms per call, the compile time and
the largest difference from the engine's output, and writes
``benchmarks/results/inductor_ab_t<threads>.json``.

    cd /tmp && python /path/to/benchmarks/inductor_ab.py --model ~/.cache/kvpilot-peer/models/small \\
        --threads 1
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

RESULTS = Path(__file__).resolve().parent / "results"


def engine_layers(model):
    """The engine's path: its modules and fused ops, layer after layer."""
    layers = model.stage_layers
    fused = layers[0].backend.fused

    def run(x, residual, cos, sin):
        for layer in layers:
            attn = layer.self_attn
            h, residual = layer.input_layernorm.add_forward(x, residual, fused)
            q, k, _ = attn.qkv_proj(h).split([attn.q_size, attn.kv_size, attn.kv_size], dim=-1)
            q = q.view(-1, attn.num_heads, attn.head_dim)
            k = k.view(-1, attn.num_kv_heads, attn.head_dim)
            fused.rotary_(q, k, cos, sin)
            o = attn.o_proj(q.reshape(-1, attn.q_size))
            h, residual = layer.post_attention_layernorm.add_forward(o, residual, fused)
            x = layer.mlp(h)
        return x, residual

    return run


class PlainLayers(nn.Module):
    """The same maths in plain torch ops, over copies of the engine's weights."""

    def __init__(self, model) -> None:
        super().__init__()
        layers = model.stage_layers
        self.weights = nn.ParameterList()
        for layer in layers:
            attn, mlp = layer.self_attn, layer.mlp
            for tensor in (
                layer.input_layernorm.weight,
                attn.qkv_proj.weight,
                attn.o_proj.weight,
                layer.post_attention_layernorm.weight,
                mlp.gate_up_proj.weight,
                mlp.down_proj.weight,
            ):
                self.weights.append(nn.Parameter(tensor.detach().clone(), requires_grad=False))
        attn = layers[0].self_attn
        self.q_size, self.kv_size = attn.q_size, attn.kv_size
        self.num_heads, self.num_kv_heads, self.head_dim = attn.num_heads, attn.num_kv_heads, attn.head_dim
        self.intermediate = layers[0].mlp.intermediate_size
        self.eps = layers[0].input_layernorm.eps
        self.num_layers = len(layers)

    def norm(self, x, weight):
        return weight * F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype)

    @staticmethod
    def rotate(t, cos, sin):
        half = t.shape[-1] // 2
        return t * cos + torch.cat((-t[..., half:], t[..., :half]), dim=-1) * sin

    def forward(self, x, residual, cos, sin):
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        keys = []  # returned, as attention would read them: compiled, their rotation is not dead code
        for i in range(self.num_layers):
            norm1, qkv, o_proj, norm2, gate_up, down = self.weights[6 * i : 6 * i + 6]
            residual = residual + x
            q, k, _ = F.linear(self.norm(residual, norm1), qkv).split(
                [self.q_size, self.kv_size, self.kv_size], dim=-1
            )
            q = self.rotate(q.view(-1, self.num_heads, self.head_dim), cos, sin)
            keys.append(self.rotate(k.view(-1, self.num_kv_heads, self.head_dim), cos, sin))
            residual = residual + F.linear(q.reshape(-1, self.q_size), o_proj)
            gate, up = F.linear(self.norm(residual, norm2), gate_up).split(self.intermediate, dim=-1)
            x = F.linear(F.silu(gate) * up, down)
        return x, residual, keys


def median_ms(fn, make_inputs, calls: int) -> float:
    for _ in range(3):
        fn(*make_inputs())
    times = []
    for _ in range(calls):
        inputs = make_inputs()
        start = time.perf_counter()
        fn(*inputs)
        times.append(time.perf_counter() - start)
    return 1000 * sorted(times)[len(times) // 2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(Path.home() / ".cache/kvpilot-peer/models/small"))
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--tokens", default="64,512", help="token counts per call")
    ap.add_argument("--calls", type=int, default=20)
    args = ap.parse_args()
    from kvpilot.kernels import isa

    print(isa.summary_line(), flush=True)
    torch.set_num_threads(args.threads)

    import torch._inductor.config as inductor_config

    from kvpilot.engine.config import EngineArgs
    from kvpilot.engine.llm_engine import LLMEngine

    engine = LLMEngine(
        EngineArgs(model=args.model, dtype="bfloat16", max_model_len=1024, kv_cache_memory_bytes=1 << 30)
    )
    model = engine.model
    if model.stage_layers[0].backend.fused is None:
        raise SystemExit("the cpu backend's fused ops are not available here: nothing to compare")
    ours, plain = engine_layers(model), PlainLayers(model).eval()
    inductor_config.freezing = True
    inductor_config.cpp.weight_prepack = True
    hidden = model.config.hidden_size
    results = {}
    for tokens in (int(t) for t in args.tokens.split(",")):
        generator = torch.Generator().manual_seed(tokens)

        def make_inputs(tokens=tokens, generator=generator):
            x = torch.randn(tokens, hidden, generator=generator).to(torch.bfloat16)
            residual = torch.randn(tokens, hidden, generator=generator).to(torch.bfloat16)
            cos, sin = model.rotary.tables(torch.randint(0, 1000, (tokens,), generator=generator), x.dtype)
            return x, residual, cos.squeeze(1), sin.squeeze(1)

        with torch.no_grad():
            engine_ms = median_ms(ours, make_inputs, args.calls)
            eager_ms = median_ms(plain, make_inputs, args.calls)
            torch._dynamo.reset()
            compiled = torch.compile(plain, dynamic=False)
            start = time.perf_counter()
            compiled(*make_inputs())
            compile_s = time.perf_counter() - start
            inductor_ms = median_ms(compiled, make_inputs, args.calls)
            x, residual, cos, sin = make_inputs()
            reference, _ = ours(x.clone(), residual.clone(), cos, sin)  # the engine adds in place
            got = compiled(x.clone(), residual.clone(), cos, sin)[0]
            difference = (reference.float() - got.float()).abs().max().item()
        results[tokens] = {
            "engine_ms": engine_ms,
            "eager_ms": eager_ms,
            "inductor_ms": inductor_ms,
            "inductor_first_compile_s": compile_s,
            "inductor_max_abs_difference": difference,
        }
        print(
            f"{tokens} tokens, {args.threads} thread(s): engine {engine_ms:.2f} ms, plain eager "
            f"{eager_ms:.2f} ms, inductor {inductor_ms:.2f} ms (first compile {compile_s:.1f} s, "
            f"max |difference| {difference:.3g})",
            flush=True,
        )
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / f"inductor_ab_t{args.threads}.json"
    out.write_text(
        json.dumps(
            {"isa": isa.describe(), "model": args.model, "threads": args.threads, "by_tokens": results},
            indent=1,
        )
    )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
