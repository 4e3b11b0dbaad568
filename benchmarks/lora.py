"""LoRA adapters against the base model, measured in one run: generated tokens/s at batch 64 with 0, 1 and 8
adapters active, each a ratio to the same engine's base-model run (and to an engine without ``enable_lora``).

Every run is the same 64 rows of greedy decoding (and, separately, sampled: temperature 1, ``n=2`` on 32
prompts); only the adapters the rows name differ: none, one for all rows, or 8 round-robin. Adapters are
written in PEFT's format (``adapter_config.json`` + ``adapter_model.safetensors``) with random weights
of rank 16 on every attention and MLP projection. Runs are interleaved and repeated (``--repeats``); the
median of each is reported. Goal (CPU): 8 adapters keep at least 0.8x of the base model's throughput.

    python benchmarks/lora.py                 # the default shape (hidden 512, 4 layers), CPU or GPU
    python benchmarks/lora.py --smoke         # tiny shapes: checks the plumbing

``--push``: the RL path instead. A local fleet (coordinator + one engine process, ``--enable-lora``) of the 1B
shape (Llama 3.2 1B's layers: hidden 2048, 16 layers, 32/8 heads, intermediate 8192; a 512-word vocabulary,
which adapters do not touch) serves; this process is the trainer and pushes a rank-32 adapter on every
projection from memory (``WeightSender.send_lora``, gloo) as versions 1, 2, ...: PAUSE, push, UNPAUSE, then
the first request under the new version (it writes the version into a slot), and for scale a base-model
request after it. Medians of ``--repeats``, each phase and the whole.

    python benchmarks/lora.py --push          # 1B shape, rank 32, CPU
    python benchmarks/lora.py --push --smoke  # tiny shapes
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from megatron_serve import InferenceConfig, MegatronLLM, SamplingParams, WeightSender
from megatron_serve.client.coordinator_client import InferenceClient
from megatron_serve.fleet.local_fleet import LocalFleet
from megatron_serve.model.config import ModelConfig
from megatron_serve.model.lora.checkpoint import PROJECTIONS, projection_shape
from megatron_serve.model.tiny import make_tiny_model

from cli_options import add_number_options

GOAL_8 = 0.8


SHAPE_1B = dict(hidden_size=2048, num_layers=16, num_heads=32, num_kv_heads=8, intermediate_size=8192)


def adapter_tensors(config: ModelConfig, rank: int, seed: int) -> dict[str, torch.Tensor]:
    """Random LoRA weights of ``rank`` on every projection of every layer, under PEFT's names."""
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config.num_layers):
        for projection in PROJECTIONS:
            out_features, in_features = projection_shape(config, layer, projection)
            module = "self_attn" if projection in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            key = f"base_model.model.model.layers.{layer}.{module}.{projection}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, in_features, generator=generator) / in_features**0.5
            tensors[f"{key}.lora_B.weight"] = torch.randn(out_features, rank, generator=generator) / rank**0.5
    return tensors


def write_adapter(path: Path, config: ModelConfig, rank: int, seed: int) -> str:
    """A PEFT LoRA adapter with random weights on every projection of every layer."""
    tensors = adapter_tensors(config, rank, seed)
    path.mkdir(parents=True)
    save_file(tensors, path / "adapter_model.safetensors")
    (path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": rank, "lora_alpha": rank,
                                                          "target_modules": list(PROJECTIONS)}))
    return str(path)


def tokens_per_s(llm: MegatronLLM, prompts: list[list[int]], params: SamplingParams, names: list[str | None]
                 ) -> tuple[float, float]:
    """Generated tokens per wall second and per CPU second of this process, for one batch whose prompt ``i``
    runs under adapter ``names[i]``. On a shared CPU the wall clock also counts other processes' work; the
    CPU time counts only this one's."""
    per_prompt = [SamplingParams(**{**params_fields(params), "lora_name": name}) for name in names]
    wall, cpu = time.perf_counter(), time.process_time()
    outs = llm.generate(prompts, per_prompt)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    tokens = sum(len(o.generated_tokens) for o in outs)
    return tokens / wall, tokens / cpu


