"""Tensor and pipeline parallelism on CPU (gloo): the same tokens as one process, under preemption too;
per-rank memory; fail-fast when a worker dies; start-up validation; no process left behind.

Each parallel engine spawns workers that import torch (a few seconds each on a 2-core machine), so the
engines are module fixtures shared by the tests that read them.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import random
import select
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from safetensors.torch import load_file, save_file

from kvpilot.engine import LLM, SamplingParams
from kvpilot.engine.async_engine import AsyncEngine
from kvpilot.engine.config import EngineArgs
from kvpilot.engine.errors import ConfigError
from kvpilot.engine.metrics import PrometheusStatLogger
from kvpilot.engine.model_runner import split_micro_batches
from kvpilot.engine.models.config import ModelConfig
from kvpilot.engine.models.llama import HeldByOtherStage
from kvpilot.engine.parallel import WorkerDiedError, validate_parallel_sizes
from kvpilot.engine.parallel.worker import encode
from kvpilot.engine.stats import StepCallback

from ..conftest import build_checkpoint
from .hf_reference import HFGreedy

# Tiny pool (as in test_memory_pressure): 16 blocks of 8 tokens for 24 requests of up to 64 tokens.
TINY_POOL = dict(block_size=8, num_gpu_blocks_override=16, max_model_len=128, max_num_batched_tokens=64)


def _workload(vocab: int, n: int = 24, seed: int = 0):
    """Prompts and params: greedy requests, plus seeded n=2 samples (copy-on-write forks) and logprobs."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(5, vocab) for _ in range(rng.randint(4, 40))] for _ in range(n)]
    params = []
    for i in range(n):
        if i % 8 == 3:
            params.append(SamplingParams(n=2, temperature=0.8, seed=i, max_tokens=10, ignore_eos=True))
        else:
            params.append(
                SamplingParams(
                    temperature=0.0, max_tokens=8 + i % 17, ignore_eos=True, logprobs=0 if i % 5 else 2
                )
            )
    return prompts, params


def _generate(llm: LLM, prompts, params):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    tokens = [[c.token_ids for c in o.outputs] for o in outs]
    logprobs = [[c.cumulative_logprob for c in o.outputs] for o in outs]
    return tokens, logprobs


