"""LoRA adapter versions in a policy refit: tensors named ``adapter/{adapter name}/{PEFT name}`` (issue 50, RL).

A trainer that trains LoRA adapters beside the policy sends them in the same REFIT as the policy
(``WeightSender.send(..., adapters=...)``): the rendezvous lists each adapter's config
(:class:`~megatron_serve.wire.rendezvous.LoraPush`, in ``Rendezvous.adapters``) and the manifest carries its tensors
under this prefix. Adapter names never hold a ``/`` (:mod:`..wire.lora_names`) and checkpoint names never start
with ``adapter/``, so the name splits back unambiguously and cannot shadow a policy weight. Every engine checks
each adapter with the policy in the verify step, receives its tensors whole on each group's rank 0 (which keeps a
group's adapters, :mod:`megatron_serve.engine.lora.adapters`), and registers the new versions only once the policy's
transfer committed: all of them with the policy, under its epoch, or none.
"""

from __future__ import annotations

from typing import Iterable, TypeVar

ADAPTER_PREFIX = "adapter/"

T = TypeVar("T")


def adapter_tensor(adapter: str, peft_name: str) -> str:
    """The manifest name of one of ``adapter``'s tensors."""
    return f"{ADAPTER_PREFIX}{adapter}/{peft_name}"


def is_adapter(name: str) -> bool:
    return name.startswith(ADAPTER_PREFIX)


def split_name(name: str) -> tuple[str, str]:
    """``(adapter name, PEFT name)`` of a manifest name under :data:`ADAPTER_PREFIX`."""
    adapter, _, peft_name = name[len(ADAPTER_PREFIX):].partition("/")
    return adapter, peft_name


def adapter_shapes(shapes: Iterable[tuple[str, tuple[int, ...]]]) -> dict[str, list[tuple[str, tuple[int, ...]]]]:
    """Each adapter's ``(PEFT name, shape)`` pairs among a refit's ``(name, shape)`` pairs."""
    out: dict[str, list[tuple[str, tuple[int, ...]]]] = {}
    for name, shape in shapes:
        if is_adapter(name):
            adapter, peft_name = split_name(name)
            out.setdefault(adapter, []).append((peft_name, tuple(shape)))
    return out


def adapters_first(named: Iterable[tuple[str, T]]) -> list[tuple[str, T]]:
    """The pairs with the adapters' ahead of the policy's, so that an engine has every adapter in hand (and built)
    before the first policy tensor reaches a live weight."""
    pairs = list(named)
    return [pair for pair in pairs if is_adapter(pair[0])] + [pair for pair in pairs if not is_adapter(pair[0])]
