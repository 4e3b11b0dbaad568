"""vLLM's option names, accepted beside ours: one table, read by every command that has the option.

A vLLM user types ``--max-model-len 4096 --tensor-parallel-size 2``; they mean exactly our
``--max-sequence-length 4096 --tensor-parallel 2``. Each alias is registered on the same argparse
action as our name (so both set the same attribute, and ``--help`` lists them together), by
:func:`add_option`, which every command uses for these options. ``tests/commands/test_cli.py``
checks, command by command, that every command with one of our names also takes its alias and
that both parse to the same setting.

``--api-key KEY`` is not in the table: it is vLLM's option, ours takes a file
(``--api-key-file``), and both exist side by side (``commands.server``). Every other vLLM option,
implemented, accepted or refused, is listed in :mod:`megatron_serve.client.vllm_options`.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Alias:
    """``vllm`` sets our option ``ours``; ``negates``: it sets ``--no-<ours>`` (a boolean option's off side)."""

    vllm: str
    ours: str
    negates: bool = False


VLLM_ALIASES: tuple[Alias, ...] = (
    Alias("--max-model-len", "--max-sequence-length"),
    Alias("--tensor-parallel-size", "--tensor-parallel"),
    Alias("-tp", "--tensor-parallel"),
    # vLLM's fraction covers weights, activations and KV cache; ours sizes the KV pool from the memory
    # that is free once the weights are loaded. The same intent ("how much of the GPU to take").
    Alias("--gpu-memory-utilization", "--kv-cache-memory-fraction"),
    Alias("--max-num-seqs", "--max-requests"),
    Alias("--num-gpu-blocks-override", "--num-kv-blocks"),
    Alias("--max-num-batched-tokens", "--max-batch-tokens"),
    Alias("--enforce-eager", "--cuda-graphs", negates=True),
    Alias("--enable-prefix-caching", "--prefix-caching"),  # also gives --no-enable-prefix-caching
    # vLLM >= 0.18: how long SIGTERM lets in-flight requests finish. vLLM's default is 0 (abort them at once);
    # ours stays 30 s, and what runs past it is handed back and continued elsewhere, not aborted.
    Alias("--shutdown-timeout", "--drain-timeout"),
)


def add_option(container: Any, name: str, *more: str, **kwargs: Any) -> argparse.Action:
    """``container.add_argument(name, *more, **kwargs)`` plus the vLLM names of ``name`` from the table.

    ``container`` is a parser or an argument group.
    """
    aliases = [a for a in VLLM_ALIASES if a.ours == name]
    action = container.add_argument(name, *more, *(a.vllm for a in aliases if not a.negates), **kwargs)
    for alias in aliases:
        if alias.negates:
            container.add_argument(alias.vllm, dest=action.dest, action="store_false", default=argparse.SUPPRESS,
                                   help=f"vLLM's name for --no-{name.removeprefix('--')}")
    return action
