"""Decode throughput of megatron-serve against the memory-bandwidth bound and against ``transformers``.

GPU only. For a Llama-shaped model with random bf16 weights (about 1B parameters, and 8B when the GPU
has room) and batch sizes 1, 8, 64 and 256, it prints decode tokens/s of:

* ``engine``: ``DynamicInferenceEngine.step()`` in steady-state decode (scheduler, model runner, Triton
  kernels, sampler) with the engine's CUDA graphs, measured between "every request has its first token"
  and "the first request finishes", so the batch is constant over the window. Tokenization is stubbed out.
* ``eager``: the same engine with ``enable_cuda_graphs=False``.
* ``replay``: the engine's captured decode graph alone (``DecodeGraphs.run`` of one plan, no scheduler
  or sampler): the ceiling the engine's step loop can reach.
* ``hf`` and ``hf static``: ``transformers`` ``generate`` at its best on the same weights, greedy, warmed up
  (every shape run before timing): with its default dynamic cache, and with ``cache_implementation="static"``,
  whose forward ``generate`` compiles (``torch.compile``) on a GPU. Decode time is ``t(new_tokens) - t(1
  token)``; ``eng/hf`` compares the engine with the faster of the two.

The bound is ``batch / ((weight bytes + KV bytes read per step) / bandwidth)``: every weight read once
per step (the embedding table only when tied, as the LM head), the KV cache read up to the window's mean
context. Bandwidth is measured with a large device-to-device copy (``--bandwidth-gbs`` overrides it).

    python benchmarks/decode_roofline.py                  # 1B and (memory allowing) 8B
    python benchmarks/decode_roofline.py --models 1b --batches 1,64 --no-hf
    python benchmarks/decode_roofline.py --smoke          # tiny shape, runs on CPU too: checks the plumbing
"""

from __future__ import annotations

import argparse
import gc
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

LLAMA_SHAPES = {
    # Llama 3.2 1B
    "1b": dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, head_dim=64,
               intermediate_size=8192, vocab_size=128256, tie_word_embeddings=True),
    # Llama 3.1 8B
    "8b": dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
               intermediate_size=14336, vocab_size=128256, tie_word_embeddings=False),
    # plumbing check only
    "smoke": dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                  intermediate_size=256, vocab_size=1024, tie_word_embeddings=False),
}


@dataclass
class Row:
    model: str
    batch: int
    context: int
    bound: float
    engine: float | None = None
    eager: float | None = None
    replay: float | None = None
    hf: float | None = None
    hf_static: float | None = None
    note: str = ""

    @property
    def hf_best(self) -> float | None:
        measured = [v for v in (self.hf, self.hf_static) if v]
        return max(measured) if measured else None


# --------------------------------------------------------------------------------------------- helpers


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def seconds_for(run, iters: int, device: torch.device, warmup: int = 1) -> float:
    """Wall time of ``iters`` calls of ``run`` (device work included), after ``warmup`` untimed calls."""
    for _ in range(warmup):
        run()
    sync(device)
    start = time.perf_counter()
    for _ in range(iters):
        run()
    sync(device)
    return time.perf_counter() - start