def params_fields(params: SamplingParams) -> dict:
    return {f: getattr(params, f) for f in params.__struct_fields__ if f not in ("lora_name", "lora_path")}


async def push_rounds(model_dir: Path, rank: int, repeats: int) -> list[dict[str, float]]:
    """PAUSE, push version ``i``, UNPAUSE and a first request under it, ``repeats`` times; seconds per phase."""
    config = ModelConfig.from_dir(model_dir)
    adapters = [adapter_tensors(config, rank, seed) for seed in (1, 2)]
    fleet = LocalFleet(str(model_dir), 1, InferenceConfig(num_kv_blocks=16, max_sequence_length=128, enable_lora=True,
                                                         max_lora_rank=rank, max_loras=2))
    address = await asyncio.to_thread(fleet.start, 600)
    client = InferenceClient(address, token=fleet.token)
    await client.start(timeout=60)
    rounds = []
    try:
        await client.wait_for_engines(1, timeout=600)
        sender = WeightSender(client, backend="gloo")
        first = SamplingParams(temperature=0.0, num_tokens_to_generate=1, ignore_eos=True, lora_name="rl")
        for version in range(1, repeats + 2):  # the first round warms up
            t0 = time.perf_counter()
            await client.pause()
            t1 = time.perf_counter()
            ack = await sender.send_lora("rl", adapters[version % 2], version=version, rank=rank, alpha=2 * rank)
            t2 = time.perf_counter()
            await client.unpause()
            t3 = time.perf_counter()
            out = await client.add_request([11, 12, 13, 14], first)
            t4 = time.perf_counter()
            assert out.lora_epochs == [version], out.lora_epochs
            await client.add_request([11, 12, 13, 14], SamplingParams(**{**params_fields(first), "lora_name": None}))
            base = time.perf_counter() - t4
            (facts,) = ack["detail"]["engines"].values()
            sent = ack["detail"]["sender"]
            rounds.append({"bytes": sent["bytes"], "pause": t1 - t0, "push": t2 - t1,
                           "  sender: engines join": sent["rendezvous_s"], "  sender: broadcast": sent["transfer_s"],
                           "  engine: verify": facts["verified_s"], "  engine: receive and register": facts["load_s"],
                           "unpause": t3 - t2, "first request": t4 - t3, "total": t4 - t0,
                           "(a base-model request after it)": base})
    finally:
        client.close()
        await asyncio.to_thread(fleet.stop, 60)
    return rounds[1:]


