"""Expert parallelism against tensor parallelism and one rank, on a tiny MoE (gloo on CPU, NCCL on GPUs).

Two tables:

* ``decode``: milliseconds per generated token of an engine group (greedy, ``--concurrency`` requests at
  once and one alone) for one rank, TP=N (every expert sliced over the ranks, one all-reduce per MoE layer)
  and EP=N (``enable_expert_parallel``: whole experts per rank, the all-to-all dispatcher; on a GPU also with
  ``--enforce-eager``, against the steps replayed from CUDA graphs), with each layout's ratio to one rank
  measured in the same run.
* ``bytes``: what one rank sends the others per token in one MoE layer, measured by counting the collectives'
  payloads in real processes: the all-to-all dispatcher (dispatch + combine all-to-alls, then the all-gather
  of the combined chunks), the all-gather dispatcher (one all-reduce), TP (one all-reduce), and data-parallel
  attention (``--data-parallel-size N``: each rank holds its own ``1/N`` of the step's tokens, so only the
  all-to-alls and their counts move), and both all-to-alls with the fixed-capacity buffers a CUDA graph runs
  (``capacity``: every buffer moves whole, its unused rows and the rows' ids included). Every row is per token of
  the whole step, so the layouts compare. A ring all-reduce of B bytes sends ``2 (n - 1) / n * B`` per rank, a ring
  all-gather ``(n - 1)`` chunks; an all-to-all sends the rows bound for other ranks.
* ``bandwidth`` (on request): an all-to-all's bytes per second between the ranks of one machine.
* ``eplb`` (on request): EP=N on a model whose routers favour two experts (``--hot``), without and with EPLB
  (``--enable-eplb``, ``--redundant`` copies; rearranged during a warm-up run), milliseconds per generated token,
  wall and the whole group's CPU, with the balancedness each measured (mean over max of the tokens per rank).

    python benchmarks/expert_parallel.py                      # CPU: EP=2 vs TP=2 vs one rank
    python benchmarks/expert_parallel.py --sizes 2 4 --device cuda --hidden 1024 --experts 64
    python benchmarks/expert_parallel.py --tables eplb --sizes 4   # EPLB against index placement, skewed router
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import queue
import shutil
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

from megatron_serve import InferenceConfig, MegatronLLM, SamplingParams  # noqa: E402
from megatron_serve.fleet.local_fleet import free_port  # noqa: E402
from megatron_serve.model.tiny import make_tiny_model  # noqa: E402
from pipeline_parallel import group_cpu_seconds  # noqa: E402


def counting_probe(rank: int, size: int, port: str, model_dir: str, layouts: str, tokens: int,
                   device: str) -> dict | None:
    """One rank of the bytes table: one MoE block's forward for each layout, the collectives' payloads counted;
    rank 0 returns what it measured."""
    import torch  # noqa: PLC0415
    import torch.distributed as dist  # noqa: PLC0415
    from megatron_serve.model.experts.dispatch import install_dispatchers  # noqa: PLC0415
    from megatron_serve.model.experts.moe import SparseMoeBlock  # noqa: PLC0415
    from megatron_serve.model.experts.token_dispatcher import AllGatherDispatcher  # noqa: PLC0415
    from megatron_serve.model.loader import load_model  # noqa: PLC0415
    from megatron_serve.model.parallel import DataParallel, TensorParallel  # noqa: PLC0415

    backend = "nccl" if device == "cuda" else "gloo"
    if device == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size)
    device = torch.device(device, rank) if device == "cuda" else torch.device(device)
    sent = [0]
    all_reduce, all_gather, all_to_all = dist.all_reduce, dist.all_gather, dist.all_to_all_single

    def counted_all_reduce(tensor, *args, **kwargs):
        sent[0] += 2 * (size - 1) * tensor.numel() * tensor.element_size() // size
        return all_reduce(tensor, *args, **kwargs)

    def counted_all_gather(parts, tensor, *args, **kwargs):
        sent[0] += (size - 1) * tensor.numel() * tensor.element_size()
        return all_gather(parts, tensor, *args, **kwargs)

    def counted_all_to_all(output, tensor, output_splits=None, input_splits=None, *args, **kwargs):
        row = tensor[0].numel() * tensor.element_size() if tensor.shape[0] else 0
        splits = input_splits or [tensor.shape[0] // size] * size  # (none: equal parts)
        sent[0] += row * (sum(splits) - splits[rank])
        return all_to_all(output, tensor, output_splits, input_splits, *args, **kwargs)

    dist.all_reduce, dist.all_gather = counted_all_reduce, counted_all_gather
    dist.all_to_all_single = counted_all_to_all
    measured = {}
    for layout in layouts.split(","):  # one process group for every layout: each loads its own model
        tp = TensorParallel(rank, size, dist.group.WORLD, expert_parallel=layout != "tp")
        if layout.startswith("dp"):  # data-parallel attention: one attention rank each, its own share of the tokens
            tp = TensorParallel(0, 1, None, expert_parallel=True,
                                data_parallel=DataParallel(rank, size, dist.group.WORLD))
        model = load_model(model_dir, torch.float32, device, tp)
        block = next(layer.mlp for layer in model.model.layers if isinstance(layer.mlp, SparseMoeBlock))
        if layout == "ep-allgather":
            block.dispatcher = AllGatherDispatcher(tp, model.config.moe.num_experts)
        own = tokens // size if layout.startswith("dp") else tokens
        if layout.endswith("capacity"):  # buffers for the step's tokens, as a graph of that batch has
            install_dispatchers(model, "alltoall").capacity = own
        hidden = torch.randn(own, model.config.hidden_size, generator=torch.Generator().manual_seed(0)).to(device)
        sent[0] = 0
        with torch.no_grad():
            block(hidden)
        measured[layout] = {"bytes_per_token": sent[0] / tokens, "hidden_bytes": model.config.hidden_size * 4}
    dist.destroy_process_group()
    return measured if rank == 0 else None


def bandwidth_probe(rank: int, size: int, port: str, device: str, mib: int) -> dict | None:
    """One rank of the bandwidth table: all-to-alls of ``mib`` MiB a rank; rank 0 returns their rate."""
    import torch  # noqa: PLC0415
    import torch.distributed as dist  # noqa: PLC0415

    if device == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if device == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=rank, world_size=size)
    device = torch.device(device, rank) if device == "cuda" else torch.device(device)
    send = torch.ones(mib * 2**20 // 2, dtype=torch.bfloat16, device=device)
    receive = torch.empty_like(send)
    for _ in range(3):
        dist.all_to_all_single(receive, send)
    if device.type == "cuda":
        torch.cuda.synchronize()
    rounds, started = 10, time.perf_counter()
    for _ in range(rounds):
        dist.all_to_all_single(receive, send)
    if device.type == "cuda":
        torch.cuda.synchronize()
    seconds = (time.perf_counter() - started) / rounds
    dist.destroy_process_group()
    # bytes each rank sent to the others, per second
    return {"gb_per_s": mib * 2**20 * (size - 1) / size / seconds / 1e9, "ms": 1000 * seconds} if rank == 0 else None


def probe_rank(probe, results, rank: int, *argv) -> None:  # noqa: ANN001 - a probe above; a multiprocessing Queue
    """A probe's rank in a forked process; rank 0 sends back what it measured."""
    measured = probe(rank, *argv)
    if measured is not None:
        results.put(measured)


