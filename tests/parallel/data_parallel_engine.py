"""One data-parallel attention rank's engine process, as the tests run it (``python data_parallel_engine.py IN OUT``):
it serves every case of its group one after another, each an engine of its own meeting the other ranks at the case's
``MASTER_PORT``, and writes each case's finished requests (pickled ``DynamicInferenceRequest`` objects).

Run as a script, not ``-c``: each tensor-parallel rank's process (forked from a fork server) imports this file again,
so the controls installed at its top level reach every rank: the ordered combine's (``UNORDERED_COMBINE``) and the
gathered row-parallel layers' (``PARTIAL_SUMS``). They read their variable when called, so a case turns them on or off
for the engine it builds (its ranks take rank 0's variables as they start). So does the CPU stand-in for CUDA graphs
(``GRAPHS``: the engine captures and replays its steps as on a GPU, a "replay" running the captured forward again over
the same static buffers), which notes each replay's size and each empty MoE pass's buffer size in ``GRAPH_LOG/<pid>``.
"""

from __future__ import annotations

import json
import os
import pickle
import sys
from typing import Any

from megatron_serve import InferenceConfig
from megatron_serve.model.experts import token_dispatcher

if __name__ in ("__main__", "__mp_main__"):  # this group's processes only, never a test process that imports this
    _weighted_sum = token_dispatcher.weighted_sum

    def _maybe_unordered(outputs, weights, tokens, count, ordered, top_k):
        """The control: with ``UNORDERED_COMBINE=1`` every rank sums a token's experts in float32."""
        return _weighted_sum(outputs, weights, tokens, count, ordered and os.environ.get("UNORDERED_COMBINE") != "1",
                             top_k)

    token_dispatcher.weighted_sum = _maybe_unordered
    _gathers_rows = InferenceConfig.gathers_rows

    def _maybe_partial_sums(config: InferenceConfig) -> bool:
        """The control: with ``PARTIAL_SUMS=1`` row-parallel layers add the ranks' partial sums (in rank order)."""
        return _gathers_rows.fget(config) and os.environ.get("PARTIAL_SUMS") != "1"

    InferenceConfig.gathers_rows = property(_maybe_partial_sums)  # type: ignore[method-assign]

    from megatron_serve.engine.precompile import graphs
    from megatron_serve.engine.runner import ModelRunner

    def _note(line: str) -> None:
        with open(os.path.join(os.environ["GRAPH_LOG"], str(os.getpid())), "a") as log:
            log.write(line + "\n")

    class _ReplayByRerun:
        """``CudaGraphCapture`` on CPU: the capture runs the forward once, a replay runs it again."""

        def __init__(self, device):
            pass

        def __call__(self, forward):
            outputs = forward()

            def replay():
                _note(f"replay {outputs[0].shape[0]}")
                return forward()

            return replay

    _graphs_wanted, _capture, _empty_pass = graphs.graphs_wanted, graphs.CudaGraphCapture, ModelRunner.empty_moe_pass
    graphs.graphs_wanted = lambda config, device: _graphs_wanted(config, device) or os.environ.get("GRAPHS") == "1"
    graphs.CudaGraphCapture = lambda device: (_ReplayByRerun if os.environ.get("GRAPHS") == "1" else _capture)(device)

    def _noting_empty_pass(self, group_tokens):
        if os.environ.get("GRAPHS") == "1":
            _note(f"empty {self.padded_size(group_tokens)}")
        return _empty_pass(self, group_tokens)

    ModelRunner.empty_moe_pass = _noting_empty_pass


