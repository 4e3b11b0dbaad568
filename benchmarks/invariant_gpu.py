"""``--batch-invariant`` on a GPU: decode throughput of the mode against the default, Llama-3.2-1B shape.

One run loads the random bf16 checkpoint twice (the mode switches a model's ops for good), builds one
engine per mode sized for the largest batch (CUDA graphs on: in the mode the attention is
``triton_invariant_attention`` and graphs capture it) and, per batch size, runs ``batch`` greedy
requests of ``--prompt-len`` tokens generating ``--new-tokens`` each, once to warm up (every kernel
variant compiled) and once timed. It prints, per batch, the steady decode tokens/s of each mode (from
every request's first token to the first finish), whole-run tokens/s, and the mode's fraction of the
default's; then whether request 0 got the same log probs, ``==``, at every batch size in each mode (the
mode must say yes; the default is the control). The issue's goal: at least 0.95x at batch 256.

    python benchmarks/invariant_gpu.py [--batches 1,64,256] [--prompt-len 128 --new-tokens 128]
    python benchmarks/invariant_gpu.py --smoke     # tiny model, CPU allowed: the plumbing in seconds
"""

from __future__ import annotations

import argparse
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from cli_options import add_number_options
from decode_roofline import LLAMA_SHAPES, build_checkpoint, free_memory, make_engine, sync


@dataclass
class Run:
    decode_tokens_per_s: float
    tokens_per_s: float
    first_log_probs: list[float]


def run_batch(engine, shape: dict, batch: int, prompt_len: int, new_tokens: int, tag: str,
              device: torch.device) -> Run:
    """``batch`` greedy requests at once; request ``i``'s prompt is the same in every batch (seeded by ``i``)."""
    from megatron_serve import SamplingParams  # noqa: PLC0415
    from megatron_serve.wire.request import DynamicInferenceRequest  # noqa: PLC0415

    params = SamplingParams(temperature=0.0, num_tokens_to_generate=new_tokens, ignore_eos=True,
                            return_log_probs=True)
    requests = []
    for i in range(batch):
        tokens = torch.randint(2, shape["vocab_size"], (prompt_len,), generator=torch.Generator().manual_seed(i))
        requests.append(DynamicInferenceRequest(request_id=f"{tag}-{i}", prompt=None, prompt_tokens=tokens.tolist(),
                                                sampling_params=params))
    sync(device)
    start = time.perf_counter()
    for request in requests:
        engine.add_request(request)
    while not all(r.generated_tokens for r in requests):
        engine.step()
    sync(device)
    decode_start, decode_tokens = time.perf_counter(), sum(len(r.generated_tokens) for r in requests)
    while not any(r.finished for r in requests):
        engine.step()
    sync(device)
    decode_end, decode_tokens = time.perf_counter(), sum(len(r.generated_tokens) for r in requests) - decode_tokens
    while engine.has_unfinished_requests():
        engine.step()
    sync(device)
    total = sum(len(r.generated_tokens) for r in requests) / (time.perf_counter() - start)
    return Run(decode_tokens / max(decode_end - decode_start, 1e-9), total, list(requests[0].generated_log_probs))


def measure_mode(model_dir: Path, shape: dict, batches: list[int], args, device: torch.device, invariant: bool
                 ) -> dict[int, Run]:
    from megatron_serve.model.loader import load_model  # noqa: PLC0415

    model = load_model(model_dir, torch.bfloat16, device)
    engine = make_engine(model, shape, max(batches), args.prompt_len, args.new_tokens, args.block_size, device,
                         device.type == "cuda", batch_invariant=invariant)
    runs = {}
    for batch in batches:
        run_batch(engine, shape, batch, args.prompt_len, args.new_tokens, f"warm{batch}", device)
        runs[batch] = run_batch(engine, shape, batch, args.prompt_len, args.new_tokens, f"run{batch}", device)
    engine.shutdown()
    del engine, model
    free_memory()
    return runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", default="1,64,256")
    add_number_options(parser, prompt_len=128, new_tokens=128, block_size=64)
    parser.add_argument("--smoke", action="store_true", help="tiny model, few tokens; allowed on CPU")
    parser.add_argument("--checkpoint", default=None,
                        help="the shape's checkpoint that decode_roofline's build_checkpoint made already (kept): a "
                             "caller that made it skips importing transformers' model classes here")
    args = parser.parse_args()
    name = "1b"
    if args.smoke:
        name, args.batches, args.prompt_len, args.new_tokens, args.block_size = "smoke", "1,4", 16, 8, 16
    if not torch.cuda.is_available() and not args.smoke:
        raise SystemExit("invariant_gpu.py needs a CUDA GPU (use --smoke to check the plumbing on CPU)")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    batches = [int(b) for b in args.batches.split(",")]
    shape = LLAMA_SHAPES[name]
    with tempfile.TemporaryDirectory() as workdir:
        model_dir = Path(args.checkpoint) if args.checkpoint else build_checkpoint(name, shape, Path(workdir), device)
        default = measure_mode(model_dir, shape, batches, args, device, invariant=False)
        mode = measure_mode(model_dir, shape, batches, args, device, invariant=True)
    print(f"{name} bf16 on {torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}, "
          f"prompt {args.prompt_len}, {args.new_tokens} new tokens, CUDA graphs {device.type == 'cuda'}")
    print(f"{'batch':>6} {'default tok/s':>14} {'invariant tok/s':>16} {'ratio':>6} "
          f"{'default run tok/s':>18} {'invariant run tok/s':>20} {'ratio':>6}")
    for batch in batches:
        base, inv = default[batch], mode[batch]
        print(f"{batch:>6} {base.decode_tokens_per_s:>14.0f} {inv.decode_tokens_per_s:>16.0f} "
              f"{inv.decode_tokens_per_s / base.decode_tokens_per_s:>6.3f} {base.tokens_per_s:>18.0f} "
              f"{inv.tokens_per_s:>20.0f} {inv.tokens_per_s / base.tokens_per_s:>6.3f}")
    for label, runs in (("invariant", mode), ("default", default)):
        same = all(runs[b].first_log_probs == runs[batches[0]].first_log_probs for b in batches)
        print(f"request 0's log probs == at batches {args.batches} ({label}): {same}")


if __name__ == "__main__":
    main()