def run_ranks(probe, size: int, *argv) -> dict:  # noqa: ANN001 - counting_probe or bandwidth_probe
    """``probe`` in ``size`` processes (rank, size, a free port, ``argv``); rank 0's result. The ranks come from the
    engine's fork server (torch imported once there, as for the engine groups' ranks), not fresh interpreters."""
    from megatron_serve.engine.group.spawn import PRELOAD  # noqa: PLC0415 (not in the ranks' import of this script)

    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(PRELOAD)  # read when the server starts; the engine groups may have started it
    results, port = context.Queue(), str(free_port("127.0.0.1"))
    procs = [context.Process(target=probe_rank, args=(probe, results, rank, size, port, *argv))
             for rank in range(size)]
    for proc in procs:
        proc.start()
    deadline = time.monotonic() + 600
    while True:
        try:
            measured = results.get(timeout=1)
            break
        except queue.Empty:
            failed = [rank for rank, proc in enumerate(procs) if proc.exitcode not in (None, 0)]
            if failed or time.monotonic() > deadline:
                for proc in procs:
                    proc.kill()
                raise RuntimeError(f"{probe.__name__}: ranks {failed} failed" if failed else "timed out") from None
    for proc in procs:
        proc.join(timeout=60)
    return measured


def make_model(args: argparse.Namespace, root: Path) -> str:
    """``--model`` copied into ``root`` (the eplb table rewrites its routers), or a random MoE of the options' shape."""
    if args.model:
        return shutil.copytree(args.model, root / "moe")
    return str(make_tiny_model(root / "moe", seed=0, arch="qwen3_moe", hidden_size=args.hidden, num_layers=args.layers,
                               num_heads=8, num_kv_heads=4, num_experts=args.experts,
                               num_experts_per_tok=args.top_k, moe_intermediate_size=args.intermediate))