def serve_case(case: dict[str, Any]) -> list[list]:
    """Every run of one case on this rank: ``case["runs"]`` holds this rank's runs, each a list of ``(request id,
    prompt tokens or text, SamplingParams, arrival step)`` served together. The ranks step together while any has
    work or a request still to arrive; a rank with nothing runs the empty MoE passes."""
    from megatron_serve.engine import DynamicInferenceEngine  # noqa: PLC0415
    from megatron_serve.wire.request import DynamicInferenceRequest  # noqa: PLC0415

    engine = DynamicInferenceEngine.from_model_dir(case["model_dir"], InferenceConfig(**case["config"]))
    served = []
    try:
        for run in case["runs"]:
            requests = [(arrival, DynamicInferenceRequest(
                request_id, None, engine.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt), params))
                for request_id, prompt, params, arrival in run]
            pending = sorted(requests, key=lambda pair: pair[0])
            step = 0
            while engine.group_turn(bool(pending) or engine.has_unfinished_requests()).step:
                while pending and pending[0][0] <= step:
                    engine.add_request(pending.pop(0)[1])
                engine.step()
                step += 1
            served.append([request for _, request in requests])
    finally:
        engine.shutdown()
    return served


def follow_case(case: dict[str, Any]) -> None:
    """Tensor-parallel rank ``case["tp_rank"]`` (not 0) of the case's engine, started with the group's rendezvous
    environment (``WORLD_SIZE``, ``RANK``): what a rank spawned by rank 0's engine runs, until that engine stops."""
    import threading  # noqa: PLC0415

    from megatron_serve.engine.group.follower import run_worker  # noqa: PLC0415
    from megatron_serve.engine.group.placement import Placement  # noqa: PLC0415

    size = case["config"]["tensor_parallel_size"]
    placement = Placement(size, case["tp_rank"], 1, os.environ["MASTER_ADDR"], case["port"])
    run_worker(case["model_dir"], case["config"], placement, case["tp_rank"], 0, threading.Event())


def main() -> None:
    """``data_parallel_engine.py IN OUT``: one rank; ``data_parallel_engine.py --serve FD``: for each line of stdin
    (a group: a JSON list ``[IN, OUT, IN, OUT...]``) a rank per pair, each a child forked from this process, which
    imports the engine once for every group (a process's start, importing torch, costs more than a case); how many of
    them failed goes back as a line on file descriptor ``FD`` once all have exited. The end of stdin ends it."""
    if sys.argv[1] != "--serve":
        serve_rank(sys.argv[1], sys.argv[2])
        return
    # the checkout's root, for tests.forked (this script's own folder, sys.path[0], is tests/parallel)
    sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    from tests.forked import fork_ranks  # noqa: PLC0415

    from megatron_serve.engine import DynamicInferenceEngine  # noqa: F401, PLC0415 - imported once, for every rank
    # so is the transformers tokenizer each rank's engine loads (0.7 CPU-s of imports a rank, the tiny models' one)
    from transformers.tokenization_utils_tokenizers import TokenizersBackend  # noqa: F401, PLC0415
    with os.fdopen(int(sys.argv[2]), "w") as replies:
        for line in sys.stdin:
            pairs = json.loads(line)
            replies.write(f"{fork_ranks(serve_rank, zip(pairs[::2], pairs[1::2], strict=True))}\n")
            replies.flush()


def serve_rank(inputs: str, out: str) -> None:
    with open(inputs, "rb") as f:
        cases = pickle.load(f)
    os.environ.update(cases[0].get("env", {}))  # this process's placement (a tensor-parallel rank of its own)
    results = {}
    for case in cases:
        os.environ["MASTER_PORT"] = str(case["port"])
        os.environ["UNORDERED_COMBINE"] = "1" if case["unordered"] else "0"
        os.environ["PARTIAL_SUMS"] = "1" if case["partial_sums"] else "0"
        os.environ["GRAPHS"] = "1" if case["graphs"] else "0"
        os.environ["GRAPH_LOG"] = case["graph_log"]
        if case["tp_rank"]:
            follow_case(case)
        else:
            results[case["name"]] = serve_case(case)
    with open(out, "wb") as f:
        pickle.dump(results, f)
    if any(case["tp_rank"] for case in cases):
        # as a spawned rank ends (multiprocessing's os._exit): the interpreter's teardown can abort on a thread the
        # process groups left ("terminate called without an active exception")
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


if __name__ == "__main__":
    main()