def _gone(pid: int) -> bool:
    """True once ``pid`` has exited (a zombie waiting for a reaper counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def _wait_until(predicate, guard_s: float = 60.0) -> None:
    """Poll until ``predicate`` holds; ``guard_s`` only ends a wait that would never end (the thing
    waited for does not happen without the mechanism under test): no speed is asserted."""
    t0 = time.monotonic()
    while not predicate():
        assert time.monotonic() - t0 < guard_s, f"never happened ({guard_s} s)"
        time.sleep(0.02)


@pytest.fixture(scope="module", autouse=True)
def no_worker_left_behind():
    yield
    left = [p for p in multiprocessing.active_children() if p.name.startswith("kvpilot-rank")]
    assert not left, f"worker processes left running: {left}"


@pytest.fixture(scope="module")
def reference(tiny_llama):
    """One process, a pool big enough that nothing is preempted."""
    with LLM(str(tiny_llama), block_size=8, num_gpu_blocks_override=1024, max_model_len=128) as llm:
        prompts, params = _workload(llm.llm_engine.model_config.vocab_size)
        tokens, logprobs = _generate(llm, prompts, params)
        assert llm.llm_engine.stats().num_preemptions_total == 0
        weights = sum(p.numel() * p.element_size() for p in llm.llm_engine.model.parameters())
    return prompts, params, tokens, logprobs, weights


def _parallel_engine(model_dir, tp: int, pp: int, mode: str, **overrides) -> LLM:
    kwargs = dict(TINY_POOL, preemption_mode=mode, enable_prefix_caching=True)
    kwargs.update(overrides)
    if mode == "swap":
        # Room for 6 blocks per rank: a small CPU pool that also overflows into recompute.
        kv_heads, layers = max(1, 2 // tp), 2 // pp
        kwargs["swap_space"] = 6 * 2 * layers * 8 * kv_heads * 16 * 4 / 2**30
    return LLM(str(model_dir), tensor_parallel_size=tp, pipeline_parallel_size=pp, **kwargs)


def _assert_logprobs_close(logprobs, expected_logprobs) -> None:
    """Per request, per completion: cumulative logprobs both absent, or equal within 1e-3 (float32)."""
    assert len(logprobs) == len(expected_logprobs)
    compared = 0
    for ours, theirs in zip(logprobs, expected_logprobs, strict=True):
        for a, b in zip(ours, theirs, strict=True):
            assert (a is None) == (b is None) and (a is None or abs(a - b) < 1e-3), (a, b)
            compared += a is not None
    assert compared > 0, "the workload asks for logprobs"


def _check_same_as_reference(llm: LLM, reference, mode: str, num_requests: int) -> None:
    prompts, params, expected, expected_logprobs = (x[:num_requests] for x in reference[:4])
    engine = llm.llm_engine
    swapped = []
    engine.stat_loggers.append(StepCallback(lambda sched, it: swapped.append(sched.num_swapped)))
    tokens, logprobs = _generate(llm, prompts, params)
    assert tokens == expected
    _assert_logprobs_close(logprobs, expected_logprobs)
    assert engine.stats().num_preemptions_total > 0, "the tiny pool preempts"
    if mode == "swap":
        assert engine.num_cpu_blocks == 6
        assert max(swapped) > 0, "victims were swapped out and back in"
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks and bm.num_free_cpu_blocks == bm.num_cpu_blocks


@pytest.mark.parametrize(
    "tp, pp, mode, num_requests",
    [
        (2, 1, "recompute", 24),
        (2, 1, "swap", 24),
        (1, 2, "recompute", 24),
        (1, 2, "swap", 24),  # with pipeline micro-batching
        # 4 processes on 2 cores: half the workload keeps the test short (it still preempts and swaps).
        (2, 2, "swap", 12),
    ],
    ids=["tp2-recompute", "tp2-swap", "pp2-recompute", "pp2-swap", "tp2xpp2-swap"],
)
def test_same_tokens_as_one_process_under_preemption(tiny_llama, reference, tp, pp, mode, num_requests):
    # Two micro-batches in flight for pp2-swap; tp2-swap asks for them too, and without pipeline stages
    # there is nothing to split.
    micro = dict(pipeline_micro_batches=2) if mode == "swap" and tp * pp == 2 else {}
    with _parallel_engine(tiny_llama, tp, pp, mode, **micro) as llm:
        executor = llm.llm_engine.executor
        pids = executor.worker_pids
        assert len(pids) == tp * pp - 1
        assert llm.llm_engine.runner.num_micro_batches == (2 if (pp, mode) == (2, "swap") and tp == 1 else 1)
        _check_same_as_reference(llm, reference, mode, num_requests)
        # Weights are sharded at load time: each rank holds about 1/N of them.
        total = reference[4]
        per_rank = [r.weight_bytes for r in executor.reports]
        assert max(per_rank) < total / (tp * pp) * 1.15, (per_rank, total)
        assert sum(per_rank) >= total
    assert all(_gone(pid) for pid in pids), "shutdown() stops every worker"


def test_replicated_kv_head_biases_tied_and_padded_vocabulary(tmp_path, tokenizer_dir):
    """Qwen2 (q/k/v biases) with 1 KV head over 2 ranks (replicated), tied embeddings and a vocabulary
    that does not split evenly (1021 rows: the last shard is padded); the tied head over 2 stages."""
    model_dir = build_checkpoint(
        tmp_path / "qwen2",
        tokenizer_dir,
        arch="qwen2",
        num_key_value_heads=1,
        tie_word_embeddings=True,
        vocab_size=1021,
    )
    prompts, params = _workload(1021, n=12, seed=3)
    with LLM(str(model_dir), block_size=8, num_gpu_blocks_override=512) as single:
        expected, expected_logprobs = _generate(single, prompts, params)
    with LLM(str(model_dir), block_size=8, num_gpu_blocks_override=512, tensor_parallel_size=2) as llm:
        tokens, logprobs = _generate(llm, prompts, params)
        reports = llm.llm_engine.executor.reports
    assert tokens == expected
    # And both are transformers' own greedy continuations (the reference is not this engine).
    hf = HFGreedy(model_dir)
    for i, (prompt, param, ours) in enumerate(zip(prompts, params, tokens, strict=True)):
        if param.temperature == 0.0:
            assert ours == [hf(prompt, param.max_tokens)], f"request {i} ({len(prompt)} prompt tokens)"
    # The padded last shard of the vocabulary must not take part in the normalisation.
    _assert_logprobs_close(logprobs, expected_logprobs)
    assert "KV heads 0-0 of 1 (replicated)" in reports[1].description
    assert "rows 511-1020 of 1021" in reports[1].description
    # Two stages: the last one holds its own copy of the tied table (the first one embeds).
    with LLM(str(model_dir), block_size=8, num_gpu_blocks_override=512, pipeline_parallel_size=2) as llm:
        assert _generate(llm, prompts, params)[0] == expected
        assert isinstance(llm.llm_engine.model.lm_head, HeldByOtherStage)  # rank 0 is the first stage


@pytest.fixture(scope="module")
def budget_engines(tiny_llama):
    """TP=1 and TP=2 under the same per-rank memory budget, with the start-up log of the TP=2 one."""
    budget = dict(
        block_size=8,
        cpu_memory_budget_bytes=16 << 20,
        gpu_memory_utilization=0.5,
        max_model_len=128,
        max_num_batched_tokens=64,
        max_num_seqs=8,
    )
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = records.append
    log = logging.getLogger("kvpilot.engine")
    old_level = log.level
    log.setLevel(logging.INFO)
    log.addHandler(handler)
    try:
        single = LLM(str(tiny_llama), **budget)
        tp2 = LLM(str(tiny_llama), tensor_parallel_size=2, **budget)
    finally:
        log.removeHandler(handler)
        log.setLevel(old_level)
    yield single, tp2, [r.getMessage() for r in records]
    single.shutdown()
    tp2.shutdown()


def test_kv_pool_grows_with_tensor_parallelism(budget_engines):
    single, tp2, log = budget_engines
    one, two = single.llm_engine, tp2.llm_engine
    # Half the KV heads and half the weights per rank: more than twice the blocks in the same budget.
    assert two.kv_plan.bytes_per_block * 2 == one.kv_plan.bytes_per_block
    assert two.kv_plan.weights_bytes < one.kv_plan.weights_bytes * 0.55
    assert two.kv_plan.num_blocks >= 2 * one.kv_plan.num_blocks
    assert two.block_manager.num_blocks == two.kv_plan.num_blocks
    assert any("tensor_parallel_size 2 x pipeline_parallel_size 1 = 2 ranks" in line for line in log)
    assert any(
        f"{two.kv_plan.num_blocks:,} blocks x 8 tokens" in line and "each of the 2 ranks" in line
        for line in log
    )
    rank_lines = [line for line in log if "rank 1 (tp 1, stage 0)" in line]
    assert (
        rank_lines
        and "KV heads 1-1 of 2" in rank_lines[0]
        and f"KV {two.kv_plan.num_blocks:,} blocks" in rank_lines[0]
    )
    prompt = [{"prompt_token_ids": list(range(10, 40))}]
    params = SamplingParams(temperature=0.0, max_tokens=16)
    assert (
        tp2.generate(prompt, params)[0].outputs[0].token_ids
        == single.generate(prompt, params)[0].outputs[0].token_ids
    )


def test_model_info_metric_reports_real_head_counts(budget_engines):
    _, tp2, _ = budget_engines
    registry = CollectorRegistry()
    PrometheusStatLogger.from_engine(tp2.llm_engine, "tiny", registry=registry)
    text = generate_latest(registry).decode()
    info = next(line for line in text.splitlines() if line.startswith("kvpilot:model_config_info{"))
    for label in (
        'num_attention_heads="4"',
        'num_key_value_heads="2"',
        'tensor_parallel_size="2"',
        'pipeline_parallel_size="1"',
    ):
        assert label in info
    assert f'num_gpu_blocks="{tp2.llm_engine.kv_plan.num_blocks}"' in text


def test_idle_worker_death_turns_health_503_and_fails_the_next_step(budget_engines):
    """Runs last on this fixture: it kills the TP=2 engine's worker."""
    _, tp2, _ = budget_engines
    engine = tp2.llm_engine
    (pid,) = engine.executor.worker_pids

    async def main():
        ae = AsyncEngine(engine)
        ae.start()
        try:
            assert ae.is_healthy
            os.kill(pid, signal.SIGKILL)
            # No request is in flight: only the engine's watch on its workers can notice the death.
            await asyncio.to_thread(_wait_until, lambda: not ae.is_healthy)
            assert "WorkerDiedError" in ae.health_detail and "killed by SIGKILL" in ae.health_detail
        finally:
            ae.shutdown()

    asyncio.run(main())
    with pytest.raises(
        WorkerDiedError, match=rf"rank 1 \(tensor-parallel rank 1, pipeline stage 0, pid {pid}\)"
    ):
        tp2.generate({"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=4))
    assert _gone(pid)


def test_worker_killed_mid_generation_fails_fast(tiny_llama):
    with LLM(
        str(tiny_llama),
        block_size=8,
        num_gpu_blocks_override=1024,
        max_model_len=512,
        pipeline_parallel_size=2,
    ) as llm:
        (pid,) = llm.llm_engine.executor.worker_pids
        prompts = [{"prompt_token_ids": [5 + i, 6, 7]} for i in range(8)]
        params = SamplingParams(temperature=0.0, max_tokens=500, ignore_eos=True)
        running = threading.Event()
        # After a few steps, with hundreds to go: kill the worker from another thread, most likely while
        # a step is in flight (stage 0 sending to it, or the driver waiting for its sampled tokens).
        killed, steps_after_kill = threading.Event(), []

        def step_done(sched, it) -> None:
            if it.num_running_seqs:
                running.set()
            if killed.is_set():
                steps_after_kill.append(1)

        llm.llm_engine.stat_loggers.append(StepCallback(step_done))

        def kill():
            running.wait(60)
            time.sleep(0.003)
            os.kill(pid, signal.SIGKILL)
            killed.set()

        killer = threading.Thread(target=kill)
        killer.start()
        try:
            with pytest.raises(WorkerDiedError, match="killed by SIGKILL") as err:
                llm.generate(prompts, params)
        finally:
            killer.join()
        # The step in flight (or, if the kill fell between two, the next one) fails: no step after it
        # completes, and none waits for a collective's timeout (that error would name no rank).
        assert len(steps_after_kill) <= 1, f"{len(steps_after_kill)} steps completed after the kill"
        assert "pipeline stage 1" in str(err.value)


def test_worker_exception_mid_run_is_raised_with_its_message(tiny_llama):
    """A worker that raises (here: fed a malformed step through its pipe) reports its exception and
    exits; the engine's next step fails with that exception, not just "a peer closed the connection"."""
    with LLM(
        str(tiny_llama),
        block_size=8,
        num_gpu_blocks_override=64,
        tensor_parallel_size=2,
        distributed_timeout_s=120.0,
    ) as llm:
        executor = llm.llm_engine.executor
        assert executor.rank.spec.comm.timeout_s == 120.0  # what every rank's collectives wait at most
        llm.generate({"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=2))
        executor._workers[0].conn.send_bytes(encode(("execute", None)))
        with pytest.raises(WorkerDiedError, match=r"rank 1 \(pid \d+\): AttributeError: 'NoneType'") as err:
            llm.generate({"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=8))
        assert isinstance(err.value.__cause__, AttributeError)
        assert "finished_req_ids" in str(err.value.__cause__.__cause__)  # the worker's traceback


def _edited_checkpoint(tiny_llama, out_dir: Path, edit) -> Path:
    """A copy of the tiny checkpoint whose tensors dict went through ``edit`` (in place)."""
    out_dir.mkdir()
    for path in Path(tiny_llama).iterdir():
        if path.suffix != ".safetensors":
            (out_dir / path.name).write_bytes(path.read_bytes())
    (weights,) = Path(tiny_llama).glob("*.safetensors")
    tensors = load_file(weights)
    edit(tensors)
    save_file(tensors, out_dir / weights.name, metadata={"format": "pt"})
    return out_dir


def test_worker_error_at_start_up_is_raised_with_its_rank(tmp_path, tiny_llama):
    """Stage 1's layer lacks a tensor: the worker's own ValueError reaches the caller, nothing is left."""
    model_dir = _edited_checkpoint(
        tiny_llama, tmp_path / "broken", lambda t: t.pop("model.layers.1.mlp.down_proj.weight")
    )
    with pytest.raises(ValueError, match="lacks weights for: model.layers.1.mlp.down_proj.weight") as err:
        LLM(str(model_dir), num_gpu_blocks_override=64, max_model_len=128, pipeline_parallel_size=2)
    assert any("parallel worker rank 1" in note for note in getattr(err.value, "__notes__", []))


def test_checkpoint_errors_name_the_checkpoint_tensor(tmp_path, tiny_llama):
    """One loader at every size: a missing part of a fused parameter is named by its checkpoint tensor,
    and a tensor of the wrong shape by its name and both shapes."""
    no_k = _edited_checkpoint(
        tiny_llama, tmp_path / "no-k", lambda t: t.pop("model.layers.0.self_attn.k_proj.weight")
    )
    with pytest.raises(ValueError, match=r"lacks weights for: model\.layers\.0\.self_attn\.k_proj\.weight$"):
        LLM(str(no_k), num_gpu_blocks_override=64, max_model_len=128)

    def shrink(tensors):
        name = "model.layers.1.mlp.up_proj.weight"
        tensors[name] = tensors[name][:-1].clone()

    narrow = _edited_checkpoint(tiny_llama, tmp_path / "narrow", shrink)
    with pytest.raises(ValueError, match=r"checkpoint tensor model\.layers\.1\.mlp\.up_proj\.weight \(shape"):
        LLM(str(narrow), num_gpu_blocks_override=64, max_model_len=128)


def test_killed_driver_takes_its_workers_down(tiny_llama):
    code = (
        "import sys, time\n"
        "from kvpilot.engine import LLM\n"
        "llm = LLM(sys.argv[1], tensor_parallel_size=2, num_gpu_blocks_override=64, max_model_len=128)\n"
        "print(llm.llm_engine.executor.worker_pids[0], flush=True)\n"
        "time.sleep(120)\n"
    )
    driver = subprocess.Popen(
        [sys.executable, "-c", code, str(tiny_llama)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        ready, _, _ = select.select([driver.stdout], [], [], 120)
        assert ready, "the driver did not start its engine within 120 s"
        worker_pid = int(driver.stdout.readline())
        assert not _gone(worker_pid)
        driver.kill()
        driver.wait()
        _wait_until(lambda: _gone(worker_pid))  # the worker dies with its driver
    finally:
        if driver.poll() is None:
            driver.kill()
            driver.wait()


def test_invalid_sizes_are_rejected_with_the_allowed_values(tiny_llama):
    with pytest.raises(ConfigError, match=r"tensor_parallel_size 3 .* Allowed for this model: 1, 2, 4$"):
        LLM(str(tiny_llama), tensor_parallel_size=3)
    with pytest.raises(ConfigError, match=r"pipeline_parallel_size 3 exceeds the model's 2 layers.*1 to 2"):
        LLM(str(tiny_llama), pipeline_parallel_size=3)
    cfg = ModelConfig.from_pretrained(str(tiny_llama))
    with pytest.raises(ConfigError, match=r"2 x 2 = 4 ranks need one CUDA device each, but 2 are visible"):
        validate_parallel_sizes(cfg, 2, 2, "cuda", 2)
    assert validate_parallel_sizes(cfg, 2, 2, "cpu", 0).world_size == 4


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(pipeline_micro_batches=0), "pipeline_micro_batches must be a positive integer, got 0"),
        (dict(distributed_timeout_s=0), "distributed_timeout_s must be a positive number of seconds"),
        (dict(distributed_timeout_s="5"), "distributed_timeout_s must be a positive number of seconds"),
    ],
)
def test_parallel_engine_args_are_validated(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        EngineArgs(model="x", **kwargs)


def test_layout_splits_heads_layers_and_vocabulary():
    raw = dict(
        architectures=["LlamaForCausalLM"],
        vocab_size=1001,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=5,
        num_attention_heads=8,
        num_key_value_heads=2,
    )
    cfg = ModelConfig.from_dict(raw)
    layout = validate_parallel_sizes(cfg, 4, 2, "cpu", 0)
    shards = [layout.shard(r) for r in range(8)]
    assert [(s.layer_start, s.layer_end) for s in shards[::4]] == [(0, 3), (3, 5)]
    assert [s.q_head_start for s in shards[:4]] == [0, 2, 4, 6]
    assert [s.kv_head_start for s in shards[:4]] == [0, 0, 1, 1]  # 2 KV heads over 4 ranks: replicated
    assert [s.vocab_start for s in shards[:4]] == [0, 251, 502, 753] and shards[0].num_vocab_rows == 251
    assert [s.rank for s in shards if s.is_sampler] == [4]
    with pytest.raises(ConfigError, match="Allowed for this model: 1, 2, 4, 8$"):
        validate_parallel_sizes(cfg, 3, 1, "cpu", 0)


@pytest.mark.parametrize(
    "lengths, num, expected",
    [
        ([1, 1, 1, 1, 1], 2, [[1, 1, 1], [1, 1]]),
        ([1, 1, 100], 2, [[1, 1], [100]]),
        ([100, 1, 1], 2, [[100], [1, 1]]),
        ([5], 3, [[5]]),
        ([1, 1, 1], 4, [[1], [1], [1]]),
    ],
)
def test_pipeline_micro_batches_are_contiguous_balanced_and_non_empty(lengths, num, expected):
    items = [SimpleNamespace(num_tokens=n) for n in lengths]
    runs = [items[a:b] for a, b in split_micro_batches(items, num)]
    assert [[i.num_tokens for i in run] for run in runs] == expected
    assert [i for run in runs for i in run] == items
