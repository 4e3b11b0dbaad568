"""``benchmarks/speculative.py`` end to end on a pair trained in seconds, warmed up (each engine serves a round of
other prompts first) and cold (``--warm-and-cold``: both tables in one run): every method's rows, greedy, sampled and sampled with n choices a prompt, the
tokens (seeded, sampled too) equal to no speculation's."""

from __future__ import annotations

from pathlib import Path

import torch

from tests.benchmarks.scripts import run_script
from tests.helpers import script_module

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "speculative.py"
PAIR_SCRIPT = SCRIPT.with_name("speculative_pair.py")
TRAIN_STEPS = 30


def train_pair(cache_dir: Path) -> None:
    """The script's pair (its ``trained_pair`` at ``--train-steps``), trained here into ``--cache-dir``: this process
    has transformers' model classes imported already, the script's interpreter spent ~3 CPU-s importing them. One
    thread, as the script trains (two on the loaded 2-core machine stall on OpenMP barriers)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with script_module("speculative_pair", PAIR_SCRIPT) as pair:
            pair.trained_pair(cache_dir, pair.PairSettings(steps=TRAIN_STEPS))
    finally:
        torch.set_num_threads(threads)


Table = dict[tuple[str, str, str, str], list[str]]


def rows(lines: list[str]) -> Table:
    """A table's rows, keyed by (workload, sampling, concurrency, method)."""
    table = [line.split() for line in lines if line.startswith(("grammar ", "edit "))]
    return {tuple(cells[:4]): cells[4:] for cells in table}  # type: ignore[misc]


def warm_and_cold(tmp_path: Path) -> tuple[Table, Table]:
    """Both tables from one run of the script (``--warm-and-cold``: one interpreter, one pair loaded)."""
    # one thread: the script sets torch's and OMP_NUM_THREADS itself (--threads, default 1)
    result = run_script("speculative.py", "--train-steps", str(TRAIN_STEPS), "--concurrency", "1,4", "--requests-c1",
                        "2", "--new-tokens", "8", "--n", "2", "--methods", "none,ngram,draft_model", "--cache-dir",
                        str(tmp_path), "--warm-and-cold")
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    assert lines.count("warm:") == lines.count("cold:") == 1 and lines.index("warm:") < lines.index("cold:"), lines
    cold = lines.index("cold:")
    return rows(lines[:cold]), rows(lines[cold:])


def test_the_benchmark_runs_every_method_warm_and_cold(tmp_path):
    train_pair(tmp_path)
    warm, cold = warm_and_cold(tmp_path)
    expected = {(w, s, c, m) for w, c in (("grammar", "1"), ("grammar", "4"))
                for s in ("greedy", "sampled", "sampled-n2") for m in ("none", "ngram", "draft_model")}
    expected |= {("edit", "greedy", "1", m) for m in ("none", "ngram")}
    assert set(warm) == set(cold) == expected
    for key, cells in [*warm.items(), *cold.items()]:
        assert cells[-1] == "yes", key  # speculation emits no speculation's tokens, greedy or seeded sampled
    for table in (warm, cold):  # prompt lookup drafts on the edit workload (mean K, the column before "yes")
        assert float(table["edit", "greedy", "1", "ngram"][-2]) > 0
