#!/usr/bin/env bash
# One device call's worth of GPU checks, tables and logs under $OUT (default ./gpu-out).
#
#   bash benchmarks/gpu_session.sh tests     # kernels, CUDA graphs (decode and piecewise mixed), step paths, start-up
#                                            # compile, parity (bf16, 60 cases), MoE and VLM tests natively
#   bash benchmarks/gpu_session.sh serving   # served vs offline, 1B shape, c=64 (greedy and sampled side by side) and c=256
#   bash benchmarks/gpu_session.sh bench     # decode roofline (1B), fused MoE, MoE/VLM throughput, weight sync
#   bash benchmarks/gpu_session.sh host      # the host's ceiling on this 16-core host: the whole stack on the stand-in
#                                            # forward (fixed logits, 128,256 words) at c 64/256/1024, greedy and
#                                            # sampled (n 4, logprobs 1), 1, 2 and 4 API servers, CPU by process and
#                                            # stage (py-spy, a wheel in .whl: py_spy-*-manylinux*.whl)
#   bash benchmarks/gpu_session.sh fp8       # the FP8 tests natively, then benchmarks/fp8.py's tables (8B shape)
#   bash benchmarks/gpu_session.sh invariant # --batch-invariant: the invariant Triton kernels' tests (attention in
#                                            # CUDA graphs included), the invariance, graphs-vs-eager and trainer-parity
#                                            # tests, the engine-against-itself search in the mode (bf16), the mode's
#                                            # decode throughput against the default at batch 1/64/256 (1B shape,
#                                            # graphs on), then its cost table; tests/invariance's Megatron-core
#                                            # and TorchTitan recipes need their wheels in .whl (megatron-core,
#                                            # torchtitan, spmd_types, tyro, docstring_parser, typeguard)
#   bash benchmarks/gpu_session.sh speculative # speculative decoding on the GPU (bf16, the pair trained there in
#                                            # seconds): benchmarks/speculative.py's table, then its methods with K
#                                            # pinned again under VLLM_BATCH_INVARIANT=1, where every row's tokens
#                                            # must equal no speculation's (without the mode the verify forward's
#                                            # other shape rounds bf16 differently, and some rows differ); the
#                                            # speculative tests build CPU engines, so they run in CI, not here
#   bash benchmarks/gpu_session.sh ep        # expert parallelism on this node's GPUs: the EP tests natively (NCCL),
#                                            # all-to-all bandwidth, then decode of a Qwen3-30B-A3B-like MoE layer
#                                            # shape at one rank and TP/EP 2/4/8 (as many as the GPUs allow); with
#                                            # 2 GPUs or more first the EP engines against one rank over NCCL; the
#                                            # GPU-only EP tests (test_expert_parallel_gpu.py: the fixed-capacity
#                                            # all-to-all captured in a CUDA graph against eager, with CUDA's sync
#                                            # debug mode; on 2 GPUs an EP=2 engine's graphs against its eager
#                                            # tokens, and DeepEP's modes where deep_ep imports)
#   bash benchmarks/gpu_session.sh pp        # pipeline stages: the PP and micro-batch tests, then
#                                            # benchmarks/pipeline_parallel.py's table (1B-like dense shape, stages
#                                            # 2/4/8 as the GPUs allow, one micro-batch vs as many as stages)
#   bash benchmarks/gpu_session.sh refit     # sharded refit: the plan's and the fleet's tests natively (engines on the
#                                            # GPU, trainer ranks on gloo: one GPU cannot hold two NCCL ranks; a late
#                                            # joiner pulling from a GPU peer, over gloo), the MoE (EP), one-transaction
#                                            # (EAGLE-3 head + LoRA), drafter and FP8 refits, then
#                                            # refit_sharded.py's table (bytes/s per link, time vs size, world 1/2/4)
#   bash benchmarks/gpu_session.sh kvtiers   # KV beyond the device pool: the host tier's side-stream copies and the
#                                            # tier, keep_kv and partial-rollout tests natively (the engines on the
#                                            # GPU), then benchmarks/kv_tiers.py's tables (tier on/off, keep_kv vs
#                                            # recompute) at a 1024-wide, 16-layer shape
#   bash benchmarks/gpu_session.sh rl        # the RL frameworks' weight routes with the engine on the GPU (vLLM's,
#                                            # SGLang's, TRL's, prime-rl's over gloo), then with 2 GPUs or more the
#                                            # NCCL leg: a trainer on GPU 1 broadcasting into the server on GPU 0
#                                            # through vLLM's routes, packed and unpacked, checked bitwise
#
# The device image has torch, triton and transformers; packages it lacks travel as wheels in .whl
# (`pip download --python-version 3.12 --only-binary=:all: -d .whl ...`) and install into /tmp/site. Each step has its own time limit, so one
# that hangs still leaves the others' tables.
set -uo pipefail
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site PATH="/tmp/site/bin:$PATH"  # (py-spy's binary)
fi
export PYTHONPATH="runtime:kernels:operator:.${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1