def measure_bandwidth(device: torch.device, nbytes: int = 1 << 30, iters: int = 20) -> float:
    """Bytes/s of a device-to-device copy (read + write counted)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    elapsed = seconds_for(lambda: dst.copy_(src), iters, device, warmup=3)
    del src, dst
    return 2 * nbytes * iters / elapsed


def weight_bytes_per_step(model: torch.nn.Module, tied: bool) -> int:
    """Bytes of weights a decode step reads: all of them, minus the embedding table unless the LM head is it."""
    seen, total = set(), 0
    for name, param in model.named_parameters():
        if id(param) in seen:
            continue
        seen.add(id(param))
        if "embed_tokens" in name and not tied:
            continue
        total += param.numel() * param.element_size()
    return total


def kv_bytes_per_token(shape: dict, dtype_bytes: int = 2) -> int:
    return shape["num_hidden_layers"] * 2 * shape["num_key_value_heads"] * shape["head_dim"] * dtype_bytes


def model_bytes(shape: dict) -> int:
    h, i, v = shape["hidden_size"], shape["intermediate_size"], shape["vocab_size"]
    q = shape["num_attention_heads"] * shape["head_dim"]
    kv = shape["num_key_value_heads"] * shape["head_dim"]
    layer = h * (q + 2 * kv) + q * h + 3 * h * i + 2 * h
    return 2 * (shape["num_hidden_layers"] * layer + v * h * (1 if shape["tie_word_embeddings"] else 2) + h)


def bound_tokens_per_s(batch: int, weights: int, kv_per_token: int, mean_context: float, bandwidth: float) -> float:
    return batch * bandwidth / (weights + batch * mean_context * kv_per_token)


# ---------------------------------------------------------------------------------- model directories


def build_checkpoint(name: str, shape: dict, workdir: Path, device: torch.device, seed: int = 0) -> Path:
    """A Hugging Face Llama directory with random bf16 weights (config + safetensors)."""
    import transformers  # noqa: PLC0415

    out = workdir / f"llama-{name}"
    if (out / "config.json").is_file():
        return out
    config = transformers.LlamaConfig(
        max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=500000.0, bos_token_id=0, eos_token_id=1,
        **shape,
    )
    config.architectures = ["LlamaForCausalLM"]
    torch.manual_seed(seed)
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # no float32 copy of an 8B model on the way
    try:
        with torch.device(device):
            model = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
    finally:
        torch.set_default_dtype(default_dtype)
    model.save_pretrained(out, safe_serialization=True)
    del model
    free_memory()
    return out


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


class _NoText:
    """Stands in for the tokenizer: the benchmark feeds token ids and ignores text."""

    eos_token_id = None
    is_fast = False  # no grammars: the engine's structured-output warm-up says so and moves on
    all_special_ids: list[int] = []
    added_tokens_decoder: dict = {}

    def decode(self, token_ids, skip_special_tokens=True) -> str:
        return ""

    def __len__(self) -> int:
        return 0


# ------------------------------------------------------------------------------------------ measurements


def hf_decode_tokens_per_s(model_dir: Path, batches: list[int], prompt_len: int, new_tokens: int,
                           device: torch.device, cache: str) -> dict[int, float]:
    """``transformers`` decode tokens/s per batch with ``cache`` ``"dynamic"`` or ``"static"`` (compiled on a GPU)."""
    import transformers  # noqa: PLC0415

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).to(device).eval()
    vocab = model.config.vocab_size
    results = {}
    gen = torch.Generator().manual_seed(1)
    options = {"cache_implementation": "static"} if cache == "static" else {}

    def run(ids, n):
        sync(device)
        start = time.perf_counter()
        with torch.inference_mode():
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                           do_sample=False, pad_token_id=0, **options)
        sync(device)
        return time.perf_counter() - start

    for batch in batches:
        ids = torch.randint(2, vocab, (batch, prompt_len), generator=gen).to(device)
        for n in (1, 1, new_tokens):  # warm-up: every shape timed below (a static cache compiles per shape)
            run(ids, n)
        first = min(run(ids, 1) for _ in range(2))
        full = min(run(ids, new_tokens) for _ in range(2))
        results[batch] = batch * (new_tokens - 1) / max(full - first, 1e-9)
        print(f"  hf {cache:7s} batch {batch:4d}: {results[batch]:10.1f} tok/s", flush=True)
    del model
    free_memory()
    return results


def make_engine(model, shape: dict, batch: int, prompt_len: int, new_tokens: int, block_size: int,
                device: torch.device, cuda_graphs: bool, **config):
    """An engine over ``model`` sized for ``batch`` requests; ``config``: more ``InferenceConfig`` fields."""
    from megatron_serve import InferenceConfig  # noqa: PLC0415
    from megatron_serve.engine import DynamicInferenceEngine  # noqa: PLC0415
    from megatron_serve.tokenizer import Tokenizer  # noqa: PLC0415

    total = prompt_len + new_tokens + 1
    blocks = batch * -(-total // block_size) + 8
    config = InferenceConfig(
        dtype=torch.bfloat16, device=str(device), block_size_tokens=block_size, num_kv_blocks=blocks,
        max_requests=batch, max_batch_tokens=max(2048, batch * prompt_len), max_sequence_length=total + 1,
        enable_cuda_graphs=cuda_graphs, **config,
    )
    return DynamicInferenceEngine(model, Tokenizer(_NoText(), []), config)


def engine_decode_tokens_per_s(model, shape: dict, batch: int, prompt_len: int, new_tokens: int, block_size: int,
                               device: torch.device, cuda_graphs: bool, **config) -> tuple[float, float]:
    """Steady-state decode tokens/s of ``engine.step()`` and the window's mean context length."""
    from megatron_serve import SamplingParams  # noqa: PLC0415
    from megatron_serve.wire.request import DynamicInferenceRequest  # noqa: PLC0415

    engine = make_engine(model, shape, batch, prompt_len, new_tokens, block_size, device, cuda_graphs, **config)
    gen = torch.Generator().manual_seed(2)

    def submit(tag: str, n: int):
        requests = []
        params = SamplingParams(temperature=0.0, num_tokens_to_generate=n, ignore_eos=True)
        for i in range(batch):
            tokens = torch.randint(2, shape["vocab_size"], (prompt_len,), generator=gen).tolist()
            request = DynamicInferenceRequest(request_id=f"{tag}-{i}", prompt=None, prompt_tokens=tokens,
                                              sampling_params=params)
            engine.add_request(request)
            requests.append(request)
        return requests

    # Warm-up over the same lengths: compiles every kernel variant the run meets (the decode split
    # count follows the block-table width, which grows with the context).
    warm = submit("warm", new_tokens)
    while any(not r.finished for r in warm):
        engine.step()

    requests = submit("run", new_tokens)
    while any(not r.generated_tokens for r in requests):
        engine.step()
    sync(device)
    start_tokens = sum(len(r.generated_tokens) for r in requests)
    start_context = statistics.mean(prompt_len + len(r.generated_tokens) for r in requests)
    start = time.perf_counter()
    while not any(r.finished for r in requests):
        engine.step()
    sync(device)
    elapsed = time.perf_counter() - start
    produced = sum(len(r.generated_tokens) for r in requests) - start_tokens
    end_context = statistics.mean(prompt_len + len(r.generated_tokens) for r in requests)
    while engine.has_unfinished_requests():
        engine.step()
    del engine
    free_memory()
    return produced / max(elapsed, 1e-9), (start_context + end_context) / 2


