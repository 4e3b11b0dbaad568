"""Options shared by the commands that build engines (``run``, ``engine``; DESIGN section 7).

One place maps flags to :class:`~megatron_serve.config.InferenceConfig` fields and back, so that
``megatron-serve run``, ``megatron-serve engine`` and the Python API that spawns engine processes
agree on every name and default. Also: the shared token (``--token-file`` or
``MEGATRON_SERVE_TOKEN``) and logging setup.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Any

from ..config import InferenceConfig, dtype_name

TOKEN_ENV = "MEGATRON_SERVE_TOKEN"

# flag dest -> InferenceConfig field
_ENGINE_FIELDS = {
    "dtype": "dtype",
    "block_size": "block_size_tokens",
    "num_kv_blocks": "num_kv_blocks",
    "kv_cache_memory_fraction": "kv_cache_memory_fraction",
    "max_batch_tokens": "max_batch_tokens",
    "max_requests": "max_requests",
    "max_sequence_length": "max_sequence_length",
    "prefix_caching": "enable_prefix_caching",
    "device": "device",
    "seed": "seed",
}


def add_engine_options(parser: argparse.ArgumentParser) -> None:
    """Add the engine sizing options; every one defaults to ``InferenceConfig``'s own default."""
    group = parser.add_argument_group("engine options")
    group.add_argument("--dtype", choices=["float32", "bfloat16", "float16"],
                       help="weights and KV cache dtype (default: float32 on CPU, the checkpoint's on GPU)")
    group.add_argument("--block-size", type=int, metavar="TOKENS", help="KV cache block size in tokens")
    group.add_argument("--num-kv-blocks", type=int, metavar="N", help="size of the KV pool in blocks")
    group.add_argument("--kv-cache-memory-fraction", type=float, metavar="F",
                       help="size the KV pool from this fraction of device memory (when --num-kv-blocks is unset)")
    group.add_argument("--max-batch-tokens", type=int, metavar="N", help="token budget of one step")
    group.add_argument("--max-requests", type=int, metavar="N", help="requests running at once per engine")
    group.add_argument("--max-sequence-length", type=int, metavar="N", help="prompt + generation limit")
    group.add_argument("--prefix-caching", action=argparse.BooleanOptionalAction, default=None,
                       help="share KV blocks of common prompt prefixes")
    group.add_argument("--device", help="cpu, cuda, cuda:1 ... (default: cuda when available)")
    group.add_argument("--seed", type=int, help="sampling seed of the engine")


def inference_config_from_args(args: argparse.Namespace) -> InferenceConfig:
    """Build the config from the flags that were given (``ValueError`` names a bad value)."""
    kwargs: dict[str, Any] = {}
    for dest, name in _ENGINE_FIELDS.items():
        value = getattr(args, dest, None)
        if value is not None:
            kwargs[name] = value
    return InferenceConfig(**kwargs)


def inference_config_to_argv(config: InferenceConfig) -> list[str]:
    """The flags that rebuild ``config`` in another process (inverse of :func:`inference_config_from_args`)."""
    argv: list[str] = []
    for dest, name in _ENGINE_FIELDS.items():
        value = getattr(config, name)
        if value is None:
            continue
        flag = "--" + dest.replace("_", "-")
        if isinstance(value, bool):
            argv.append(flag if value else "--no-" + dest.replace("_", "-"))
        elif name == "dtype" and not isinstance(value, str):
            argv += [flag, dtype_name(value)]
        else:
            argv += [flag, str(value)]
    return argv


def add_token_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--token-file", metavar="PATH",
                        help=f"file holding the shared coordinator token (else ${TOKEN_ENV}; none = no token)")


def read_token(args: argparse.Namespace) -> str | None:
    """The shared token from ``--token-file``, else ``$MEGATRON_SERVE_TOKEN``, else ``None``."""
    path = getattr(args, "token_file", None)
    if path:
        try:
            with open(path) as fh:
                token = fh.read().strip()
        except OSError as exc:
            raise FileNotFoundError(f"cannot read --token-file {path}: {exc.strerror}") from None
        if not token:
            raise ValueError(f"--token-file {path} is empty")
        return token
    return os.environ.get(TOKEN_ENV) or None


def add_log_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])


def setup_logging(level: str = "INFO") -> None:
    logging.basicConfig(level=getattr(logging, level), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
