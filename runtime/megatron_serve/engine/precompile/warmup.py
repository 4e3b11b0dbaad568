"""Compiling every kernel variant an engine can meet before it serves: nothing compiles mid-serving.

Triton compiles a kernel once per variant: its constexprs (tile sizes, the decode split count) and
the value class of the integer arguments it specializes on. A variant depends on the step's shape,
and the first step that meets a new one waits for the compile with every request in it: 1.9-2.8 s
for the other prefill tile on an H100, measured mid-serving. What picks a variant:

* the prefill tile (64 or 128 query rows) and the row tiles of the element-wise kernels (norms,
  rotary, cache writes, activation): the step's token count, in powers of two;
* the mixture-of-experts blocks: the step's (token, expert) pairs, which follow its token count;
* decode split-K (1 to 32 splits, powers of two): the batch size against the context width.

So before serving, the engine runs one synthetic step per class: a prefill chunk of 1, 2, 4 ...
``max_batch_tokens`` tokens; a decode batch of 1, 2, 4 ... ``max_requests`` sequences at the full
context width; one sequence at widths of 1, 2, 4 ... blocks. The last two sweeps meet every split
count a decode step can choose: the count grows with the width and shrinks with the batch, so any
count reachable by some (batch, width) is reached by one sequence at some width
(``tests/kernels/test_launch.py`` checks it). Nothing is written to the cache (every slot is -1);
attention reads whatever the first blocks hold, and the outputs are dropped.

Tensor-parallel ranks run the same sweep in lockstep (their forwards all-reduce), each on its own:
the sweep is a function of the configuration, which every rank shares.
"""

from __future__ import annotations

import logging
import time
from typing import Iterator

import numpy as np
import torch

from megatron_kernels.ops import backend_for

from ..step_plan import StepBuffers, StepPlan

logger = logging.getLogger(__name__)


def powers_of_two_to(limit: int) -> list[int]:
    """1, 2, 4 ... up to ``limit``, and ``limit`` itself."""
    sizes, size = [], 1
    while size < limit:
        sizes.append(size)
        size *= 2
    return sizes + [limit]


def warmup_shapes(max_tokens: int, max_requests: int, max_blocks: int, block_size: int
                  ) -> Iterator[tuple[str, int, int]]:
    """``(kind, count, blocks)``: prefill steps of ``count`` tokens (in chunks of at most ``blocks`` blocks), decode
    batches of ``count`` sequences at ``blocks`` blocks of context each."""
    for tokens in powers_of_two_to(min(max_tokens, max_requests * max_blocks * block_size)):
        yield "prefill", tokens, max_blocks
    for batch in powers_of_two_to(min(max_requests, max_tokens)):
        yield "decode", batch, max_blocks
    for blocks in powers_of_two_to(max_blocks)[:-1]:
        yield "decode", 1, blocks


def write_synthetic(buffers: StepBuffers, kind: str, count: int, blocks: int, block_size: int,
                    num_pool_blocks: int) -> StepPlan:
    """A step of the given shape in ``buffers`` that writes no cache slot."""
    out = buffers.np
    buffers.writable()
    out["token_ids"][:count] = 0
    out["positions"][:count] = 0  # positions pick no variant; 0 stays inside every rotary table
    out["slots"][:count] = -1
    if kind == "prefill":  # chunks of at most ``blocks`` blocks, each a request of its own
        chunk = min(count, blocks * block_size)
        lengths = [chunk] * (count // chunk) + ([count % chunk] if count % chunk else [])
        width = -(-chunk // block_size)
        requests = len(lengths)
        out["seq_lens"][:requests] = lengths
        out["query_start"][: requests + 1] = np.cumsum([0, *lengths])
        out["block_tables"][:requests, :width] = np.arange(width) % num_pool_blocks
        out["lm_rows"][:requests] = np.cumsum(lengths) - 1
        return StepPlan(num_tokens=count, num_decode=0, num_prefill=requests, block_width=width,
                        num_sample=requests, num_score=0)
    out["seq_lens"][:count] = blocks * block_size
    out["block_tables"][:count, :blocks] = np.arange(blocks) % num_pool_blocks
    out["lm_rows"][:count] = np.arange(count)
    return StepPlan(num_tokens=count, num_decode=count, num_prefill=0, block_width=blocks, num_sample=count,
                    num_score=0)


def compile_kernels(run_plan, buffers: StepBuffers, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                    block_size: int) -> float:
    """Run the sweep through ``run_plan`` (a runner's eager forward); returns the seconds it took.

    Only the Triton backend compiles; the reference ops have nothing to prepare (returns 0 at once).
    """
    device = buffers.device
    if backend_for(device) != "triton" or not kv_caches:
        return 0.0
    started = time.perf_counter()
    num_pool_blocks = kv_caches[-1][0].shape[0]  # the last layer: a pipeline stage holds no cache of those before it
    steps = 0
    for kind, count, blocks in warmup_shapes(buffers.max_tokens, buffers.max_requests, buffers.max_blocks, block_size):
        run_plan(write_synthetic(buffers, kind, count, blocks, block_size, num_pool_blocks), kv_caches)
        steps += 1
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - started
    logger.info("compiled the kernels of every step shape (%d synthetic steps) in %.1fs", steps, seconds)
    return seconds