step() {  # step NAME SECONDS COMMAND...: run with a limit, keep the log, report the exit code
  local name=$1 limit=$2
  shift 2
  echo "=== $name: $*"
  local start=$SECONDS
  timeout "$limit" "$@" 2>&1 | tee "$OUT/$name.log"
  echo "=== $name: exit ${PIPESTATUS[0]} after $((SECONDS - start)) s"
}

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/device.txt"
python3 -c "import sys, torch, triton, transformers; print('python', sys.version.split()[0], 'torch', torch.__version__,
'cuda', torch.version.cuda, 'triton', triton.__version__, 'transformers', transformers.__version__)" | tee -a "$OUT/device.txt"

case ${1:-tests} in
  tests)  # the tests took 4 min on an H200 (structured output's need jsonschema, referencing, rpds-py and
          # jsonschema-specifications as wheels); parity cases take about 4 s each there, so 60 fit the call
    step pytest 330 python3 -m pytest -q -p no:cacheprovider --timeout 180 -rfE --durations 10 \
      tests/kernels tests/engine/test_cuda_graphs.py tests/model/test_hf_parity.py tests/model/test_moe.py \
      tests/model/test_vision_parity.py tests/wire/test_expert_routing.py tests/engine/test_engine.py \
      tests/engine/test_sampler.py tests/engine/test_refit.py tests/parallel/test_tensor_parallel.py tests/engine/test_structured_output.py \
      tests/engine/test_step_paths.py tests/engine/test_kernel_warmup.py tests/engine/test_step_never_waits.py
    step parity 240 python3 -m pytest -q -p no:cacheprovider -rfE tests/parity --parity-device cuda \
      --parity-dtype bfloat16 --parity-cases 60
    ;;
  serving)  # a Llama-3.2-1B shape (random bf16 weights, 128,256-word vocabulary), 128 prompt / 128 generated tokens
    python3 -m megatron_serve.cli make-tiny-model /tmp/llama-1b --hidden-size 2048 --layers 16 --heads 32 --kv-heads 8 \
      --intermediate-size 8192 --vocab-size 128256 --tie-word-embeddings > "$OUT/model.log" 2>&1
    step serving_c64 420 python3 benchmarks/serving.py --model /tmp/llama-1b --concurrency 64 --requests 512 \
      --prompt-tokens 128 --output-tokens 128 --run-args "--dtype bfloat16 --max-num-seqs 64"
    step serving_c64_sampled 420 python3 benchmarks/serving.py --model /tmp/llama-1b --concurrency 64 --requests 512 \
      --prompt-tokens 128 --output-tokens 128 --temperature 1 --top-p 0.9 --run-args "--dtype bfloat16 --max-num-seqs 64"
    step serving_c256 420 python3 benchmarks/serving.py --model /tmp/llama-1b --concurrency 256 --requests 1024 \
      --prompt-tokens 128 --output-tokens 128 --run-args "--dtype bfloat16 --max-num-seqs 256"
    step decode_roofline 260 python3 benchmarks/decode_roofline.py --models 1b --batches 1,8,64,256
    ;;
  host)  # the engine samples on the GPU; the stand-in's logits are drawn there once
    step host_ceiling 560 python3 benchmarks/host_ceiling.py --concurrency 64,256,1024 --api-servers 1,2,4 \
      --output-tokens 64 --run-args "--max-num-seqs 1024"
    ;;
  bench)
    step decode_roofline 260 python3 benchmarks/decode_roofline.py --models 1b --batches 1,8,64,256
    step fused_moe 60 python3 benchmarks/fused_moe.py
    step moe_throughput 150 python3 benchmarks/offline_throughput.py --arch qwen3_moe
    step vlm_qwen2_vl 100 python3 benchmarks/vlm.py --arch qwen2_vl --requests 64
    step vlm 90 python3 benchmarks/vlm.py --requests 64
    step weight_sync 200 python3 benchmarks/weight_sync.py --bucket-mib 64 --rounds 2
    ;;
  fp8)
    step pytest_fp8 300 python3 -m pytest -q -p no:cacheprovider --timeout 180 -rfE --durations 10 \
      tests/kernels/test_fp8_kernels.py tests/model/test_fp8_checkpoints.py tests/engine/test_fp8_serving.py
    step fp8_gemm 120 python3 benchmarks/fp8.py gemm
    step fp8_agreement 120 python3 benchmarks/fp8.py agreement
    step fp8_targets 540 python3 benchmarks/fp8.py targets
    ;;
  invariant)  # the GPU kernels' checks and their cost first: the steps together outlast one 10-minute call
    step pytest_invariant_gpu 240 python3 -m pytest -q -p no:cacheprovider --timeout 120 -rfEs \
      tests/kernels/test_invariant_attention.py tests/kernels/test_invariant_kernels.py \
      tests/invariance/test_invariant_cuda_graphs.py tests/model/test_weighted_sum.py
    step invariant_gpu 300 python3 benchmarks/invariant_gpu.py --batches 1,64,256
    step pytest_invariant 420 python3 -m pytest -q -p no:cacheprovider --timeout 300 -rfEs --durations 10 tests/invariance
    step parity_invariant 300 python3 -m pytest -q -p no:cacheprovider -rfE tests/parity/test_vs_itself_invariant.py \
      --parity-device cuda --parity-dtype bfloat16 --parity-cases 400
    step batch_invariance 540 python3 benchmarks/batch_invariance.py --device cuda --dtype bfloat16 --hidden-size 1024 --layers 8 \
      --requests 128 --row-tiles 16,64 --served
    ;;
  speculative)  # the control (default mode) first, then the invariant mode whose tokens must all be equal
    step speculative 300 python3 benchmarks/speculative.py --device cuda --dtype bfloat16 --concurrency 1,8,256 \
      --threads 4 --cache-dir /tmp/speculative-pair
    VLLM_BATCH_INVARIANT=1 step speculative_invariant 240 python3 benchmarks/speculative.py --device cuda \
      --dtype bfloat16 --concurrency 1,8,256 --threads 4 --methods none,ngram/K,draft_model/K \
      --cache-dir /tmp/speculative-pair
    ;;
  ep)  # sizes 2, 4, 8 up to the GPU count; one GPU runs the tests' CPU path (gloo) and the one-rank row only
    gpus=$(nvidia-smi -L | wc -l)
    sizes=$(for n in 2 4 8; do [ "$n" -le "$gpus" ] && echo -n "$n "; done)
    if [ "$gpus" -ge 2 ]; then  # test_expert_parallel's engines run where there is a GPU a rank (tests/devices.py)
      echo "=== ep: $gpus GPUs: EP engines of up to $gpus ranks against one rank on the GPU, over NCCL"
      step ep_nccl_equality 540 python3 -m pytest -q -p no:cacheprovider --timeout 500 -rfE \
        tests/parallel/test_expert_parallel.py -k "engine_equals"
    else
      echo "=== ep: one GPU: no NCCL equality check (NCCL needs a GPU a rank); the EP tests below run over gloo on CPU"
    fi
    step ep_gpu 540 python3 -m pytest -q -p no:cacheprovider --timeout 500 -rfEs \
      tests/parallel/test_expert_parallel_gpu.py
    step pytest_ep 540 python3 -m pytest -q -p no:cacheprovider --timeout 300 -rfE --durations 10 \
      tests/parallel/test_expert_parallel.py tests/parallel/test_expert_parallel_features.py \
      tests/parallel/test_expert_backend.py tests/parallel/test_expert_parallel_eplb.py tests/model/test_eplb.py
    if [ -n "$sizes" ]; then
      step all_to_all 120 python3 benchmarks/expert_parallel.py --device cuda --tables bandwidth --sizes $sizes --mib 256
      step ep_decode 540 python3 benchmarks/expert_parallel.py --device cuda --dtype bfloat16 --sizes $sizes \
        --hidden 2048 --experts 128 --top-k 8 --intermediate 768 --layers 8 --concurrency 64 --tokens 64
      step ep_eplb 540 python3 benchmarks/expert_parallel.py --device cuda --dtype bfloat16 --tables eplb \
        --sizes $sizes --hidden 2048 --experts 128 --top-k 8 --intermediate 768 --layers 8 --concurrency 64 \
        --tokens 64 --redundant 32
    else
      echo "=== ep: one GPU: no multi-rank rows (TP/EP need a GPU a rank)"
    fi
    ;;
  pp)  # pipeline stages 2, 4, 8 up to the GPU count, a GPU a stage (NCCL); one GPU runs the tests' CPU path only
    gpus=$(nvidia-smi -L | wc -l)
    stages=$(for n in 2 4 8; do [ "$n" -le "$gpus" ] && echo -n "$n "; done)
    step pytest_pp 400 python3 -m pytest -q -p no:cacheprovider --timeout 300 -rfE --durations 10 \
      tests/parallel/test_pipeline_parallel.py tests/engine/test_micro_batches.py
    if [ -n "$stages" ]; then
      step pp_micro_batches 540 python3 benchmarks/pipeline_parallel.py --device cuda --dtype bfloat16 --stages $stages \
        --hidden 2048 --intermediate 8192 --layers 16 --concurrency 64 --tokens 64
    else
      echo "=== pp: one GPU: no multi-stage rows (a stage needs a GPU of its own)"
    fi
    ;;
  refit)
    step pytest_refit 480 python3 -m pytest -q -p no:cacheprovider --timeout 450 -rfE --durations 10 \
      tests/weights/test_shards.py tests/weights/test_sharded_refit_fleet.py tests/weights/test_adapters_in_refit.py \
      tests/weights/test_peer_pull_fleet.py
    step pytest_refit_moe_drafter_fp8 480 python3 -m pytest -q -p no:cacheprovider --timeout 450 -rfE --durations 10 \
      tests/weights/test_sharded_refit_moe_fleet.py tests/weights/test_refit_transaction_fleet.py \
      tests/weights/test_drafter_refit_fleet.py tests/weights/test_fp8_weight_sync.py
    step refit_sharded 540 python3 benchmarks/refit_sharded.py --sizes 1024,2048 --layers 8 --world-sizes 1,2,4 \
      --rounds 2 --bucket-mib 64
    ;;
  kvtiers)
    step pytest_kv_tiers 540 python3 -m pytest -q -p no:cacheprovider --timeout 300 -rfEs --durations 10 \
      tests/engine/test_kv_offload_cuda.py tests/engine/test_kv_offload.py tests/engine/test_keep_kv.py \
      tests/server/test_kv_tiers_http.py tests/parallel/test_kv_tier_groups.py
    step kv_tiers 540 python3 benchmarks/kv_tiers.py --device cuda --dtype bfloat16 --hidden-size 1024 --layers 16 \
      --prefix-len 2048 --pool-blocks 512 --tier-gib 4
    ;;
  rl)  # a trainer and an engine cannot share one GPU's NCCL group: the NCCL leg needs two
    step pytest_rl_weights 480 python3 -m pytest -q -p no:cacheprovider --timeout 450 -rfE --durations 10 \
      tests/server/rl/test_vllm_weights.py tests/server/rl/test_sglang_weights.py tests/server/rl/test_trl_weights.py
    if [ "$(nvidia-smi -L | wc -l)" -ge 2 ]; then
      step rl_nccl 480 python3 -m pytest -q -p no:cacheprovider --timeout 450 -rfEs tests/server/rl/test_vllm_weights_nccl.py
    else
      echo "=== rl: one GPU: no NCCL leg (the trainer needs a GPU of its own)"
    fi
    ;;
  *) echo "usage: $0 tests|serving|bench|fp8|invariant|speculative|ep|pp|refit|kvtiers|rl" >&2; exit 2 ;;
esac
