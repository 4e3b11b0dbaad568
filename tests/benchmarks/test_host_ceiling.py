"""``benchmarks/host_ceiling.py`` runs the whole stack on the stand-in forward at a tiny size, one and two API servers,
greedy and sampled, and prints every level's per-stage table; its stages are read off real sampled stacks."""

from __future__ import annotations

import json
import os
import sys
import threading
from pathlib import Path

from tests.benchmarks.scripts import run_script
from tests.helpers import load_script

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def test_a_tiny_sweep_prints_each_level_by_process_and_stage(tmp_path):
    # py-spy is the stages' sampler (a test dependency): without it every stage would read 'other' and this fails
    result = run_script("host_ceiling.py", "--concurrency", "2", "--api-servers", "1,2", "--requests", "16",
                        "--output-tokens", "8", "--prompt-words", "4", "--n", "2", "--vocab-size", "4096", "--rate",
                        "100", "--json", env={"TMPDIR": str(tmp_path)})
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    # the model, the logs and py-spy's files went with the scratch directory (the engines' torch caches stay)
    assert not list(tmp_path.glob("bench-*")), list(tmp_path.iterdir())
    levels = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    assert [(lv["api_servers"], lv["mode"], lv["concurrency"]) for lv in levels] == [
        (1, "greedy", 2), (1, "sampled", 2), (2, "greedy", 2), (2, "sampled", 2)]
    for level in levels:
        # staggered lengths 4-12 per choice over 16 requests, n 2 when sampled: each level's tokens all streamed
        assert level["tokens"] >= 16 * 4 * (2 if level["mode"] == "sampled" else 1), level
        assert level["tokens_per_s"] > 0 and level["ceiling_tokens_per_s"] > 0
        assert level["ms_per_1k"]["server"] > 0 and level["ms_per_1k"]["engines"] > 0, level
        assert set(level["waited_ms_per_1k"]) == {"server", "coordinator", "engines"}, level
        assert min(level["waited_ms_per_1k"].values()) >= 0, level
    sampled_stages = set().union(*(level["stages"] for level in levels))
    # stacks were read and named (which stages a tiny sweep's few samples land in depends on the host's load: on a
    # loaded one, only transport's; the names of each stage are checked below, stack by stack)
    assert sampled_stages - {"other"}, sampled_stages
    server_stages = {stage for level in levels for stage, row in level["stages"].items() if row["server"] > 0}
    assert server_stages - {"other"}, server_stages  # the HTTP servers' samples too
    assert result.stdout.count("| process total") == 4
    assert result.stdout.count("| waiting for a core (not CPU)") == 4


def test_a_stack_is_named_by_its_innermost_claimed_frame():
    profile = load_script("stage_profile", BENCHMARKS / "stage_profile.py")
    loop = ["run (asyncio/runners.py:118)", "_run (asyncio/events.py:80)"]
    assert profile.stage_of([*loop, "deliver (megatron_serve/server/generation.py:270)",
                             "add (megatron_serve/client/output_processor.py:110)",
                             "append (megatron_serve/client/detokenizer.py:100)",
                             "decode (tokenizers/implementations/base_tokenizer.py:1)"]) == "detokenize"
    assert profile.stage_of([*loop, "deliver (megatron_serve/server/generation.py:270)",
                             "add (megatron_serve/client/output_processor.py:110)"]) == "output processing"
    assert profile.stage_of([*loop, "submit (megatron_serve/server/generation.py:150)"]) == "dispatch"
    assert profile.stage_of([*loop, "data_received (uvicorn/protocols/http/httptools_impl.py:1)"]) == "HTTP parse"
    assert profile.stage_of(["step (megatron_serve/engine/process/loop.py:1)",
                             "sample (megatron_serve/engine/sampling/sampler.py:1)"]) == "sample"
    assert profile.stage_of(["step (megatron_serve/engine/process/loop.py:1)"]) == "engine loop"
    assert profile.stage_of(loop) == "event loop"  # uvloop's C side: sockets, callbacks
    assert profile.stage_of(["<module> (megatron_serve/cli.py:1)", "collect (gc:1)"]) == "other"


def test_the_stand_in_gives_fixed_rows_of_the_vocabulary():
    sys.path.insert(0, str(BENCHMARKS / "stand_in"))
    try:
        forward = load_script("stand_in_forward", BENCHMARKS / "stand_in" / "stand_in_forward.py")
    finally:
        sys.path.remove(str(BENCHMARKS / "stand_in"))
    import torch

    logits = forward.FixedLogits()
    first = logits.take(3, 1000, torch.device("cpu")).clone()
    assert first.shape == (3, 1000)
    assert torch.equal(logits.take(100, 1000, torch.device("cpu"))[:3], first)  # grown: the same rows again
    assert (first[:, : forward.TRAINED_WORDS].mean() > first[:, forward.TRAINED_WORDS:].mean() + 5)


def test_each_thread_reads_its_cpu_and_its_wait_for_a_core():
    profile = load_script("stage_profile", BENCHMARKS / "stage_profile.py")
    sum(range(2_000_000))  # some CPU of this thread's own
    name, on_cpu, waited = profile.thread_cpu_seconds(os.getpid())[threading.get_native_id()]
    assert name and on_cpu > 0 and waited >= 0
    assert profile.thread_cpu_seconds(2**22 + 1) == {}  # no such process: nothing, not an error
