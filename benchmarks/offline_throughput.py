"""Offline throughput: MegatronLLM (continuous batching, paged KV) vs transformers generate (padded static batches).

Same random weights, same 64 requests of mixed prompt/output lengths, greedy, EOS ignored. Only the
tokens each request asked for count as useful output for both (static batches also compute padding).
With sampling options (``--temperature``, ``--top-p``, ``--top-k``, ``--n``, or ``--rl``: temperature 1,
n 8, outputs of 512-1024 tokens) the engine runs the sampled batch and, in the same run, the same
prompts and lengths greedily (each prompt ``n`` times), and prints sampled/greedy; transformers is left
out then. Beside wall time each run reports its CPU time (a single-threaded run's CPU time moves less
with other load on a shared machine than its wall time does).
``transformers`` runs in each mode of ``--hf-modes``, and the engine is compared with each and with the fastest
(its best): ``dynamic``, plain ``generate`` (its default dynamic cache); ``static``,
``cache_implementation="static"``; ``compiled``, the static cache with the forward compiled by ``torch.compile``
as ``generate`` does it on a GPU (its ``CompileConfig``, here forced on for a CPU). The static modes are warmed
up by an untimed pass over the same batches (a static cache compiles per shape); plain ``generate`` by a short
call.
``--arch`` picks the family; the mixture-of-experts ones get ``--experts`` experts of 3/8 of the hidden
size (rounded to 64: ``transformers``' grouped GEMM needs 16-byte strides), ``--experts-per-token``
per token (Qwen3-30B-A3B's proportions, scaled down).

    python benchmarks/offline_throughput.py [--arch qwen3_moe] [--hidden-size 512 --layers 8] [--hf-batch-size 16]
    python benchmarks/offline_throughput.py --hf-modes dynamic
    python benchmarks/offline_throughput.py --repeats 3          # each side three times in turn, best of each
    python benchmarks/offline_throughput.py --temperature 1 --top-p 0.9 --n 8 --requests 8
    python benchmarks/offline_throughput.py --rl --requests 8
    python benchmarks/offline_throughput.py --model SmolLM2-135M-Instruct.Q4_1.gguf --hf-modes static,compiled \
        --hf-batch-size 8,16,32 --requests 32

``--model`` runs a real model instead (a directory, or a GGUF file); the prompts stay random token ids. A GGUF file:
the engine dequantizes it at load, and ``transformers`` loads the same weights dequantized to float32 as a plain
checkpoint (:func:`float32_checkpoint`), as a user who wants it at its best would; ``--hf-gguf-file`` has it load the
file its own way instead (``gguf_file=``, the reference the parity tests hold the engine to).
``--hf-batch-size`` takes several sizes (comma-separated): each mode runs at each, and the best of all is its best.
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from pathlib import Path

import msgspec
import torch
import transformers
from safetensors.torch import save_file

from megatron_serve import DynamicInferenceRequest, InferenceConfig, MegatronLLM, SamplingParams
from megatron_serve.model.gguf.tensors import gguf_tensors
from megatron_serve.model.gguf.view import WEIGHTS_LINK
from megatron_serve.model.hub import resolve_model
from megatron_serve.model.tiny import ARCHITECTURES, MOE_DEFAULTS, make_tiny_model


def model_shape(args: argparse.Namespace) -> dict:
    """``make_tiny_model`` arguments for the chosen family and size."""
    dense = args.hidden_size * 8 // 3
    expert = max(64, args.hidden_size * 3 // 8 // 64 * 64)
    shape = dict(arch=args.arch, hidden_size=args.hidden_size, num_layers=args.layers, num_heads=8, num_kv_heads=4,
                 intermediate_size=dense, max_position_embeddings=1024)
    if args.arch == "mixtral":
        shape.update(num_local_experts=args.experts, num_experts_per_tok=args.experts_per_token,
                     intermediate_size=expert)
    elif args.arch in MOE_DEFAULTS:
        shape.update(num_experts=args.experts, num_experts_per_tok=args.experts_per_token,
                     moe_intermediate_size=expert)
    return shape


def workload(vocab_size: int, count: int, seed: int, outputs: tuple[int, int] = (16, 128)
             ) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [([rng.randrange(5, vocab_size) for _ in range(rng.randint(16, 256))], rng.randint(*outputs))
            for _ in range(count)]


def sampling(args: argparse.Namespace) -> SamplingParams | None:
    """The sampled run's parameters (lengths set per request), or None for greedy only."""
    if args.rl:
        args.temperature, args.n = 1.0, 8
    if not args.temperature:
        return None
    return SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, ignore_eos=True)


