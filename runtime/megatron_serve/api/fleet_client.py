"""The coordinator engine client: requests run on a fleet, found at an address or started here.

:class:`FleetClient` is the coordinator implementation of
:class:`~megatron_serve.client.engine_client.EngineClient` (the other runs an engine in this process): an
:class:`~megatron_serve.client.coordinator_client.InferenceClient` that, given no address, first starts its own
:class:`~megatron_serve.fleet.local_fleet.LocalFleet` (a coordinator and ``num_engines`` engine processes)
and waits for its engines. Closing it stops a fleet it started (STOP, then the processes) and only
disconnects from one it did not: sending STOP to someone else's fleet is :meth:`stop`'s job.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import time
from typing import TYPE_CHECKING, Any, Iterable

from ..client.coordinator_client import InferenceClient
from ..config import InferenceConfig
from ..fleet.local_fleet import LocalFleet
from ..wire.security import TokenFrom

if TYPE_CHECKING:
    import torch

    from ..tokenizer import Tokenizer

logger = logging.getLogger("megatron_serve.async_llm")


class FleetClient(InferenceClient):
    """An ``InferenceClient`` that may own its fleet (see the module docstring)."""

    def __init__(self, address: str | None, *, model: str | os.PathLike | None = None, num_engines: int = 1,
                 inference_config: InferenceConfig | None = None, token: str | None = None,
                 tokenizer_dir: str | os.PathLike | None = None, tokenizer: "Tokenizer | None" = None,
                 max_request_logprobs: int | None = None) -> None:
        """``address=None`` starts a fleet of ``num_engines`` engines for the model directory ``model``
        (with the tokenizer files of ``tokenizer_dir``, when given; its coordinator's ``--max-request-logprobs``
        is ``max_request_logprobs``, when given). The results' text is made here,
        with ``tokenizer``, else the files of ``tokenizer_dir``, else those of the model directory."""
        if address is None and not isinstance(model, (str, os.PathLike)):
            raise ValueError("coordinator mode without coordinator_address starts engine processes, "
                             "so model must be a model directory")
        if num_engines < 1:
            raise ValueError(f"num_engines must be >= 1, got {num_engines}")
        text_tokenizer = tokenizer or tokenizer_dir or (model if isinstance(model, (str, os.PathLike)) else None)
        # A fleet started here gets a secret of its own, unless one is given.
        # inference_config.data_parallel_size: each group is that many attention ranks, an engine process each
        ranks = inference_config.data_parallel_size if inference_config is not None else 1
        group_config = dataclasses.replace(inference_config, data_parallel_size=1) if ranks > 1 else inference_config
        fleet = None if address is not None else LocalFleet(str(model), num_engines, group_config,
                                                            token=token, tokenizer_dir=tokenizer_dir,
                                                            max_request_logprobs=max_request_logprobs,
                                                            data_parallel_size=ranks)
        # Another's fleet without token=: $MEGATRON_SERVE_TOKEN, as InferenceClient and the commands read it.
        secret = fleet.token if fleet is not None else TokenFrom.ENVIRONMENT if token is None else token
        super().__init__(address or "", token=secret, tokenizer=text_tokenizer)
        self.fleet = fleet
        self._stopped = False

    async def start(self, timeout: float = 600.0) -> "FleetClient":
        """Connect (first starting the fleet and, then, waiting for its engines when it is ours)."""
        deadline = time.monotonic() + timeout
        try:
            if self.fleet is not None and not self.address:
                self.address = await asyncio.to_thread(self.fleet.start, timeout)
            await super().start(timeout=max(1.0, deadline - time.monotonic()))
            if self.fleet is not None:
                await self._wait_for_own_engines(self.fleet, deadline)
        except BaseException:
            await self._stop_own_fleet(send_stop=False)
            raise
        return self

    async def _wait_for_own_engines(self, fleet: LocalFleet, deadline: float) -> None:
        logger.info("waiting for %d engine(s) to load the model ...", fleet.num_engines)
        while True:
            fleet.check_alive()
            status = await self.status()
            if len(status["engines"]) >= fleet.num_engines:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"{len(status['engines'])} of {fleet.num_engines} engine(s) registered in time "
                                   f"(logs: {fleet.log_dir})")
            await asyncio.sleep(0.2)

    async def _stop_own_fleet(self, send_stop: bool) -> None:
        fleet, self.fleet = self.fleet, None
        if fleet is None:
            return
        stopped = False
        if send_stop and self._connection.registered and not self._link.closed:
            try:
                await self.stop(timeout=120.0)
                stopped = True
            except Exception as exc:  # engines are signalled below anyway
                logger.warning("STOP was not acknowledged (%s): signalling the processes", exc)
        self.close()
        await asyncio.to_thread(fleet.stop, 60.0, stopped)

    async def aclose(self) -> None:
        """Stop the fleet this client started (STOP, then its processes), or disconnect from a remote one."""
        await self._stop_own_fleet(send_stop=True)
        await super().aclose()

    async def refit_tensors(self, named_tensors: Iterable[tuple[str, "torch.Tensor"]],
                            epoch: int | None = None) -> dict[str, Any]:
        """REFIT with tensors from this process, sent over a collective (see ``WeightSender``).

        To a fleet this client started, over gloo: its engines share this machine's GPUs with this
        process, and NCCL refuses two ranks on one GPU ("Duplicate GPU detected", seen on a one-GPU
        H100). To a remote fleet, ``WeightSender``'s default (NCCL where this process has a GPU).
        """
        from ..client.weight_sender import WeightSender  # noqa: PLC0415 - torch only when tensors are sent

        backend = "gloo" if self.fleet is not None else None
        return await WeightSender(self, backend=backend).send(named_tensors, epoch=epoch)

    async def shutdown(self) -> None:
        """The Python API's ``shutdown()`` (docs/python-api.md): what :meth:`aclose` does."""
        await self.aclose()
