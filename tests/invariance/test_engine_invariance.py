"""``--batch-invariant``: a request's log probs and tokens are bitwise its own, whatever else is in the step.

The target (40 prompt tokens, 16 generated) runs alone, then among 7 and 63 (float32 dense:
also 255) random requests of random lengths (seeded and unseeded sampling), with prefill chunks
of 16 tokens, after a prefix-cache hit, in the serial loop and in a pool so small that
requests are preempted and recomputed. Every run must equal the lone run with ``==``. The control:
without the mode some of the same runs change the target's log probs.
"""

from __future__ import annotations

import pytest

from .runs import Setup, differing, run_target

# Dropped as repetitions (each costs an engine per architecture and dtype): 1 other (the batched path of 7 and 63,
# with fewer rows) and chunks of 64 tokens (the chunked prefill of 16, split at other places).
VARIANTS = [
    Setup(others=7),
    Setup(others=63),
    Setup(others=3, max_batch_tokens=16),
    Setup(prefix_hit=True),
    Setup(others=7, async_scheduling=False),
    Setup(others=7, num_kv_blocks=10),
]


@pytest.mark.parametrize("arch, dtype", [("llama", "float32"), ("llama", "bfloat16"), ("qwen3_moe", "float32"),
                                         ("qwen3_moe", "bfloat16")])
def test_the_target_is_bitwise_the_same_in_every_batch(models, arch, dtype):
    alone = run_target(models[arch], dtype, True, Setup())
    variants = VARIANTS + ([Setup(others=255)] if (arch, dtype) == ("llama", "float32") else [])
    problems = []
    for setup in variants:
        run = run_target(models[arch], dtype, True, setup)
        if run.tokens != alone.tokens or run.log_probs != alone.log_probs:
            problems.append(f"{setup.describe()}: {differing(run.log_probs, alone.log_probs)} of "
                            f"{len(alone.log_probs)} log probs differ, tokens equal: {run.tokens == alone.tokens}")
        if setup.num_kv_blocks:
            assert run.preemptions, "the small pool preempted nothing: the test does not test recompute"
    assert not problems, "\n".join(problems)


def test_sampled_with_a_seed_is_bitwise_the_same_in_every_batch(models):
    alone = run_target(models["llama"], "bfloat16", True, Setup(), sampled=True)
    for setup in (Setup(others=7), Setup(others=3, max_batch_tokens=16), Setup(prefix_hit=True)):
        run = run_target(models["llama"], "bfloat16", True, setup, sampled=True)
        assert (run.tokens, run.log_probs) == (alone.tokens, alone.log_probs), setup.describe()


def test_without_the_mode_recompute_and_bfloat16_chunks_change_log_probs(models):
    """The control: without the mode, runs above change the target's arithmetic. On a CPU in float32 most of them
    do not any more (the C++ attention kernels sum each row in an order of its own, whatever the batch or chunk, and
    oneDNN keeps rows apart from two on): there it is a request recomputed after preemption, whose generated
    tokens' keys then come from a prefill forward instead of decode steps; in bfloat16 (torch's flash kernel, tiled
    by the chunk) prefill in chunks of 16."""
    for dtype, setup in (("float32", Setup(others=7, num_kv_blocks=10)),
                         ("bfloat16", Setup(others=3, max_batch_tokens=16))):
        alone = run_target(models["llama"], dtype, False, Setup())
        assert differing(run_target(models["llama"], dtype, False, setup).log_probs, alone.log_probs), \
            f"{dtype}, {setup.describe()}: the same log probs without the mode"


@pytest.mark.parametrize("invariant", [True, False])
def test_tensor_parallel_alone_and_batched(models, invariant):
    """TP=2 over gloo: the mode gathers the partial sums and adds them in rank order (no ring all-reduce)."""
    alone = run_target(models["llama"], "float32", invariant, Setup(tensor_parallel_size=2))
    batched = run_target(models["llama"], "float32", invariant, Setup(others=7, tensor_parallel_size=2))
    if invariant:
        assert (batched.tokens, batched.log_probs) == (alone.tokens, alone.log_probs)
    else:
        assert differing(batched.log_probs, alone.log_probs), "the control does not differ without the mode"
