"""One mixture-of-experts layer's experts: ``fused_moe`` against ``transformers``' experts, same weights.

The baseline is ``transformers``' own ``Qwen3MoeExperts`` in its eager form (a Python loop over the
experts that got tokens, gathering and scattering each one's rows) holding the same stacked weights
and given the same router choice; its ``grouped_mm`` form (``torch._grouped_mm``) runs beside it.
Against them run this project's PyTorch reference (pairs sorted by expert, one matmul per expert and
projection: the CPU engine path) and, on CUDA, the Triton kernel (one grouped GEMM per projection,
no loop over experts). Prints milliseconds per call and the speed-up over the baseline for
decode-sized and prefill-sized token counts; every implementation's output is checked against the
baseline's first (one that cannot run on this device says so instead).

Default shape: Qwen3-30B-A3B's layer (hidden 2048, 128 experts of 768, top-8) on CUDA, a quarter of
it per dimension on CPU (hidden 512, 32 experts of 192, top-8), where the full layer's 2.4 GB of
float32 weights would measure memory bandwidth of a shared machine.

    python benchmarks/fused_moe.py
    python benchmarks/fused_moe.py --tokens 1 16 256 2048 --dtype bfloat16
"""

from __future__ import annotations

import argparse
from typing import Callable

import torch
import transformers
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

from megatron_kernels import reference
from megatron_kernels.moe_weights import ExpertWeights
from sampler import seconds_per_step as seconds_per_call  # benchmarks/ is this script's first path entry

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def transformers_experts(implementation: str, args: argparse.Namespace, w13: torch.Tensor, w2: torch.Tensor
                         ) -> Callable[..., torch.Tensor]:
    """``transformers``' Qwen3-MoE experts in one of its implementations, holding ``w13``/``w2``, as an op."""
    config = transformers.Qwen3MoeConfig(hidden_size=args.hidden, moe_intermediate_size=args.intermediate,
                                         num_experts=args.experts, num_experts_per_tok=args.top_k)
    config._experts_implementation = implementation
    experts = Qwen3MoeExperts(config)
    experts.gate_up_proj = torch.nn.Parameter(w13, requires_grad=False)
    experts.down_proj = torch.nn.Parameter(w2, requires_grad=False)
    return lambda hidden, _held, weights, ids: experts(hidden, ids, weights.to(hidden.dtype))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    cuda = torch.cuda.is_available()
    parser.add_argument("--hidden", type=int, default=2048 if cuda else 512)
    parser.add_argument("--intermediate", type=int, default=768 if cuda else 192)
    parser.add_argument("--experts", type=int, default=128 if cuda else 32)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 256, 2048] if cuda else [1, 16, 256])
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16" if cuda else "float32")
    parser.add_argument("--iters", type=int, default=20)
    args = parser.parse_args(argv)
    device = torch.device("cuda" if cuda else "cpu")
    dtype = DTYPES[args.dtype]
    torch.manual_seed(0)
    w13 = torch.randn(args.experts, 2 * args.intermediate, args.hidden, device=device) * args.hidden ** -0.5
    w2 = torch.randn(args.experts, args.hidden, args.intermediate, device=device) * args.intermediate ** -0.5
    w13, w2 = w13.to(dtype), w2.to(dtype)
    moe = ExpertWeights(w13, w2)
    candidates: dict[str, Callable] = {"transformers grouped_mm": transformers_experts("grouped_mm", args, w13, w2),
                                       "reference (sorted)": reference.fused_moe}
    if cuda:
        from megatron_kernels.triton_moe import fused_moe as triton_fused_moe  # noqa: PLC0415

        candidates["triton (grouped GEMM)"] = triton_fused_moe
    baseline_op = transformers_experts("eager", args, w13, w2)

    print(f"device {device} ({torch.cuda.get_device_name(device) if cuda else f'{torch.get_num_threads()} threads'}); "
          f"{args.dtype}; hidden {args.hidden}, {args.experts} experts of {args.intermediate}, top-{args.top_k}; "
          "ms per call (speed-up over transformers eager)")
    print(f"{'tokens':>7} {'transformers eager':>19} " + " ".join(f"{name:>25}" for name in candidates))
    tolerance = 1e-4 if dtype == torch.float32 else 3e-2
    for num_tokens in args.tokens:
        hidden = torch.randn(num_tokens, args.hidden, device=device, dtype=dtype)
        logits = torch.randn(num_tokens, args.experts, device=device)
        weights, ids = torch.topk(torch.softmax(logits, -1), args.top_k, dim=-1)
        weights = weights / weights.sum(-1, keepdim=True)
        cells = []
        with torch.inference_mode():
            expected = baseline_op(hidden, moe, weights, ids)
            baseline = seconds_per_call(lambda: baseline_op(hidden, moe, weights, ids), device, args.iters)
            for name, op in candidates.items():
                try:
                    got = op(hidden, moe, weights, ids)
                except (RuntimeError, NotImplementedError) as exc:  # e.g. grouped_mm on a device without it
                    cells.append(f"{'n/a: ' + str(exc).splitlines()[0][:20]:>25}")
                    continue
                torch.testing.assert_close(got.float(), expected.float(), atol=tolerance, rtol=tolerance,
                                           msg=lambda m, name=name: f"{name} differs from transformers: {m}")
                seconds = seconds_per_call(lambda op=op: op(hidden, moe, weights, ids), device, args.iters)
                cells.append(f"{seconds * 1e3:>16.3f} ({baseline / seconds:5.2f}x)")
        print(f"{num_tokens:>7} {baseline * 1e3:>19.3f} " + " ".join(cells))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
