"""Options shared by the fleet commands (``coordinator``, ``engine``, ``control``, ``run``).

* the shared token: ``--token-file`` or ``$MEGATRON_SERVE_TOKEN`` (DESIGN section 7);
* :func:`inference_config_to_argv`, the inverse of
  :func:`~megatron_serve.commands.engine_options.inference_config_from_args` (the engine option
  group lives in :mod:`~megatron_serve.commands.engine_options`), so that processes started from
  Python (``LocalFleet``) get exactly the caller's ``InferenceConfig``;
* one logging format for every long-running process.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # importing config imports torch: not for `control` and the coordinator
    from ..config import InferenceConfig

TOKEN_ENV = "MEGATRON_SERVE_TOKEN"

# engine_options flag dest -> InferenceConfig field
_ENGINE_FIELDS = {
    "dtype": "dtype",
    "block_size": "block_size_tokens",
    "num_kv_blocks": "num_kv_blocks",
    "kv_cache_memory_fraction": "kv_cache_memory_fraction",
    "max_batch_tokens": "max_batch_tokens",
    "max_requests": "max_requests",
    "max_sequence_length": "max_sequence_length",
    "prefix_caching": "enable_prefix_caching",
    "cuda_graphs": "enable_cuda_graphs",
    "device": "device",
    "seed": "seed",
}


def inference_config_to_argv(config: "InferenceConfig") -> list[str]:
    """The ``engine_options`` flags that rebuild ``config`` in another process."""
    argv: list[str] = []
    for dest, name in _ENGINE_FIELDS.items():
        value = getattr(config, name)
        if value is None:
            continue
        flag = "--" + dest.replace("_", "-")
        if isinstance(value, bool):
            argv.append(flag if value else "--no-" + dest.replace("_", "-"))
        elif name == "dtype" and not isinstance(value, str):
            argv += [flag, str(value).removeprefix("torch.")]  # torch.bfloat16 -> bfloat16
        else:
            argv += [flag, str(value)]
    return argv


def add_token_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--token-file", metavar="PATH",
                        help=f"file holding the shared coordinator token (else ${TOKEN_ENV}; none = no token)")


def read_secret(args: argparse.Namespace, attribute: str, flag: str, env: str) -> str | None:
    """A secret from the file named by ``flag`` (attribute ``attribute``), else ``$env``, else ``None``."""
    path = getattr(args, attribute, None)
    if path:
        try:
            with open(path) as fh:
                secret = fh.read().strip()
        except OSError as exc:
            raise FileNotFoundError(f"cannot read {flag} {path}: {exc.strerror}") from None
        if not secret:
            raise ValueError(f"{flag} {path} is empty")
        return secret
    return os.environ.get(env) or None


def read_token(args: argparse.Namespace) -> str | None:
    """The shared token from ``--token-file``, else ``$MEGATRON_SERVE_TOKEN``, else ``None``."""
    return read_secret(args, "token_file", "--token-file", TOKEN_ENV)


def add_log_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])


def setup_logging(level: str = "INFO") -> None:
    logging.basicConfig(level=getattr(logging, level), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
