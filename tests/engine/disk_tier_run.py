"""One engine process of the disk-tier tests (``python -m tests.engine.disk_tier_run '<json>'``).

It serves a tiny model with the node's disk tier (or without it), optionally refits first, runs the prompts it is
given one at a time and prints one JSON line: each prompt's tokens, log probs and cached tokens, and what its disk
tier did. Several of these, one after the other or at once, are the engines of one node. The engine is driven step
by step, with its vocabulary only: token ids in and out, so the process imports neither ``transformers`` nor the
client's event loop (about 2 s of CPU each).
"""

from __future__ import annotations

import json
import random
import sys

from megatron_serve import DynamicInferenceRequest, InferenceConfig, SamplingParams
from megatron_serve.engine.core import DynamicInferenceEngine

BLOCK = 16
POOL = 24  # device blocks: under five prompts' worth
HOST_BLOCKS = 8  # host slots: a prompt's five blocks come back through them
BLOCK_BYTES = 8192  # the tiny model's block (checked below)
PARAMS = SamplingParams(temperature=0.0, num_tokens_to_generate=4, ignore_eos=True, return_log_probs=True)


def prompts(count: int = 14, length: int = 5 * BLOCK + 3, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(5, 500) for _ in range(length)] for _ in range(count)]


def config(disk: str | None, disk_bytes: int = 2**20) -> InferenceConfig:
    """The engines' configuration: the node's disk tier in ``disk`` (None: without it)."""
    return InferenceConfig(block_size_tokens=BLOCK, num_kv_blocks=POOL, max_requests=2, max_batch_tokens=256,
                           kv_offloading_size=HOST_BLOCKS * BLOCK_BYTES / 2**30, batch_invariant=True,
                           **({} if disk is None else {"kv_offloading_backend": "disk", "kv_disk_dir": disk,
                                                       "kv_disk_size": disk_bytes / 2**30}))


def main(spec: dict) -> dict:
    settings = config(spec.get("disk"), spec.get("disk_bytes", 2**20))
    engine = DynamicInferenceEngine.from_model_dir(spec["model"], settings, vocabulary_only=True)
    assert engine.host_tier.block_bytes == BLOCK_BYTES, engine.host_tier.block_bytes
    if spec.get("refit"):
        engine.memory.refit(spec["model"])  # the same weights under a new epoch
    every = prompts()
    outputs = []
    for index in spec["run"]:  # one at a time, each to its end
        request = DynamicInferenceRequest(str(index), "", every[index], PARAMS)
        engine.add_request(request)
        while engine.has_unfinished_requests():
            engine.step()
        outputs.append(request)
        # its spills written before the next prompt pushes more out: on a loaded machine the writer thread fell
        # behind, every staging row was taken and spills were dropped by design (engine.kv.disk_io), so the blocks
        # the tests expect on disk were missing (CI run 14)
        engine.host_tier.flush()
    tier = engine.host_tier.disk
    answer = {"tokens": [o.generated_tokens for o in outputs], "log_probs": [o.generated_log_probs for o in outputs],
              "cached": [o.cached_tokens for o in outputs], "epoch": engine.epoch,
              "disk": None if tier is None else {"written": tier.written, "hits": tier.hits, "corrupt": tier.corrupt,
                                                 "evicted": tier.evicted,
                                                 "dropped": engine.host_tier.disk_io.dropped}}
    engine.shutdown()
    return answer

if __name__ == "__main__":
    print(json.dumps(main(json.loads(sys.argv[1]))))