def replay_decode_tokens_per_s(model, shape: dict, batch: int, context: int, block_size: int,
                               device: torch.device, iters: int = 20) -> float:
    """The engine's decode graph for ``batch`` sequences at ``context`` tokens, replayed alone (eager on CPU)."""
    from megatron_serve.engine.precompile.graphs import CudaGraphCapture, DecodeGraphs  # noqa: PLC0415
    from megatron_serve.engine.kv.cache import KVCachePool  # noqa: PLC0415
    from megatron_serve.engine.step_plan import StepBuffers, StepPlan  # noqa: PLC0415

    blocks_per_seq = -(-context // block_size)
    pool = KVCachePool(shape["num_hidden_layers"], batch * blocks_per_seq, block_size,
                       model.num_local_kv_heads, shape["head_dim"], torch.bfloat16, device)
    buffers = StepBuffers(batch, batch, blocks_per_seq, device)
    tables = torch.randperm(batch * blocks_per_seq).view(batch, blocks_per_seq)
    last = context - 1

    def rerun(forward):  # CPU: no graphs; "replay" runs the forward again over the same buffers
        return forward

    capture = (lambda: CudaGraphCapture(device)) if device.type == "cuda" else (lambda: rerun)
    graphs = DecodeGraphs(model, [batch], buffers, capture)
    graphs.capture(pool.layer_caches)
    out = buffers.np
    out["token_ids"][:batch] = torch.randint(2, shape["vocab_size"], (batch,)).numpy()
    out["positions"][:batch] = last
    out["slots"][:batch] = tables[:, last // block_size].numpy() * block_size + last % block_size
    out["block_tables"][:batch, :blocks_per_seq] = tables.numpy()
    out["seq_lens"][:batch] = context
    out["lm_rows"][:batch] = range(batch)
    plan = StepPlan(num_tokens=batch, num_decode=batch, num_prefill=0, block_width=blocks_per_seq,
                    num_sample=batch, num_score=0)
    graphs.prepare(plan)
    elapsed = seconds_for(lambda: model.compute_logits(graphs.run(plan)[0]), iters, device)  # the LM head runs eagerly
    graphs.release()
    del graphs, pool
    free_memory()
    return batch * iters / elapsed


# ------------------------------------------------------------------------------------------------- main


def fmt(value: float | None, width: int = 10) -> str:
    return f"{value:{width}.0f}" if value is not None else f"{'-':>{width}}"


def pct(value: float | None, bound: float) -> str:
    return f"{100 * value / bound:5.1f}%" if value is not None else f"{'-':>6}"


def print_table(rows: list[Row], bandwidth: float, device_name: str, prompt_len: int, new_tokens: int) -> None:
    print()
    print(f"device: {device_name}; bandwidth {bandwidth / 1e9:.0f} GB/s; prompt {prompt_len} tokens, "
          f"{new_tokens} generated; bf16 random weights; tokens/s of decode")
    header = (f"{'model':>6} {'batch':>5} {'ctx':>5} {'bound':>10} {'engine':>10} {'%bound':>6} {'eager':>10} "
              f"{'replay':>10} {'%bound':>6} {'hf':>10} {'hf static':>10} {'eng/hf':>6}")
    print(header)
    print("-" * len(header))
    for r in rows:
        best = r.hf_best
        ratio = f"{r.engine / best:6.2f}" if r.engine and best else f"{'-':>6}"
        print(f"{r.model:>6} {r.batch:5d} {r.context:5d} {fmt(r.bound)} {fmt(r.engine)} {pct(r.engine, r.bound)} "
              f"{fmt(r.eager)} {fmt(r.replay)} {pct(r.replay, r.bound)} {fmt(r.hf)} {fmt(r.hf_static)} {ratio}"
              + (f"  {r.note}" if r.note else ""))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="1b,8b", help="comma list of: " + ", ".join(LLAMA_SHAPES))
    parser.add_argument("--batches", default="1,8,64,256")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--bandwidth-gbs", type=float, default=None, help="use this instead of the measured copy")
    parser.add_argument("--no-hf", action="store_true", help="skip transformers generate")
    parser.add_argument("--no-eager", action="store_true", help="skip the engine run without CUDA graphs")
    parser.add_argument("--workdir", default=None, help="where checkpoints go (default: a temporary directory)")
    parser.add_argument("--checkpoint", default=None,
                        help="a checkpoint of the one --models shape that build_checkpoint made already (kept): a "
                             "caller that made it skips importing transformers' model classes here")
    parser.add_argument("--smoke", action="store_true", help="tiny model, few tokens; allowed on CPU")
    args = parser.parse_args(argv)

    if args.smoke:
        args.models, args.batches, args.prompt_len, args.new_tokens = "smoke", "1,4", 16, 8
        args.block_size = 16
    if not torch.cuda.is_available() and not args.smoke:
        print("decode_roofline.py needs a CUDA GPU (use --smoke to check the plumbing on CPU)")
        return 2
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    batches = [int(b) for b in args.batches.split(",")]
    names = [n.strip() for n in args.models.split(",") if n.strip()]
    if args.checkpoint and len(names) != 1:
        parser.error("--checkpoint: one model shape in --models")
    bandwidth = (args.bandwidth_gbs * 1e9 if args.bandwidth_gbs else measure_bandwidth(device, 1 << 26 if
                                                                                      args.smoke else 1 << 30))
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"

    from megatron_serve.model.loader import load_model  # noqa: PLC0415

    rows: list[Row] = []
    with tempfile.TemporaryDirectory(dir=args.workdir) as tmp:
        for name in names:
            shape = LLAMA_SHAPES[name]
            max_batch = max(batches)
            kv_need = max_batch * (args.prompt_len + args.new_tokens + 64) * kv_bytes_per_token(shape)
            if device.type == "cuda":
                total = torch.cuda.get_device_properties(device).total_memory
                need = 2 * model_bytes(shape) + kv_need + (4 << 30)
                if need > total:
                    print(f"skipping {name}: needs about {need / 2**30:.0f} GiB, the GPU has {total / 2**30:.0f} GiB")
                    continue
            if args.checkpoint:
                model_dir = Path(args.checkpoint)
            else:
                print(f"{name}: building a random checkpoint ({model_bytes(shape) / 1e9:.1f} GB)", flush=True)
                model_dir = build_checkpoint(name, shape, Path(tmp), device)
            hf, hf_static = ({}, {}) if args.no_hf else (
                hf_decode_tokens_per_s(model_dir, batches, args.prompt_len, args.new_tokens, device, "dynamic"),
                hf_decode_tokens_per_s(model_dir, batches, args.prompt_len, args.new_tokens, device, "static"))
            model = load_model(model_dir, torch.bfloat16, device)
            weights = weight_bytes_per_step(model, shape["tie_word_embeddings"])
            kv_tok = kv_bytes_per_token(shape)
            for batch in batches:
                row = Row(name, batch, 0, 0.0, hf=hf.get(batch), hf_static=hf_static.get(batch))
                notes = []
                try:
                    row.engine, mean_ctx = engine_decode_tokens_per_s(
                        model, shape, batch, args.prompt_len, args.new_tokens, args.block_size, device, True)
                    if not args.no_eager:
                        row.eager, _ = engine_decode_tokens_per_s(
                            model, shape, batch, args.prompt_len, args.new_tokens, args.block_size, device, False)
                except Exception as exc:  # report and keep measuring the rest
                    mean_ctx = args.prompt_len + args.new_tokens / 2
                    notes.append(f"engine failed: {type(exc).__name__}: {str(exc)[:200]}")
                row.context = int(round(mean_ctx))
                row.bound = bound_tokens_per_s(batch, weights, kv_tok, mean_ctx, bandwidth)
                try:
                    row.replay = replay_decode_tokens_per_s(model, shape, batch, row.context, args.block_size, device)
                except Exception as exc:
                    notes.append(f"replay failed: {type(exc).__name__}: {str(exc)[:200]}")
                row.note = "; ".join(notes)
                print(f"  engine   batch {batch:4d}: {fmt(row.engine)} tok/s (bound {row.bound:.0f}; "
                      f"eager {fmt(row.eager, 0)}, replay {fmt(row.replay, 0)})", flush=True)
                rows.append(row)
            del model
            free_memory()
            if not args.checkpoint:
                shutil_rmtree(model_dir)
    print_table(rows, bandwidth, device_name, args.prompt_len, args.new_tokens)
    return 0


def shutil_rmtree(path: Path) -> None:
    import shutil  # noqa: PLC0415

    shutil.rmtree(path, ignore_errors=True)


if __name__ == "__main__":
    raise SystemExit(main())
