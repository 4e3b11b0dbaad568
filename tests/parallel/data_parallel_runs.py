"""Engines of data-parallel attention as the tests run them: one process per data-parallel rank (each an engine
with its own scheduler and requests, starting its own tensor-parallel ranks), meeting at ``MASTER_ADDR``, stepping
together while any has work (:mod:`megatron_serve.engine.data_parallel`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

from megatron_serve.engine.tensor_parallel import free_port

# A script file, not ``-c``: each tensor-parallel rank's process is spawned and imports it again, so the switch at
# its top level (the control of the ordered combine) reaches every rank.
ENGINE = textwrap.dedent('''
    import json, os, sys
    from megatron_serve.model import token_dispatcher

    if os.environ.get("UNORDERED_COMBINE") == "1":  # the control: every rank sums a token's experts in float32
        ordered_sum = token_dispatcher.weighted_sum
        token_dispatcher.weighted_sum = lambda outputs, weights, tokens, count, ordered: ordered_sum(
            outputs, weights, tokens, count, False)


    def main():
        from megatron_serve import InferenceConfig, SamplingParams
        from megatron_serve.engine import DynamicInferenceEngine
        from megatron_serve.wire.request import DynamicInferenceRequest

        model_dir, out, options = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
        runs, new_tokens = options.pop("runs"), options.pop("new_tokens")
        engine = DynamicInferenceEngine.from_model_dir(model_dir, InferenceConfig(
            block_size_tokens=8, device="cpu", enable_expert_parallel=options["data_parallel_size"] > 1 or
            options["tensor_parallel_size"] > 1, **options))
        results = []
        try:
            for n, prompts in enumerate(runs):
                requests = [DynamicInferenceRequest(f"r{n}-{i}", None, engine.tokenizer.encode(p), SamplingParams(
                    temperature=0.0, num_tokens_to_generate=new_tokens, ignore_eos=True, return_log_probs=True,
                    return_routing_indices=True)) for i, p in enumerate(prompts)]
                for request in requests:
                    engine.add_request(request)
                while engine.group_busy(engine.has_unfinished_requests()):
                    engine.step()
                results.append([[r.generated_tokens, r.generated_log_probs, r.routing_indices.tolist()]
                                for r in requests])
        finally:
            engine.shutdown()
        with open(out, "w") as f:
            json.dump(results, f)


    if __name__ == "__main__":
        main()
''')


def serve_data_parallel(model_dir: str, tmp_path: Path, runs: list[list[list[str]]], tp: int = 1,
                        dtype: str = "float32", new_tokens: int = 8, unordered: bool = False,
                        **config) -> list[list[list]]:
    """``runs[d]``: data-parallel rank ``d``'s runs, each a list of prompts served at once (an empty one: that rank
    idles while the others serve theirs). Returns each rank's runs' ``[tokens, log probs, routing]`` per request."""
    dp = len(runs)
    script = tmp_path / "engine.py"
    script.write_text(ENGINE)
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
               UNORDERED_COMBINE="1" if unordered else "0")
    outs = [tmp_path / f"dp{dp}-tp{tp}-{rank}-{unordered}.json" for rank in range(dp)]
    procs = []
    for rank in range(dp):
        options = dict(config, runs=runs[rank], new_tokens=new_tokens, dtype=dtype, tensor_parallel_size=tp,
                       data_parallel_size=dp, data_parallel_rank=rank)
        procs.append(subprocess.Popen([sys.executable, str(script), model_dir, str(outs[rank]), json.dumps(options)],
                                      env=env))
    try:
        codes = [p.wait(timeout=600) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert codes == [0] * dp
    return [json.loads(out.read_text()) for out in outs]