def run_megatron(model_dir: str, warmup, requests, max_requests: int, params: SamplingParams | None = None,
                 n: int = 1) -> tuple[float, float]:
    """Wall and CPU seconds of the timed pass (CPU time moves less with other load on a shared machine)."""
    llm = MegatronLLM(model_dir, InferenceConfig(dtype="float32", max_requests=max_requests, max_batch_tokens=1024))
    # An untimed pass over other prompts of the same mix first (no prefix-cache hits): on a GPU it
    # compiles the Triton kernels for the workload's shapes, once per process. Then every request in
    # flight together, each with its own length.
    for timed, requests in ((False, warmup), (True, requests)):
        started, cpu_started = time.perf_counter(), time.process_time()
        base = params or SamplingParams(temperature=0.0, ignore_eos=True)
        reqs = [DynamicInferenceRequest(f"{timed}-{i}-{choice}", None, prompt, choice_params)
                for i, (prompt, length) in enumerate(requests)
                for choice, choice_params in enumerate(msgspec.structs.replace(
                    base, num_tokens_to_generate=length, n=n).choices())]
        for r in reqs:
            llm.engine.add_request(r)
        while llm.engine.has_unfinished_requests():
            llm.engine.step()
        elapsed, cpu = time.perf_counter() - started, time.process_time() - cpu_started
    assert [len(r.generated_tokens) for r in reqs] == [length for _, length in requests for _ in range(n)]
    return elapsed, cpu


HF_MODES = ("dynamic", "static", "compiled")


def float32_checkpoint(model_dir: Path, into: Path) -> Path:
    """A plain float32 checkpoint in ``into`` of the GGUF file's directory ``model_dir`` (:func:`resolve_model`'s):
    its ``config.json`` and every tensor as the engine's loader reads it (dequantized to float32 under its Hugging
    Face name, llama.cpp's query and key rows put back), so ``transformers`` computes with the engine's very
    weights and none of the work its own GGUF load would add."""
    into.mkdir()
    (into / "config.json").write_bytes((model_dir / "config.json").read_bytes())
    save_file({name: weight.contiguous() for name, weight in gguf_tensors(model_dir / WEIGHTS_LINK)},
              str(into / "model.safetensors"), metadata={"format": "pt"})
    return into


def load_transformers(source: str) -> transformers.PreTrainedModel:
    """``transformers``' own load of the model in float32: a directory, or a GGUF file (``gguf_file=``)."""
    path = Path(source)
    if path.suffix == ".gguf":
        return transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    return transformers.AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)


def generate_options(mode: str) -> dict:
    """``generate`` keywords of a ``--hf-modes`` mode."""
    if mode == "dynamic":
        return {}
    if mode == "static":
        return {"cache_implementation": "static"}
    compile_config = transformers.CompileConfig()
    compile_config._compile_all_devices = True  # generate compiles on GPUs only unless told (its own flag for this)
    return {"cache_implementation": "static", "compile_config": compile_config}