def ms_per_token(model_dir: str, args: argparse.Namespace, size: int, expert_parallel: bool,
                 graphs: bool = True) -> dict[int, float]:
    """Milliseconds per generated token at ``--concurrency`` and alone, both from one warmed-up engine group."""
    config = InferenceConfig(dtype=args.dtype, device=args.device, tensor_parallel_size=size,
                             enable_expert_parallel=expert_parallel, num_kv_blocks=512, enable_cuda_graphs=graphs)
    params = SamplingParams(temperature=0.0, num_tokens_to_generate=args.tokens, ignore_eos=True)
    prompts = [f"Expert parallel benchmark prompt {i}: the quick brown fox" for i in range(args.concurrency)]
    measured = {}
    with MegatronLLM(model_dir, config) as llm:
        llm.generate(prompts[:1], SamplingParams(temperature=0.0, num_tokens_to_generate=4, ignore_eos=True))
        for concurrency in (args.concurrency, 1):
            started = time.perf_counter()
            outs = llm.generate(prompts[:concurrency], params)
            elapsed = time.perf_counter() - started
            measured[concurrency] = 1000 * elapsed / sum(len(o.generated_tokens) for o in outs)
    return measured


def decode_table(model_dir: str, args: argparse.Namespace) -> None:
    print(f"decode: ms per generated token ({args.tokens} tokens a request, {args.device}, {args.dtype})")
    print(f"{'layout':<12} {'c=' + str(args.concurrency):>10} {'ratio':>7} {'c=1':>9} {'ratio':>7}")
    base = ms_per_token(model_dir, args, 1, False)
    print(f"{'one rank':<12} {base[args.concurrency]:>10.2f} {1.0:>7.2f} {base[1]:>9.2f} {1.0:>7.2f}")
    for size in args.sizes:
        layouts = [(f"TP={size}", False, True), (f"EP={size}", True, True)]
        if args.device == "cuda":  # CUDA graphs (the fixed-capacity all-to-all) against eager steps
            layouts.append((f"EP={size} eager", True, False))
        for name, expert_parallel, graphs in layouts:
            row = ms_per_token(model_dir, args, size, expert_parallel, graphs)
            print(f"{name:<12} {row[args.concurrency]:>10.2f} {row[args.concurrency] / base[args.concurrency]:>7.2f} "
                  f"{row[1]:>9.2f} {row[1] / base[1]:>7.2f}")


def bytes_table(model_dir: str, args: argparse.Namespace) -> None:
    print(f"\nbytes one rank sends per token of the step in one MoE layer ({args.batch_tokens} tokens a step, float32)")
    print(f"{'layout':<22} {'bytes/token':>12} {'x hidden':>9}")
    for size in args.sizes:
        layouts = {"tp": f"TP={size} all-reduce", "ep": f"EP={size} all-to-all", "ep-capacity": f"EP={size} capacity",
                   "ep-allgather": f"EP={size} all-reduce", "dp": f"DP={size} all-to-all",
                   "dp-capacity": f"DP={size} capacity"}
        measured = run_ranks(counting_probe, size, model_dir, ",".join(layouts), args.batch_tokens, args.device)
        for layout, name in layouts.items():
            print(f"{name:<22} {measured[layout]['bytes_per_token']:>12.0f} "
                  f"{measured[layout]['bytes_per_token'] / measured[layout]['hidden_bytes']:>9.2f}")


def bandwidth_table(args: argparse.Namespace) -> None:
    print(f"\nall-to-all of {args.mib} MiB a rank ({args.device}): bytes each rank sends the others per second")
    print(f"{'ranks':<6} {'GB/s':>8} {'ms':>8}")
    for size in args.sizes:
        measured = run_ranks(bandwidth_probe, size, args.device, args.mib)
        print(f"{size:<6} {measured['gb_per_s']:>8.2f} {measured['ms']:>8.2f}")


def skew_router(model_dir: str, hot: list[int]) -> None:
    """Make every MoE router favour ``hot``: a constant first feature in every token's embedding, read by those
    experts' router rows only (as ``tests/parallel/test_expert_parallel_eplb.py``'s model)."""
    from safetensors.torch import load_file, save_file  # noqa: PLC0415

    path = Path(model_dir) / "model.safetensors"
    tensors = load_file(path)
    tensors["model.embed_tokens.weight"][:, 0] = 1.0
    for name, tensor in tensors.items():
        if name.endswith("mlp.gate.weight"):
            tensor[:, 0] = 0.0
            tensor[hot, 0] = 0.3
    save_file(tensors, path, metadata={"format": "pt"})


