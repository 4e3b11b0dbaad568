"""``vllm serve``'s options, as one table: implemented here, accepted and changing nothing, or refused.

Every row is (vLLM's option, status, reason). The table drives:

* the parsers: :func:`add_vllm_options` adds the rows that carry a ``spec`` to the commands of their
  scope (HTTP-server options to ``run``, ``serve`` and ``server``; engine options to ``run``,
  ``serve``, ``engine`` and ``generate``). Rows without a spec name an option the commands define
  themselves, under vLLM's name or as an alias (:mod:`.aliases`);
* the start-up warnings: :func:`accepted_warnings` gives one line per accepted option given, saying
  why it changes nothing here (never silently ignored; the CLI prints them before the command runs);
* the flag table of ``docs/vllm-mapping.md`` (``tools/generate_docs.py``);
* the keywords of the Python ``LLM(...)`` (each option is also vLLM's ``LLM`` keyword: ``--swap-space`` is
  ``swap_space=``), in :mod:`megatron_serve.client.vllm_args`: which is why the table lives in the client.

A refused option is parsed too, so that its error says why (with the command's usage) instead of
"unrecognized arguments". ``tests/commands/test_vllm_options.py`` parses every row and starts
``serve`` once with the implemented options and once with the accepted ones.

Options other work adds (``--stream-interval``, the CUDA-graph capture sizes) become rows here.
"""

from __future__ import annotations

import argparse
import enum
import json
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Callable, Mapping

from ..http_options import TOOL_CALL_PARSERS
from ..wire.kv_events import KV_OFFLOADING_BACKENDS, KVEventsConfig, parse_kv_events_config

class Status(enum.Enum):
    IMPLEMENTED = "implemented"  # with vLLM's meaning (under its name, or as an alias of ours)
    ACCEPTED = "accepted"  # parsed, changes nothing here; a start-up warning says why
    REFUSED = "refused"  # parsed and refused with the reason


class Scope(enum.Enum):
    SERVER = "server"  # the OpenAI server's options: run, serve, server
    ENGINE = "engine"  # the engines' options: run, serve, engine, generate


#: ``--quantization`` values that serve the checkpoint's weights as they are ("auto"/"none": an FP8 checkpoint's
#: included; "gguf", vLLM's for a GGUF file: its weights, dequantized at load).
CHECKPOINT_QUANTIZATIONS: tuple[str, ...] = ("auto", "none", "gguf")
#: ``--quantization`` values this build implements ("fp8": a float checkpoint's linear layers quantized at load).
QUANTIZATION_SCHEMES: tuple[str, ...] = (*CHECKPOINT_QUANTIZATIONS, "fp8")
#: ``--kv-cache-dtype`` values this build implements ("auto": the model's dtype; "fp8" is e4m3).
KV_CACHE_DTYPES: tuple[str, ...] = ("auto", "fp8", "fp8_e4m3")
#: ``--all2all-backend`` values this build implements ("auto" and "alltoall" are this project's; vLLM's "naive",
#: "pplx", "mori", "nixl_ep" and "flashinfer_*" are refused, naming them).
#: ``--weight-transfer-config`` backends: vLLM's ``nccl``, and ``gloo`` (this project's name) for CPU trainers.
WEIGHT_TRANSFER_BACKENDS: tuple[str, ...] = ("nccl", "gloo")
ALL2ALL_BACKENDS: tuple[str, ...] = ("auto", "alltoall", "allgather_reducescatter", "deepep_high_throughput",
                                     "deepep_low_latency")


def _supported(flag: str, values: tuple[str, ...], why: str) -> Callable[[str], str]:
    """An argparse ``type`` accepting ``values`` only; others are refused naming the flag and why."""
    def parse(value: str) -> str:
        if value not in values:
            raise argparse.ArgumentTypeError(f"{value!r} is not supported by this build (supported: "
                                             f"{', '.join(values)}): {why}")
        return value

    parse.__name__ = flag.removeprefix("--").replace("-", "_")
    return parse