def run_transformers(source: str, requests, batch_size: int, mode: str = "dynamic") -> tuple[float, float]:
    """Wall and CPU seconds of the timed pass, ``generate`` in ``mode`` (:data:`HF_MODES`)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"  # where the engine runs too
    model = load_transformers(source).to(device).eval()
    options = generate_options(mode)
    batches = []
    for start in range(0, len(requests), batch_size):
        batch = requests[start : start + batch_size]
        width = max(len(p) for p, _ in batch)
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        mask = torch.zeros(len(batch), width, dtype=torch.long)
        for row, (prompt, _) in enumerate(batch):  # left padding
            ids[row, width - len(prompt):] = torch.tensor(prompt)
            mask[row, width - len(prompt):] = 1
        batches.append((ids.to(device), mask.to(device), max(n for _, n in batch)))

    def generate_all() -> None:
        for ids, mask, new_tokens in batches:
            with torch.inference_mode():
                model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                               do_sample=False, pad_token_id=0, **options)

    if mode == "dynamic":  # warm-up, as on our side
        with torch.inference_mode():
            model.generate(torch.tensor([[5, 6, 7]], device=device), max_new_tokens=4, do_sample=False, pad_token_id=0)
    else:  # every shape of the timed pass once: a static cache (and its compiled forward) is per shape
        generate_all()
    started, cpu_started = time.perf_counter(), time.process_time()
    generate_all()
    return time.perf_counter() - started, time.process_time() - cpu_started


def best_of(runs: list[tuple[float, float]]) -> tuple[float, float]:
    """The least wall time and the least CPU time of a side's runs (each its own best: on a shared machine other
    load comes and goes during a run, and it only ever adds time)."""
    return min(wall for wall, _ in runs), min(cpu for _, cpu in runs)


def progress(arm: str, wall: float, cpu: float) -> None:
    """One timed run's seconds on stderr as it ends: a sitting on a loaded shared machine can take an hour, and what
    it measured before it is stopped is kept."""
    print(f"{arm}: {wall:.2f} s, {cpu:.2f} CPU s", file=sys.stderr, flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="a real model (a directory or a GGUF file) instead of a random one")
    parser.add_argument("--arch", choices=sorted(ARCHITECTURES), default="llama")
    parser.add_argument("--experts", type=int, default=32, help="experts per layer (MoE archs)")
    parser.add_argument("--experts-per-token", type=int, default=4, help="experts per token (MoE archs)")
    parser.add_argument("--hidden-size", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--hf-batch-size", default="16",
                        help="transformers' batch size, or several comma-separated: each mode at each")
    parser.add_argument("--hf-modes", default=",".join(HF_MODES),
                        help=f"transformers' modes to time, comma-separated ({', '.join(HF_MODES)})")
    parser.add_argument("--hf-gguf-file", action="store_true",
                        help="a GGUF --model: transformers loads the file itself (gguf_file=), not its float32 "
                             "checkpoint")
    parser.add_argument("--max-requests", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0, help="sample (> 0): compared with greedy")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--n", type=int, default=1, help="samples per prompt (the greedy run repeats each prompt)")
    parser.add_argument("--rl", action="store_true", help="an RL rollout: temperature 1, n 8, 512-1024 new tokens")
    parser.add_argument("--repeats", type=int, default=1,
                        help="runs of each side (engine and each transformers mode, or sampled and greedy), "
                             "alternated: best of each")
    args = parser.parse_args()
    hf_modes = [mode for mode in args.hf_modes.split(",") if mode]
    unknown = sorted(set(hf_modes) - set(HF_MODES))
    if unknown or not hf_modes:
        parser.error(f"--hf-modes: unknown mode(s) {', '.join(unknown) or '(none given)'}; "
                     f"choose from {', '.join(HF_MODES)}")
    try:
        batch_sizes = [int(size) for size in args.hf_batch_size.split(",") if size]
    except ValueError:
        batch_sizes = []
    if not batch_sizes or min(batch_sizes) < 1:
        parser.error(f"--hf-batch-size: expected positive integers, comma-separated, not {args.hf_batch_size!r}")
    sampled_params = sampling(args)
    name = Path(args.model).name if args.model else args.arch
    with tempfile.TemporaryDirectory() as tmp:
        source = args.model or str(make_tiny_model(tmp, seed=0, **model_shape(args)))
        model_dir = str(resolve_model(source))
        gguf_file = Path(source).suffix == ".gguf"
        if gguf_file and not args.hf_gguf_file:
            source = str(float32_checkpoint(Path(model_dir), Path(tmp) / "float32"))
        hf = load_transformers(source)
        params = sum(p.numel() for p in hf.parameters())
        experts = getattr(hf.config, "_experts_implementation", None)  # transformers' MoE path (grouped_mm or eager)
        del hf
        outputs = (512, 1024) if args.rl else (16, 128)
        requests = workload(512, args.requests, seed=0, outputs=outputs)
        warmup = workload(512, args.requests, seed=1, outputs=outputs)
        useful = sum(n for _, n in requests) * args.n
        if sampled_params is not None:  # sampled, then greedy over the same prompts and lengths
            runs: dict[str, list[tuple[float, float]]] = {"greedy": [], "sampled": []}
            for _ in range(args.repeats):  # alternated, best of each: load on a shared machine comes and goes
                runs["sampled"].append(run_megatron(model_dir, warmup, requests, args.max_requests, sampled_params,
                                                    args.n))
                runs["greedy"].append(run_megatron(model_dir, warmup, requests, args.max_requests, None, args.n))
            (greedy, greedy_cpu), (sampled, sampled_cpu) = (best_of(runs[k]) for k in ("greedy", "sampled"))
            print(f"model: {name}, {params / 1e6:.1f}M parameters, {args.requests} prompts x n {args.n}, "
                  f"{useful} generated tokens, torch threads {torch.get_num_threads()}, best of {args.repeats}")
            print(f"{'run':<60}{'seconds':>10}{'tokens/s':>12}{'CPU s':>10}")
            print(f"{'greedy':<60}{greedy:>10.2f}{useful / greedy:>12.1f}{greedy_cpu:>10.2f}")
            print(f"{f'sampled (temperature {args.temperature}, top-p {args.top_p}, top-k {args.top_k})':<60}"
                  f"{sampled:>10.2f}{useful / sampled:>12.1f}{sampled_cpu:>10.2f}")
            print(f"sampled/greedy throughput: {greedy / sampled:.3f} (wall), {greedy_cpu / sampled_cpu:.3f} (CPU time)")
            return
        arms = [(mode, size) for mode in hf_modes for size in batch_sizes]
        timed: dict[object, list[tuple[float, float]]] = {"engine": [], **{arm: [] for arm in arms}}
        for _ in range(args.repeats):  # each side in turn, best of each: as the sampled runs above
            timed["engine"].append(run_megatron(model_dir, warmup, requests, args.max_requests))
            progress("engine", *timed["engine"][-1])
            for mode, size in arms:
                timed[mode, size].append(run_transformers(source, requests, size, mode))
                progress(f"transformers {mode} batch {size}", *timed[mode, size][-1])
        ours, ours_cpu = best_of(timed["engine"])
        theirs = {arm: best_of(timed[arm]) for arm in arms}
    print(f"model: {name}, {params / 1e6:.1f}M parameters, {args.requests} requests, {useful} generated tokens, "
          f"torch threads {torch.get_num_threads()}, best of {args.repeats}"
          + (f", transformers from {'its GGUF load' if args.hf_gguf_file else 'the float32 checkpoint'}"
             if gguf_file else "")
          + (f", transformers experts: {experts}" if experts else ""))
    print(f"{'engine':<48}{'seconds':>10}{'tokens/s':>12}{'CPU s':>10}{'CPU ms/tok':>12}")
    rows = [("megatron-serve (continuous batching)", ours, ours_cpu)]
    rows += [(f"transformers generate (batch {size}, {mode})", *theirs[mode, size]) for mode, size in arms]
    for name, wall, cpu in rows:
        print(f"{name:<48}{wall:>10.2f}{useful / wall:>12.1f}{cpu:>10.2f}{1000 * cpu / useful:>12.3f}")
    for mode, size in arms:
        wall, cpu = theirs[mode, size]
        label = mode if len(batch_sizes) == 1 else f"{mode} batch {size}"
        print(f"ratio to transformers {label}: {wall / ours:.2f}x (wall), {cpu / ours_cpu:.2f}x (CPU time)")
    if len(arms) > 1:
        best_wall, best_cpu = min(wall for wall, _ in theirs.values()), min(cpu for _, cpu in theirs.values())
        print(f"ratio to transformers at its best: {best_wall / ours:.2f}x (wall), {best_cpu / ours_cpu:.2f}x (CPU time)")


if __name__ == "__main__":
    main()