def eplb_run(model_dir: str, args: argparse.Namespace, size: int, eplb: dict | None) -> tuple[float, float, float]:
    """(wall ms, group CPU ms) per generated token at ``--concurrency``, after a warm-up run long enough for the
    rearrangement, and the balancedness measured over the measured run (EPLB's own count; without EPLB a balancer
    that never moves: ``step_interval`` beyond the run)."""
    counting = eplb or {"window_size": 1000, "step_interval": 100000, "num_redundant_experts": 0}
    config = InferenceConfig(dtype=args.dtype, device=args.device, tensor_parallel_size=size, num_kv_blocks=512,
                             enable_expert_parallel=True, enable_eplb=True, eplb_config=counting,
                             max_requests=args.concurrency)
    params = SamplingParams(temperature=0.0, num_tokens_to_generate=args.tokens, ignore_eos=True)
    prompts = [f"Expert parallel benchmark prompt {i}: the quick brown fox" for i in range(args.concurrency)]
    with MegatronLLM(model_dir, config) as llm:
        balancer = llm.engine.model.expert_balancer
        llm.generate(prompts, params)  # warm-up: the rearrangement (with EPLB) happens here
        balancer.reset()
        cpu, started = group_cpu_seconds(llm), time.perf_counter()
        outs = llm.generate(prompts, params)
        wall, cpu = time.perf_counter() - started, group_cpu_seconds(llm) - cpu
        window = balancer.window.sum(0).view(len(balancer.blocks), size, -1).sum(2).float()
        measured = float((window.mean(1) / window.max(1).values).mean())
    tokens = sum(len(o.generated_tokens) for o in outs)
    return 1000 * wall / tokens, 1000 * cpu / tokens, measured


def eplb_table(model_dir: str, args: argparse.Namespace) -> None:
    skew_router(model_dir, args.hot)
    print(f"\nEPLB: router favouring experts {args.hot}, ms per generated token ({args.concurrency} requests of "
          f"{args.tokens} tokens, {args.device}, {args.dtype})")
    print(f"{'layout':<26} {'wall':>8} {'ratio':>7} {'cpu':>8} {'ratio':>7} {'balanced':>9}")
    for size in args.sizes:
        interval = max(4, args.tokens // 2)
        rows = [(f"EP={size}", None),
                (f"EP={size} EPLB +{args.redundant}", {"window_size": interval, "step_interval": interval,
                                                        "num_redundant_experts": args.redundant})]
        base = None
        for name, eplb in rows:
            wall, cpu, measured = eplb_run(model_dir, args, size, eplb)
            base = base or (wall, cpu)
            print(f"{name:<26} {wall:>8.2f} {wall / base[0]:>7.2f} {cpu:>8.2f} {cpu / base[1]:>7.2f} {measured:>9.3f}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--sizes", type=int, nargs="+", default=[2], help="ranks of the TP and EP groups")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--intermediate", type=int, default=256, help="each expert's intermediate size")
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--top-k", type=int, default=4)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=32, help="generated tokens a request")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--batch-tokens", type=int, default=64, help="tokens of the step the bytes are counted in")
    parser.add_argument("--mib", type=int, default=64, help="all-to-all size a rank, for the bandwidth table")
    parser.add_argument("--hot", type=int, nargs="+", default=[3, 5], help="experts the eplb table's router favours")
    parser.add_argument("--redundant", type=int, default=4, help="the eplb table's num_redundant_experts")
    parser.add_argument("--model", default=None,
                        help="an MoE model directory instead of a random one of --hidden, --experts... (copied: the "
                             "eplb table rewrites its routers); a caller that has one made skips importing its "
                             "transformers model class here")
    parser.add_argument("--tables", nargs="+", choices=("decode", "bytes", "bandwidth", "eplb"),
                        default=["decode", "bytes"])
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as root:
        model_dir = make_model(args, Path(root)) if {"decode", "bytes", "eplb"} & set(args.tables) else ""
        if "decode" in args.tables:
            decode_table(model_dir, args)
        if "bytes" in args.tables:
            bytes_table(model_dir, args)
        if "eplb" in args.tables:
            eplb_table(model_dir, args)
    if "bandwidth" in args.tables:
        bandwidth_table(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