def _positive_float(flag: str) -> Callable[[str], float]:
    """An argparse ``type`` for a positive number; others are refused naming the flag."""
    def parse(value: str) -> float:
        try:
            number = float(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{value!r} is not a number") from None
        if not number > 0 or number == float("inf"):
            raise argparse.ArgumentTypeError(f"{flag} must be a positive number, got {value!r}")
        return number

    parse.__name__ = flag.removeprefix("--").replace("-", "_")
    return parse


def _json_list(value: str) -> list[str]:
    """vLLM's CORS lists: a JSON list of strings (``'["https://a.example"]'``), or one bare item."""
    text = value.strip()
    if not text.startswith("["):
        return [text]
    try:
        items = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not a JSON list: {exc}") from None
    if not isinstance(items, list) or not all(isinstance(item, str) and item for item in items):
        raise argparse.ArgumentTypeError("must be a JSON list of non-empty strings")
    return items


def _lora_module(value: str) -> tuple[str, str]:
    """``--lora-modules`` items, as vLLM takes them: ``name=path`` or ``{"name": ..., "path": ...}`` (JSON; its
    ``base_model_name`` is the served model here)."""
    text = value.strip()
    if text.startswith("{"):
        try:
            item = json.loads(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(f"not a JSON object: {exc}") from None
        if not isinstance(item, dict) or set(item) - {"name", "path", "base_model_name"}:
            raise argparse.ArgumentTypeError("a JSON item takes name, path and base_model_name only")
        name, path = item.get("name"), item.get("path")
    else:
        name, _, path = text.partition("=")
    if not isinstance(name, str) or not name or not isinstance(path, str) or not path:
        raise argparse.ArgumentTypeError(f"{value!r}: expected name=path or {{\"name\": ..., \"path\": ...}}")
    return name, path


def _json_object(value: str) -> dict[str, Any]:
    """``--speculative-config``: vLLM's JSON object (its fields are checked where the engine's config is built,
    each bad one named)."""
    try:
        item = json.loads(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not a JSON object: {exc}") from None
    if not isinstance(item, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object, got {value!r}")
    return item


def _kv_events_config(value: str) -> KVEventsConfig:
    """``--kv-events-config``: vLLM's JSON object, every field checked (an unknown one named)."""
    try:
        return parse_kv_events_config(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix("--kv-events-config: ")) from None


def _weight_transfer_config(value: str) -> dict[str, Any]:
    """``--weight-transfer-config``: vLLM's JSON object, whose one field is ``backend``."""
    item = _json_object(value)
    if set(item) != {"backend"} or item["backend"] not in WEIGHT_TRANSFER_BACKENDS:
        raise argparse.ArgumentTypeError(f"{value!r}: expected {{\"backend\": \"nccl\"}} or {{\"backend\": \"gloo\"}}")
    return item


def _positive(value: str) -> int:
    try:
        number = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not an integer") from None
    if number < 1:
        raise argparse.ArgumentTypeError(f"{number}: must be a positive integer")
    return number


def _spec(**kwargs: Any) -> Mapping[str, Any]:
    return MappingProxyType(kwargs)


@dataclass(frozen=True)
class VllmOption:
    """One option of ``vllm serve`` and what it does here."""

    flags: tuple[str, ...]  # vLLM's spellings, its name first
    status: Status
    reason: str  # what it does here, or why it changes nothing, or why it is refused
    ours: str | None = None  # our option with the same effect, when it has another name
    spec: Mapping[str, Any] | None = None  # argparse keywords, when this table defines the option
    scope: Scope | None = None  # the commands a defined option is added to
    example: tuple[str, ...] = ()  # arguments a test passes ({model}, {port}, {tmp}: filled in by the test)

    @property
    def name(self) -> str:
        return self.flags[0]

    @property
    def dest(self) -> str:
        return (self.spec or {}).get("dest") or self.name.removeprefix("--").replace("-", "_")


_IMPLEMENTED, _ACCEPTED, _REFUSED = Status.IMPLEMENTED, Status.ACCEPTED, Status.REFUSED
_SERVER, _ENGINE = Scope.SERVER, Scope.ENGINE

VLLM_OPTIONS: tuple[VllmOption, ...] = (
    # ---- the commands' own options, under vLLM's name or as an alias (commands.aliases)
    VllmOption(("--model",), _IMPLEMENTED, "a model directory or a Hub id (`org/name[@revision]`): the Hugging "
               "Face cache first (offline works), else a download with progress; served under the Hub id; "
               "`serve MODEL` takes it as its first argument, as `vllm serve` does"),
    VllmOption(("--revision",), _IMPLEMENTED, "", example=("--revision", "main")),
    VllmOption(("--tokenizer",), _IMPLEMENTED, "", example=("--tokenizer", "{model}")),
    VllmOption(("--download-dir",), _IMPLEMENTED, "the Hugging Face cache that Hub ids are read from and "
               "downloaded to", example=("--download-dir", "{tmp}/hub")),
    VllmOption(("--served-model-name",), _IMPLEMENTED, "", example=("--served-model-name", "tiny")),
    VllmOption(("--host",), _IMPLEMENTED, "default `127.0.0.1` for `run`/`serve` (vLLM: all interfaces)",
               example=("--host", "127.0.0.1")),
    VllmOption(("--port",), _IMPLEMENTED, "", example=("--port", "{port}")),
    VllmOption(("--api-key",), _IMPLEMENTED, "or `--api-key-file` / `$MEGATRON_SERVE_API_KEY`, which `ps` does "
               "not show", example=("--api-key", "sk-vllm-test")),
    VllmOption(("--dtype",), _IMPLEMENTED, "`auto`, `float32`/`float`, `bfloat16`, `float16`/`half`",
               example=("--dtype", "auto")),
    VllmOption(("--seed",), _IMPLEMENTED, "", example=("--seed", "0")),
    VllmOption(("--tensor-parallel-size", "-tp"), _IMPLEMENTED, "", ours="--tensor-parallel",
               example=("--tensor-parallel-size", "1")),
    VllmOption(("--data-parallel-size", "-dp"), _IMPLEMENTED, "alone: that many engine groups (replicas, as "
               "`--engines`); with `--enable-expert-parallel`: one group of that many data-parallel attention ranks "
               "sharing the experts (ep = tp x dp), `--engines M` making M such groups; `engine` takes it with "
               "`--data-parallel-rank`", example=("--data-parallel-size", "1")),
    VllmOption(("--max-model-len",), _IMPLEMENTED, "", ours="--max-sequence-length",
               example=("--max-model-len", "256")),
    VllmOption(("--gpu-memory-utilization",), _IMPLEMENTED, "a fraction of the memory left after the weights, "
               "given to the KV cache (vLLM: of the whole GPU)", ours="--kv-cache-memory-fraction",
               example=("--gpu-memory-utilization", "0.5")),
    VllmOption(("--num-gpu-blocks-override",), _IMPLEMENTED, "", ours="--num-kv-blocks",
               example=("--num-gpu-blocks-override", "128")),
    VllmOption(("--block-size",), _IMPLEMENTED, "", example=("--block-size", "16")),
    VllmOption(("--max-num-seqs",), _IMPLEMENTED, "default 256, as in vLLM; the engine's start-up log says how many "
               "full-length requests its KV pool holds", ours="--max-requests", example=("--max-num-seqs", "8")),
    VllmOption(("--max-num-batched-tokens",), _IMPLEMENTED, "chunked prefill is always on", ours="--max-batch-tokens",
               example=("--max-num-batched-tokens", "512")),
    VllmOption(("--long-prefill-token-threshold",), _IMPLEMENTED, "on by default here (a quarter of "
               "--max-num-batched-tokens; vLLM: 0, off): decodes and shorter prompts get their share of a step before "
               "more than N tokens of a long prompt, and the budget they leave goes back to the long prompts",
               example=("--long-prefill-token-threshold", "128")),
    VllmOption(("--max-long-partial-prefills",), _IMPLEMENTED, "long prompts given a chunk before shorter ones in "
               "a step (default 1, as in vLLM)", example=("--max-long-partial-prefills", "2")),
    VllmOption(("--enable-prefix-caching",), _IMPLEMENTED, "on by default; `--no-enable-prefix-caching` turns it "
               "off", ours="--prefix-caching", example=("--enable-prefix-caching",)),
    VllmOption(("--enforce-eager",), _IMPLEMENTED, "", ours="--no-cuda-graphs", example=("--enforce-eager",)),
    VllmOption(("--cuda-graph-sizes",), _IMPLEMENTED, "token counts captured as CUDA graphs: one value N captures 1, 2, "
               "4 and every 8 up to N, several values exactly those; decode steps replay whole, steps that mix "
               "prefill and decode replay piecewise", example=("--cuda-graph-sizes", "16")),
    VllmOption(("--async-scheduling",), _IMPLEMENTED, "on by default here: the next step is scheduled and launched "
               "while the current one runs; `--no-async-scheduling` turns it off", example=("--async-scheduling",)),
    VllmOption(("--chat-template",), _IMPLEMENTED, "a file or the template inline; default: the tokenizer's own",
               example=("--chat-template", "{tmp}/template.jinja")),
    VllmOption(("--generation-config",), _IMPLEMENTED, "`auto` (default): the model's `generation_config.json` "
               "sampling values for fields a request leaves out; `none` (vLLM: `vllm`, also accepted) ignores them; "
               "or a directory", example=("--generation-config", "auto")),
    VllmOption(("--stream-interval",), _IMPLEMENTED, "tokens per streamed chunk; a choice's first token goes at once",
               example=("--stream-interval", "2")),
    VllmOption(("--api-server-count",), _IMPLEMENTED, "HTTP server processes sharing the port, each with its own "
               "coordinator client; /metrics stays fleet-wide", example=("--api-server-count", "2")),
    VllmOption(("--logprobs-mode",), _IMPLEMENTED, "`raw_logprobs` (default), `processed_logprobs`, `raw_logits`, "
               "`processed_logits`: log probs or logits, of the model's logits or of those after logit bias, "
               "penalties, grammar, temperature, min-p, top-k and top-p", example=("--logprobs-mode", "processed_logprobs")),
    VllmOption(("--max-logprobs",), _IMPLEMENTED, "most log probs per token a request may ask for (logprobs, "
               "top_logprobs, prompt_logprobs); at most 20 here", example=("--max-logprobs", "5")),
    # ---- defined here: the OpenAI server
    VllmOption(("--enable-auto-tool-choice",), _IMPLEMENTED, "`tool_choice: auto` reads calls in the "
               "`--tool-call-parser` format, whatever the chat template (without it, `auto` reads the format the "
               "template shows, when it shows one)",
               spec=_spec(action="store_true", help="tool_choice 'auto' reads calls in the --tool-call-parser format, "
                                                    "whatever the chat template"),
               scope=_SERVER, example=("--enable-auto-tool-choice",)),
    VllmOption(("--tool-call-parser",), _IMPLEMENTED, "the format tool calls are read in: " +
               ", ".join(f"`{name}`" for name in TOOL_CALL_PARSERS) + " (`qwen3_xml` is the same format as "
               "`qwen3_coder`)",
               spec=_spec(choices=TOOL_CALL_PARSERS, default=None,
                          help="tool-call format of the model's output (default: the one its chat template shows)"),
               scope=_SERVER, example=("--tool-call-parser", "hermes")),
    VllmOption(("--weight-transfer-config",), _IMPLEMENTED, "a trainer pushes weights over its own process group "
               "through vLLM's weight-transfer routes (`/init_weight_transfer_engine` ...), SGLang's and TRL's: "
               "`{\"backend\": \"nccl\"}`, or `\"gloo\"` for CPU trainers; each update is one REFIT of the fleet "
               "([RL frameworks](rl-frameworks.md))",
               spec=_spec(type=_weight_transfer_config, default=None, metavar="JSON",
                          help="'{\"backend\": \"nccl\"}' (or \"gloo\"): trainers push weights over their own "
                               "process group through the weight routes"),
               scope=_SERVER, example=("--weight-transfer-config", '{{"backend": "gloo"}}')),
    VllmOption(("--uvicorn-log-level",), _IMPLEMENTED, "the HTTP server's own log (uvicorn); `info` and below "
               "include its access log",
               spec=_spec(choices=("critical", "error", "warning", "info", "debug", "trace"), default=None,
                          help="log level of uvicorn (default: --log-level); info and below add its access log"),
               scope=_SERVER, example=("--uvicorn-log-level", "info")),
    VllmOption(("--disable-uvicorn-access-log",), _IMPLEMENTED, "no access log line per HTTP request",
               spec=_spec(action="store_true", help="no uvicorn access log, whatever --uvicorn-log-level"),
               scope=_SERVER, example=("--disable-uvicorn-access-log",)),
    VllmOption(("--disable-log-requests",), _IMPLEMENTED, "vLLM's older spelling: requests are not logged (the "
               "default)",
               spec=_spec(action="store_false", dest="log_requests", default=argparse.SUPPRESS,
                          help="do not log requests (the default; vLLM's older spelling)"),
               scope=_SERVER, example=("--disable-log-requests",)),
    VllmOption(("--enable-log-requests",), _IMPLEMENTED, "one log line when a request arrives (its request_id, "
               "sizes, sampling values and prompt, cut to `--max-log-len`) and one when it ends; off by default, "
               "as in vLLM",
               spec=_spec(action="store_true", dest="log_requests", default=False,
                          help="log each request's arrival (request_id, sizes, sampling values, prompt) and its end"),
               scope=_SERVER, example=("--enable-log-requests",)),
    VllmOption(("--max-log-len",), _IMPLEMENTED, "prompt characters a request log line shows (default: all)",
               spec=_spec(type=int, default=None, metavar="N",
                          help="prompt characters a request log line shows (default: all)"),
               scope=_SERVER, example=("--max-log-len", "80")),
    VllmOption(("--disable-log-stats",), _IMPLEMENTED, "no periodic throughput / queue / KV-cache log line "
               "(logged every 10 s while the fleet is busy)",
               spec=_spec(action="store_true", help="no periodic log line of throughput, queue and KV-cache usage"),
               scope=_SERVER, example=("--disable-log-stats",)),
    VllmOption(("--allowed-origins",), _IMPLEMENTED, "CORS: browser pages from these origins may call the API "
               "(default: none, where vLLM allows all)",
               spec=_spec(type=_json_list, default=None, metavar="JSON",
                          help="CORS: origins whose browser pages may call the API, as a JSON list (default: none)"),
               scope=_SERVER, example=("--allowed-origins", '["https://app.example"]')),
    VllmOption(("--allowed-methods",), _IMPLEMENTED, "CORS: methods allowed (default: all)",
               spec=_spec(type=_json_list, default=None, metavar="JSON",
                          help="CORS: allowed methods, as a JSON list (default: all)"),
               scope=_SERVER, example=("--allowed-methods", '["GET", "POST"]')),
    VllmOption(("--allowed-headers",), _IMPLEMENTED, "CORS: request headers allowed (default: all)",
               spec=_spec(type=_json_list, default=None, metavar="JSON",
                          help="CORS: allowed request headers, as a JSON list (default: all)"),
               scope=_SERVER, example=("--allowed-headers", '["Authorization", "Content-Type"]')),
    VllmOption(("--allow-credentials",), _IMPLEMENTED, "CORS: allow credentials (cookies, authorization headers)",
               spec=_spec(action="store_true", help="CORS: allow credentials"),
               scope=_SERVER, example=("--allow-credentials",)),
    VllmOption(("--disable-fastapi-docs",), _IMPLEMENTED, "no `/docs`, `/redoc` and `/openapi.json`",
               spec=_spec(action="store_true", help="serve no /docs, /redoc or /openapi.json"),
               scope=_SERVER, example=("--disable-fastapi-docs",)),
    VllmOption(("--enable-prompt-tokens-details",), _ACCEPTED, "`usage.prompt_tokens_details.cached_tokens` is "
               "always reported", spec=_spec(action="store_true"), scope=_SERVER,
               example=("--enable-prompt-tokens-details",)),
    VllmOption(("--disable-frontend-multiprocessing",), _ACCEPTED, "the HTTP server is always one process of its "
               "own, apart from the coordinator and the engines", spec=_spec(action="store_true"), scope=_SERVER,
               example=("--disable-frontend-multiprocessing",)),
    VllmOption(("--ssl-keyfile", "--ssl-certfile"), _REFUSED, "TLS is not served here: terminate it at the "
               "ingress, gateway or service mesh in front of the server", scope=_SERVER),
    VllmOption(("--reasoning-parser",), _REFUSED, "reasoning content is not split from the answer; a model's "
               "thinking stays in `content`", scope=_SERVER),
    # ---- defined here: the engines
    VllmOption(("--data-parallel-size-local", "--data-parallel-start-rank", "--data-parallel-address",
                "--data-parallel-rpc-port"), _REFUSED, "a data-parallel group spread over hosts runs one `megatron-serve "
               "engine --data-parallel-size N --data-parallel-rank D --enable-expert-parallel` per attention rank, "
               "which takes these (`--data-parallel-address`/`--data-parallel-rpc-port`: `MASTER_ADDR`/`MASTER_PORT`, "
               "`--data-parallel-start-rank` with `--data-parallel-size-local 1`: its rank); `run` and `serve` start "
               "every rank on this machine", scope=_ENGINE),
    VllmOption(("--quantization", "-q"), _IMPLEMENTED, "the weights' quantization: `fp8` quantizes a float "
               "checkpoint's linear layers at load (a scale per row; activations per token); `auto`/`none` serve the "
               "checkpoint's weights as they are (an FP8 checkpoint as FP8, a GGUF file dequantized at load, which "
               "`gguf` names too); other schemes are refused, naming the scheme",
               spec=_spec(type=_supported("--quantization", QUANTIZATION_SCHEMES, "this build implements no "
                                          "other scheme"),
                          default=None, metavar="|".join(QUANTIZATION_SCHEMES),
                          help="weight quantization (default: the checkpoint's own)"),
               scope=_ENGINE, example=("--quantization", "none")),
    VllmOption(("--kv-cache-dtype",), _IMPLEMENTED, "the KV cache's dtype: `auto` = the model's dtype; `fp8` "
               "(`fp8_e4m3`): e4m3 with a scale per token and head, about twice the tokens; others are refused, "
               "naming the dtype",
               spec=_spec(type=_supported("--kv-cache-dtype", KV_CACHE_DTYPES, "this build keeps the KV cache "
                                          "in no other dtype"),
                          default="auto", metavar="|".join(KV_CACHE_DTYPES), help="KV cache dtype"),
               scope=_ENGINE, example=("--kv-cache-dtype", "auto")),
    VllmOption(("--pipeline-parallel-size", "-pp"), _IMPLEMENTED, "the layers split into P stages (uneven counts "
               "allowed), each with its own KV cache and `--tensor-parallel-size` ranks; dense text models, without "
               "LoRA or speculative decoding (docs/parallelism.md)",
               spec=_spec(type=_positive, default=1, metavar="P", help="pipeline stages of an engine group"),
               scope=_ENGINE, example=("--pipeline-parallel-size", "1")),
    VllmOption(("--enable-expert-parallel",), _IMPLEMENTED, "the tensor-parallel ranks of an engine group hold "
               "whole experts of MoE layers (E / tp each, read alone from the checkpoint) and move tokens to them "
               "by all-to-all; attention and shared experts stay tensor-parallel (docs/parallelism.md)",
               spec=_spec(action=argparse.BooleanOptionalAction, default=False,
                          help="place whole experts on the tensor-parallel ranks and move tokens by all-to-all "
                               "(default: off)"),
               scope=_ENGINE, example=("--enable-expert-parallel",)),
    VllmOption(("--all2all-backend",), _IMPLEMENTED, "how expert-parallel MoE layers move tokens: `auto` = "
               "DeepEP where `deep_ep` imports on a GPU (`deepep_low_latency`), else `alltoall`; `alltoall` = "
               "torch.distributed's all-to-all (fixed-capacity buffers in CUDA graphs); `allgather_reducescatter` "
               "= no token moves (EP over tensor-parallel ranks only); `deepep_high_throughput` = DeepEP's normal "
               "mode, eager; `deepep_low_latency` = DeepEP's low-latency mode for steps up to the largest CUDA graph "
               "(captured), normal mode above (docs/parallelism.md)",
               spec=_spec(type=_supported("--all2all-backend", ALL2ALL_BACKENDS, "this build implements no other "
                                          "expert-parallel all-to-all"),
                          default="auto", metavar="|".join(ALL2ALL_BACKENDS),
                          help="expert-parallel all-to-all: DeepEP where it runs, else alltoall (default: %(default)s)"),
               scope=_ENGINE, example=("--all2all-backend", "alltoall")),
    VllmOption(("--enable-eplb",), _IMPLEMENTED, "expert-parallel load balancing (with "
               "`--enable-expert-parallel`): each MoE layer's tokens per expert are counted over a window of steps, "
               "and every `step_interval` steps the experts are placed again, copies of the busiest ones included, "
               "moved between the ranks while steps run and swapped in between two steps (docs/parallelism.md)",
               spec=_spec(action=argparse.BooleanOptionalAction, default=False,
                          help="balance the experts' load over the expert-parallel ranks (default: off)"),
               scope=_ENGINE, example=("--enable-eplb",)),
    VllmOption(("--eplb-config",), _IMPLEMENTED, "EPLB's settings, vLLM's JSON: `window_size` (steps of load "
               "counted, default 1000), `step_interval` (steps between placements, 3000), `num_redundant_experts` "
               "(copies beyond one of each expert, 0; `(E + it)` must split over the ranks), `log_balancedness` "
               "(log each step's balancedness, false)",
               spec=_spec(type=_json_object, default=None, metavar="JSON",
                          help="EPLB's settings, e.g. '{\"num_redundant_experts\": 4}' (default: vLLM's)"),
               scope=_ENGINE, example=("--eplb-config", '{{"window_size": 100, "step_interval": 100}}')),
    VllmOption(("--trust-remote-code",), _ACCEPTED, "this project never runs model code from a checkpoint: "
               "every architecture it serves is implemented here", spec=_spec(action="store_true"), scope=_ENGINE,
               example=("--trust-remote-code",)),
    VllmOption(("--kv-offloading-size",), _IMPLEMENTED, "GiB of host memory for a second tier of the prefix "
               "cache: blocks evicted from the device pool are copied there, and a prefix found there is copied "
               "back instead of recomputed (docs/kv-tiers.md)",
               spec=_spec(type=_positive_float("--kv-offloading-size"), default=None, metavar="GIB",
                          help="host memory for the KV cache's host tier, in GiB (default: no host tier)"),
               scope=_ENGINE, example=("--kv-offloading-size", "0.01")),
    VllmOption(("--kv-offloading-backend",), _IMPLEMENTED, "where the host tier's evicted blocks go: `native` "
               "(vLLM's default: nowhere, they are dropped) or `disk`, files in `--kv-disk-dir` (at most "
               "`--kv-disk-size` GiB) that every engine of the node reads back, checked before use "
               "(docs/kv-tiers.md); vLLM's `lmcache` is refused",
               spec=_spec(type=_supported("--kv-offloading-backend", KV_OFFLOADING_BACKENDS,
                                          "LMCache is not served; disk is this project's node-shared tier"),
                          default="native", metavar="|".join(KV_OFFLOADING_BACKENDS),
                          help="where blocks evicted from the host tier go (default: %(default)s: dropped)"),
               scope=_ENGINE, example=("--kv-offloading-backend", "native")),
    VllmOption(("--kv-events-config",), _IMPLEMENTED, "vLLM's KV events (`BlockStored`, `BlockRemoved`, "
               "`AllBlocksCleared`, msgpack) on a ZeroMQ PUB socket at `endpoint` with a replay ROUTER at "
               "`replay_endpoint`: which blocks each tier holds (medium `GPU`, `CPU`, `DISK`), for a gateway's "
               "KV-aware routing; the coordinator gets the same events over its own link (docs/kv-routing.md)",
               spec=_spec(type=_kv_events_config, default=None, metavar="JSON",
                          help="KV events, e.g. '{\"enable_kv_cache_events\": true, \"endpoint\": "
                               "\"tcp://*:5557\"}' (default: only the coordinator gets them)"),
               scope=_ENGINE, example=("--kv-events-config", '{{"enable_kv_cache_events": true, "publisher": '
                                                             '"null"}}')),
    VllmOption(("--swap-space",), _ACCEPTED, "preempted requests are recomputed, never swapped to host memory",
               spec=_spec(type=float, metavar="GIB"), scope=_ENGINE, example=("--swap-space", "4")),
    VllmOption(("--disable-custom-all-reduce",), _ACCEPTED, "tensor parallelism uses torch.distributed's own "
               "all-reduce", spec=_spec(action="store_true"), scope=_ENGINE,
               example=("--disable-custom-all-reduce",)),
    VllmOption(("--enable-chunked-prefill",), _ACCEPTED, "chunked prefill is always on (a step mixes decode "
               "tokens with prompt chunks up to --max-num-batched-tokens)",
               spec=_spec(action=argparse.BooleanOptionalAction), scope=_ENGINE, example=("--enable-chunked-prefill",)),
    VllmOption(("--load-format",), _ACCEPTED, "checkpoints are read from safetensors files (`auto` and "
               "`safetensors` are accepted; other formats are refused)",
               spec=_spec(choices=("auto", "safetensors")), scope=_ENGINE, example=("--load-format", "auto")),
    VllmOption(("--tokenizer-mode",), _ACCEPTED, "the Hugging Face tokenizer is always used (`auto` and `hf` "
               "are accepted)", spec=_spec(choices=("auto", "hf")), scope=_ENGINE,
               example=("--tokenizer-mode", "auto")),
    VllmOption(("--distributed-executor-backend",), _ACCEPTED, "engines are always processes (`mp`); "
               "`megatron-serve engine` runs them on other machines",
               spec=_spec(choices=("mp", "uni", "ray", "external_launcher")), scope=_ENGINE,
               example=("--distributed-executor-backend", "mp")),
    VllmOption(("--max-parallel-loading-workers",), _ACCEPTED, "each rank reads only its own slice of the "
               "safetensors files", spec=_spec(type=int, metavar="N"), scope=_ENGINE,
               example=("--max-parallel-loading-workers", "2")),
    VllmOption(("--enable-sleep-mode",), _ACCEPTED, "suspend and resume (releasing and restoring GPU memory) are "
               "always available: `megatron-serve control suspend`", spec=_spec(action="store_true"),
               scope=_ENGINE, example=("--enable-sleep-mode",)),
    VllmOption(("--scheduling-policy",), _IMPLEMENTED, "admission is ordered by a request's `priority` (lower "
               "first), then arrival, under either policy (requests that send none are first come, first served); "
               "`priority` also preempts: a waiting request of a lower value takes the request slot or KV blocks of "
               "the running one of the highest value (the newest of those), which resumes with its tokens intact, as "
               "a tenant's better class does (docs/tenants.md)",
               spec=_spec(choices=("fcfs", "priority"), default="fcfs",
                          help="fcfs, or priority: a request of a lower `priority` value preempts one of a higher "
                               "(default: %(default)s)"),
               scope=_ENGINE, example=("--scheduling-policy", "priority")),
    VllmOption(("--guided-decoding-backend",), _ACCEPTED, "every output constraint is decoded with llguidance, "
               "reading JSON schemas as vLLM's default backend does: an object schema without `additionalProperties` "
               "admits no other key",
               spec=_spec(metavar="NAME"), scope=_ENGINE, example=("--guided-decoding-backend", "xgrammar")),
    VllmOption(("--enable-lora",), _IMPLEMENTED, "serve LoRA adapters (PEFT checkpoints of the attention and "
               "MLP projections) beside the base model; the request's `model` picks one (docs/lora.md)",
               spec=_spec(action=argparse.BooleanOptionalAction, default=False,
                          help="serve LoRA adapters (default: off)"), scope=_ENGINE,
               example=("--enable-lora",)),
    VllmOption(("--lora-modules",), _IMPLEMENTED, "adapters served from the start: `name=path` or vLLM's JSON "
               "form; listed in `/v1/models` with the base model as `parent`",
               spec=_spec(type=_lora_module, nargs="+", default=None, metavar="NAME=PATH",
                          help="LoRA adapters served from the start (default: none)"), scope=_ENGINE,
               example=("--lora-modules", "tiny-lora={tmp}/adapter")),
    VllmOption(("--max-loras",), _IMPLEMENTED, "adapter slots on the device: the most adapters one step mixes",
               spec=_spec(type=_positive, default=1, metavar="N", help="adapter slots on the device (default: %(default)s)"),
               scope=_ENGINE, example=("--max-loras", "2")),
    VllmOption(("--max-lora-rank",), _IMPLEMENTED, "the largest adapter rank served (smaller ranks are "
               "zero-padded to it); a larger adapter is refused, naming its rank",
               spec=_spec(type=_positive, default=16, metavar="R", help="largest adapter rank (default: %(default)s)"),
               scope=_ENGINE, example=("--max-lora-rank", "8")),
    VllmOption(("--max-cpu-loras",), _IMPLEMENTED, "adapters an engine keeps in host memory, read and checked "
               "(default: --max-loras, or as many as --lora-modules names); one more evicts the least recently used, "
               "whose name stays served: a request naming it reads it again from its directory, as vLLM's LRU",
               spec=_spec(type=_positive, default=None, metavar="N",
                          help="adapters kept in host memory; beyond it the least recently used is evicted and read "
                               "again when a request names it (default: --max-loras, or the --lora-modules count)"),
               scope=_ENGINE,
               example=("--max-cpu-loras", "4")),
    VllmOption(("--speculative-config",), _IMPLEMENTED, "speculative decoding, vLLM's JSON: `method` `ngram` "
               "(`prompt_lookup_min`/`max`), `draft_model` (`model`), `mtp` (the checkpoint's own MTP layer) "
               "or `eagle3` (`model`: an EAGLE-3 head), "
               "`num_speculative_tokens` (the most; `adaptive`, default true, picks 0..that per request and step from "
               "measured acceptance and cost, false pins it); output identical to no speculation "
               "(docs/speculative.md)",
               spec=_spec(type=_json_object, default=None, metavar="JSON",
                          help="speculative decoding, e.g. '{\"method\": \"ngram\", \"num_speculative_tokens\": 3}' "
                               "(default: off)"), scope=_ENGINE,
               example=("--speculative-config", '{{"method": "ngram", "num_speculative_tokens": 3}}')),
)

class _Refuse(argparse.Action):
    """A vLLM option that is not served here: the command stops with its usage and the reason."""

    def __init__(self, option_strings: list[str], dest: str, reason: str, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs="*", default=argparse.SUPPRESS,
                         help=f"refused: {reason}", **kwargs)
        self.reason = reason

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        parser.error(f"{option_string}: {self.reason}")


def add_vllm_options(parser: argparse.ArgumentParser, scope: Scope) -> None:
    """Add the rows of ``scope`` that this table defines (implemented, accepted, refused) to ``parser``."""
    group = parser.add_argument_group(f"vLLM options ({scope.value})", "accepted under vLLM's names; see "
                                      "docs/vllm-mapping.md")
    for row in VLLM_OPTIONS:
        if row.scope is not scope:
            continue
        if row.status is Status.REFUSED:
            for flag in row.flags:
                try:
                    group.add_argument(flag, action=_Refuse, reason=row.reason, metavar="...")
                except argparse.ArgumentError:  # the command serves it (engine's multi-host data-parallel flags)
                    pass
            continue
        kwargs = dict(row.spec or {})
        if row.status is Status.ACCEPTED:
            kwargs.setdefault("default", argparse.SUPPRESS)  # present only when given: accepted_warnings reads that
            kwargs["help"] = f"accepted; changes nothing here: {row.reason}"
        group.add_argument(*row.flags, **kwargs)


def accepted_warnings(args: argparse.Namespace) -> list[str]:
    """One line per accepted-unchanged option given on the command line, saying why it changes nothing."""
    return [f"{row.name} is accepted for vLLM compatibility and changes nothing: {row.reason}"
            for row in VLLM_OPTIONS if row.status is Status.ACCEPTED and hasattr(args, row.dest)]