def push_main(args: argparse.Namespace) -> None:
    shape = dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128) if args.smoke \
        else SHAPE_1B
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_tiny_model(Path(tmp) / "model", seed=0, **shape)
        load = os.getloadavg()[0]
        rounds = asyncio.run(push_rounds(model_dir, args.push_rank, 1 if args.smoke else args.repeats))
    size = rounds[0]["bytes"]
    print(f"\nLoRA adapter push, rank {args.push_rank} on every projection of {shape['num_layers']} layers "
          f"(hidden {shape['hidden_size']}, intermediate {shape['intermediate_size']}): {size / 2**20:.1f} MiB fp32, "
          f"gloo, CPU ({os.cpu_count()} cores, load average {load:.1f} -> {os.getloadavg()[0]:.1f}), "
          f"median of {len(rounds)}")
    for phase in rounds[0]:
        if phase != "bytes":
            print(f"  {phase:<32} {statistics.median(r[phase] for r in rounds) * 1000:9.1f} ms")
    push = statistics.median(r["push"] for r in rounds)
    print(f"  push: {size / push / 1e9:.2f} GB/s of adapter bytes end to end")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_number_options(parser, hidden_size=512, layers=4, rank=16, prompt_len=32, output_len=32, batch=64, repeats=5)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, one repeat")
    parser.add_argument("--push", action="store_true", help="measure adapter pushes from trainer memory instead")
    parser.add_argument("--push-rank", type=int, default=32, help="the pushed adapter's rank (default: %(default)s)")
    args = parser.parse_args()
    if args.push:
        push_main(args)
        return
    if args.smoke:
        args.hidden_size, args.layers, args.output_len, args.batch, args.repeats = 64, 2, 4, 16, 1
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model_dir = make_tiny_model(root / "model", seed=0, hidden_size=args.hidden_size, num_layers=args.layers,
                                    num_heads=8, num_kv_heads=4, intermediate_size=args.hidden_size * 8 // 3)
        config = ModelConfig.from_dir(model_dir)
        adapters = {f"a{i}": write_adapter(root / f"a{i}", config, args.rank, i) for i in range(8)}
        common = dict(dtype="float32", device=args.device, max_requests=args.batch, max_batch_tokens=4096)
        plain = MegatronLLM(str(model_dir), InferenceConfig(**common))
        lora = MegatronLLM(str(model_dir), InferenceConfig(**common, enable_lora=True, max_loras=8,
                                                           max_lora_rank=args.rank, lora_modules=adapters))
        generator = torch.Generator().manual_seed(0)
        prompts = [torch.randint(10, 500, (args.prompt_len,), generator=generator).tolist() for _ in range(args.batch)]
        kinds = {"greedy": (prompts, SamplingParams(temperature=0.0, num_tokens_to_generate=args.output_len,
                                                    ignore_eos=True)),
                 "sampled n=2": (prompts[: args.batch // 2], SamplingParams(temperature=1.0, n=2, seed=None,
                                                                           num_tokens_to_generate=args.output_len,
                                                                           ignore_eos=True))}
        print(f"device {args.device}, torch threads {torch.get_num_threads()}, hidden {args.hidden_size}, "
              f"{args.layers} layers, rank {args.rank}, batch {args.batch}, {args.prompt_len} prompt + "
              f"{args.output_len} generated tokens per row, median of {args.repeats}")
        for kind, (batch, params) in kinds.items():
            runs = {"lora off": (plain, [None]), "0 adapters": (lora, [None]), "1 adapter": (lora, ["a0"]),
                    "8 adapters": (lora, list(adapters))}
            for llm, names in runs.values():  # warm-up: first-use costs out of the timings
                tokens_per_s(llm, batch[:2], params, (names * 2)[:2])
            walls: dict[str, list[float]] = {name: [] for name in runs}
            cpus: dict[str, list[float]] = {name: [] for name in runs}
            for _ in range(args.repeats):
                for name, (llm, names) in runs.items():
                    row_names = [names[i % len(names)] for i in range(len(batch))]
                    wall, cpu = tokens_per_s(llm, batch, params, row_names)
                    walls[name].append(wall)
                    cpus[name].append(cpu)
            wall = {name: statistics.median(values) for name, values in walls.items()}
            cpu = {name: statistics.median(values) for name, values in cpus.items()}
            print(f"\n{kind}: generated tokens per wall second and per CPU second (ratios to the base model on the "
                  "same engine)")
            for name in runs:
                print(f"  {name:<11} {wall[name]:9.1f}/s {wall[name] / wall['0 adapters']:5.2f}x   "
                      f"{cpu[name]:9.1f}/cpu-s {cpu[name] / cpu['0 adapters']:5.2f}x")
            ratio = cpu["8 adapters"] / cpu["0 adapters"]
            print(f"  8 adapters keep {ratio:.2f}x of the base model's tokens per CPU second "
                  f"(wall: {wall['8 adapters'] / wall['0 adapters']:.2f}x): goal {GOAL_8}x "
                  f"{'met' if ratio >= GOAL_8 else 'NOT met'}")
        plain.close()
        lora.close()


if __name__ == "__main__":
    main()
