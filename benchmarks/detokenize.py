"""The detokenizer's work per engine step at 64 running sequences, each getting one token per step:
the two-``decode`` path (forced, as before ``DecodeStream``) against ``tokenizers``' ``DecodeStream``.

Two tokenizers of a realistic vocabulary (32k by default) are trained here, offline, on generated
text: a byte-level BPE (GPT-2 / Llama-3 style) and a SentencePiece-style BPE (Metaspace, byte fallback,
Llama-2 style). Prompts and outputs are token ids of generated text (multilingual, a few emoji), so
multi-byte characters span tokens as they do in practice. Two measures per path:

* ``detok``: ``add_token`` + ``pop_delta`` on 64 ``IncrementalDetokenizer``s per step;
* ``output_processor``: ``OutputProcessor.process`` + ``make_outputs`` for 64 streaming requests (what
  the engine runs per step after sampling).

Both paths must produce the same text (checked). Prints a table and writes
``benchmarks/results/detokenize.json``; the CPU's ISA line comes first.

    python benchmarks/detokenize.py --seqs 64 --steps 300
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
SPECIALS = ["<unk>", "<s>", "</s>"]
MULTILINGUAL = [
    "日本語", "東京", "中文", "字符", "한국어", "привет", "данные", "café", "naïve", "Ωμέγα", "مرحبا",
    "e\u0301", "😀", "👍🏽", "🇩🇪", "👨\u200d👩\u200d👧", "€", "½",
]  # fmt: skip


def make_lexicon(rng: random.Random, num_words: int = 60_000) -> list[str]:
    """Made-up words from syllables."""
    syllables = [c + v for c in "bcdfghjklmnprstvwz" for v in "aeiou"] + ["th", "sh", "ch", "qu"]
    return ["".join(rng.choice(syllables) for _ in range(rng.randint(1, 4))) for _ in range(num_words)]


def generated_text(rng: random.Random, lexicon: list[str], num_chars: int) -> str:
    """Lines of words drawn Zipf-like from ``lexicon`` (and ~5% multilingual ones)."""
    weights = [1 / (k + 1) for k in range(len(lexicon))]
    out, n = [], 0
    while n < num_chars:
        words = rng.choices(lexicon, weights, k=rng.randint(5, 20))
        words = [rng.choice(MULTILINGUAL) if rng.random() < 0.05 else w for w in words]
        line = " ".join(words).capitalize() + rng.choice([".", ",", "?", "!", ":"]) + rng.choice([" ", "\n"])
        out.append(line)
        n += len(line)
    return "".join(out)


def train(style: str, vocab_size: int, corpus: list[str]):
    """A ``PreTrainedTokenizerFast`` of ``style`` (byte_level | sentencepiece) trained on ``corpus``."""
    from transformers import PreTrainedTokenizerFast

    from kvpilot.engine.models.synthetic import train_byte_level_bpe, train_sentencepiece_bpe

    if style == "byte_level":
        tok = train_byte_level_bpe(corpus, vocab_size, SPECIALS)
    else:
        tok = train_sentencepiece_bpe(corpus, vocab_size, SPECIALS, limit_alphabet=200)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        clean_up_tokenization_spaces=False,
    )


class forced_fallback:
    """Within the block, every detokenizer takes the two-decode path (as before ``DecodeStream``)."""

    def __enter__(self):
        from kvpilot.engine import detokenizer

        self.module, self.saved = detokenizer, detokenizer.stream_backend
        detokenizer.stream_backend = lambda tokenizer: None

    def __exit__(self, *exc):
        self.module.stream_backend = self.saved


def build_detoks(tok, prompts, stop: list[str]) -> tuple[list, float]:
    """One ``IncrementalDetokenizer`` per prompt (sharing one stop index), and the seconds it took."""
    from kvpilot.engine.detokenizer import IncrementalDetokenizer, StopStrings

    stops = StopStrings(stop)
    t0 = time.perf_counter()
    detoks = [IncrementalDetokenizer(tok, p, True, stops) for p in prompts]
    return detoks, time.perf_counter() - t0


def detok_step(detoks, outputs, step: int) -> None:
    for d, out in zip(detoks, outputs, strict=True):
        d.add_token(out[step])
        d.pop_delta()


def build_processor(tok, prompts, steps: int, stop: list[str]):
    from kvpilot.engine.output_processor import OutputProcessor
    from kvpilot.engine.sampling_params import SamplingParams

    op = OutputProcessor(tok)
    params = SamplingParams(max_tokens=steps + 1, ignore_eos=True, stop=stop)
    for i, p in enumerate(prompts):
        op.add_request(f"r{i}", None, p, params, [f"r{i}#0"], 0.0, True)
    return op


def processor_step(op, outputs, step: int) -> None:
    from kvpilot.engine.scheduler_output import CoreOutput

    core = [CoreOutput(f"r{i}#0", [out[step]], None, scheduled_time=0.0) for i, out in enumerate(outputs)]
    op.make_outputs(op.process(core, 1.0 + step))


def paired(run_a, run_b, num_steps: int) -> tuple[list[float], list[float]]:
    """Per-step seconds of ``run_a(step)`` and ``run_b(step)``, interleaved step by step (the order
    alternating) so that both see the same load on a shared machine."""
    a, b = [], []
    for step in range(num_steps):
        for run, times in ((run_a, a), (run_b, b)) if step % 2 == 0 else ((run_b, b), (run_a, a)):
            t0 = time.perf_counter()
            run(step)
            times.append(time.perf_counter() - t0)
    return a, b


def summary(steps: list[float]) -> dict:
    ordered = sorted(steps)
    return {
        "mean_ms": 1000 * statistics.fmean(steps),
        "p50_ms": 1000 * ordered[len(ordered) // 2],
        "p99_ms": 1000 * ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqs", type=int, default=64)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--vocab-size", type=int, default=32000)
    ap.add_argument("--corpus-chars", type=int, default=6_000_000)
    ap.add_argument("--styles", default="byte_level,sentencepiece")
    ap.add_argument("--repeats", type=int, default=3, help="passes per path; the best is kept")
    ap.add_argument("--stop", action="append", default=[], help="a stop string (never met); repeatable")
    ap.add_argument("--out", type=Path, default=RESULTS / "detokenize.json")
    args = ap.parse_args()
    stop = args.stop
    from kvpilot.kernels import isa

    print(isa.summary_line(), flush=True)
    import tokenizers
    import transformers

    from kvpilot.engine import detokenizer

    rng = random.Random(0)
    lexicon = make_lexicon(rng)
    text = generated_text(rng, lexicon, args.corpus_chars)
    corpus = text.splitlines()
    results = []
    print(
        f"{args.seqs} sequences x {args.steps} steps, {args.prompt_tokens}-token prompts, stop strings "
        f"{stop}; tokenizers "
        f"{tokenizers.__version__}, transformers {transformers.__version__}",
        flush=True,
    )
    print("tokenizer | measure | two-decode ms/step | DecodeStream ms/step | ratio | build ms (64 seqs)")
    for style in args.styles.split(","):
        t0 = time.perf_counter()
        tok = train(style, args.vocab_size, corpus)
        train_s = time.perf_counter() - t0
        # Each sequence: a prompt and an output cut from fresh generated text.
        need = args.prompt_tokens + args.steps
        prompts, outputs = [], []
        for _ in range(args.seqs):
            ids = tok.encode(generated_text(rng, lexicon, need * 8), add_special_tokens=False)[:need]
            assert len(ids) == need
            prompts.append(ids[: args.prompt_tokens])
            outputs.append(ids[args.prompt_tokens :])
        assert detokenizer.stream_backend(tok) is tok.backend_tokenizer
        best: dict[str, dict] = {}
        builds = {"two_decode": [], "decode_stream": []}
        for _ in range(args.repeats):
            with forced_fallback():
                slow, build_slow = build_detoks(tok, prompts, stop)
                op_slow = build_processor(tok, prompts, args.steps, stop)
            fast, build_fast = build_detoks(tok, prompts, stop)
            op_fast = build_processor(tok, prompts, args.steps, stop)
            assert not any(d.uses_decode_stream for d in slow) and all(d.uses_decode_stream for d in fast)
            builds["two_decode"].append(1000 * build_slow)
            builds["decode_stream"].append(1000 * build_fast)
            before, after = paired(
                lambda i, d=slow, o=outputs: detok_step(d, o, i),
                lambda i, d=fast, o=outputs: detok_step(d, o, i),
                args.steps,
            )
            assert [d.text for d in slow] == [d.text for d in fast], "the two paths disagree"
            op_before, op_after = paired(
                lambda i, p=op_slow, o=outputs: processor_step(p, o, i),
                lambda i, p=op_fast, o=outputs: processor_step(p, o, i),
                args.steps,
            )
            for key, steps in (
                ("detok_before", before),
                ("detok_after", after),
                ("op_before", op_before),
                ("op_after", op_after),
            ):
                s = summary(steps)
                if key not in best or s["mean_ms"] < best[key]["mean_ms"]:
                    best[key] = s
        row = {
            "tokenizer": style,
            "vocab_size": len(tok),
            "train_s": train_s,
            "detok": {"two_decode": best["detok_before"], "decode_stream": best["detok_after"]},
            "output_processor": {"two_decode": best["op_before"], "decode_stream": best["op_after"]},
            "build_ms": {k: min(v) for k, v in builds.items()},
            "texts_identical": True,
        }
        for measure in ("detok", "output_processor"):
            a, b = row[measure]["two_decode"]["mean_ms"], row[measure]["decode_stream"]["mean_ms"]
            row[measure]["ratio"] = a / b
            build = row["build_ms"]
            print(
                f"{style} ({len(tok)}) | {measure} | {a:18.3f} | {b:20.3f} | {a / b:5.2f}x | "
                f"{build['two_decode']:.1f} vs {build['decode_stream']:.1f}",
                flush=True,
            )
        results.append(row)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {
                "isa": isa.describe(),
                "seqs": args.seqs,
                "steps": args.steps,
                "prompt_tokens": args.prompt_tokens,
                "stop_strings": stop,
                "tokenizers_version": tokenizers.__version__,
                "transformers_version": transformers.__version__,
                "decode_stream_prefill": detokenizer._HAS_PREFILL,
                "rows": results,
            },
            indent=2,
        )
    )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
