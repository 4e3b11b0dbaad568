"""The Ray actor verl calls for one replica's server: ``generate(prompt_ids, sampling_params, request_id, ...)``, which
verl's agent loop calls, and the control calls its replica and checkpoint manager make (sleep, wake_up,
abort_all_requests, resume_generation, clear_kv_cache), each one HTTP call on a megatron-serve server.

The actor starts that server (``megatron-serve run`` of the model, with an admin key of its own and the ``gloo``
weight transfer, tied to the actor by a lifeline: it ends when the actor's process does) or attaches to one that
runs already (``engine_kwargs.megatron_serve.url``). verl's vLLM server holds the engine in its actor; here the
engine stays the server's, so the actor is thin and the fleet keeps its own lifecycle (pause modes, suspend
levels, the REFIT transaction).
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Optional

import httpx
from verl.workers.rollout.replica import RolloutMode, TokenOutput

from ...processes.lifeline import Lifeline
from ...fleet.local_fleet import free_port
from ...server.admin import ADMIN_KEY_ENV
from ...server.rl.sampling_bodies import vllm_names
from .admin_http import admin_client, post

#: verl's rollout config fields that are sampling parameters of the same (vLLM's) name: a request that leaves one out
#: takes the config's, as verl's vLLM server does.
CONFIG_DEFAULTS = ("repetition_penalty", "ignore_eos")

#: verl's ``stop_reason`` for each finish reason of ``/inference/v1/generate`` (vLLM's mapping).
STOP_REASONS = {"stop": "completed", "length": "completed", "abort": "aborted"}


@dataclass(frozen=True)
class ServerSettings:
    """``rollout.engine_kwargs.megatron_serve``: ``url`` and ``admin_key`` of a running server to attach to (it must
    run with a ``--weight-transfer-config`` for weight updates), else ``args``, more options for the ``megatron-serve
    run`` the actor starts, and ``startup_timeout`` (seconds) for it to answer ``/ready``."""

    url: Optional[str] = None
    admin_key: Optional[str] = None
    args: tuple[str, ...] = ()
    startup_timeout: float = 300.0

    @classmethod
    def from_engine_kwargs(cls, engine_kwargs: Mapping[str, Any]) -> "ServerSettings":
        given = dict(engine_kwargs.get("megatron_serve") or {})
        unknown = sorted(set(given) - {"url", "admin_key", "args", "startup_timeout"})
        if unknown:
            raise ValueError(f"engine_kwargs.megatron_serve.{unknown[0]}: not a setting of the megatron-serve "
                             "rollout (url, admin_key, args, startup_timeout)")
        if given.get("url") and not given.get("admin_key"):
            raise ValueError("engine_kwargs.megatron_serve.url needs admin_key: the control and weight routes "
                             "need the server's admin key")
        return cls(url=given.get("url"), admin_key=given.get("admin_key"), args=tuple(given.get("args") or ()),
                   startup_timeout=float(given.get("startup_timeout", 300.0)))


class MegatronServeServer:
    """One replica's server, as a Ray actor (:class:`~.replica.MegatronServeReplica` makes it remote)."""

    def __init__(self, config: Any, model_config: Any, rollout_mode: RolloutMode, replica_rank: int) -> None:
        self.config = config
        self.model_path = model_config.local_path or model_config.path
        self.rollout_mode = rollout_mode
        self.replica_rank = replica_rank
        self.settings = ServerSettings.from_engine_kwargs(config.engine_kwargs)
        self.url = self.settings.url
        self.admin_key = self.settings.admin_key or secrets.token_hex(16)
        self.process: Optional[subprocess.Popen] = None
        self.lifeline: Optional[Lifeline] = None
        self.log: Optional[Path] = None
        self.http: Optional[httpx.AsyncClient] = None

    def _command(self, port: int, log_dir: Path) -> list[str]:
        """``megatron-serve run`` of the model: the replica's tensor- and data-parallel sizes, verl's context length
        (prompt + response, or ``max_model_len``) and the gloo weight transfer; its logs in ``log_dir``."""
        max_len = self.config.max_model_len or self.config.prompt_length + self.config.response_length
        return [str(Path(sys.executable).with_name("megatron-serve")), "run", "--model", str(self.model_path),
                "--port", str(port), "--coordinator-port", "0", "--engines", str(self.config.data_parallel_size),
                "--tensor-parallel", str(self.config.tensor_model_parallel_size), "--max-model-len", str(max_len),
                "--log-dir", str(log_dir), "--weight-transfer-config", json.dumps({"backend": "gloo"}),
                *self.settings.args]

    async def launch_server(self) -> None:
        """Start the server (unless attached to one) and wait until it answers ``/ready``. The admin key reaches it
        in its environment (nothing on disk or in ``ps``); its output and logs stay in a temporary directory."""
        if self.url is None:
            logs = Path(tempfile.mkdtemp(prefix=f"megatron-serve-verl-{self.replica_rank}-"))
            port = free_port("127.0.0.1")
            self.url = f"http://127.0.0.1:{port}"
            self.lifeline = Lifeline()
            self.log = logs / "run.out"
            with open(self.log, "wb") as out:
                self.process = subprocess.Popen(
                    self._command(port, logs), stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                    env={**os.environ, ADMIN_KEY_ENV: self.admin_key, **self.lifeline.env()},
                    pass_fds=self.lifeline.pass_fds())
        self.http = admin_client(self.url, self.admin_key)
        await self._wait_ready()

    async def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.settings.startup_timeout
        while True:
            if self.process is not None and self.process.poll() is not None:
                raise RuntimeError(f"megatron-serve run exited with {self.process.returncode}:\n"
                                   f"{self.log.read_text()[-4000:]}")
            try:
                if (await self.http.get("/ready", timeout=2)).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"megatron-serve at {self.url} not ready in {self.settings.startup_timeout} s")
            await asyncio.sleep(0.2)

    def get_server_address(self) -> tuple[str, int]:
        """The host and port of the server's OpenAI routes (verl's chat completion clients use them)."""
        parsed = httpx.URL(self.url)
        return parsed.host, parsed.port

    def get_admin(self) -> tuple[str, str]:
        """The server's URL and admin key, for the weight updates of :class:`~.adapter.ServerAdapter`."""
        return self.url, self.admin_key

    async def _post(self, path: str, **kwargs: Any) -> Any:
        return await post(self.http, path, **kwargs)

    def _sampling(self, prompt_len: int, given: Mapping[str, Any]) -> dict[str, Any]:
        """verl's sampling parameters as ``/inference/v1/generate`` takes them (SGLang's names turned into vLLM's, by
        the sampling table), with vLLM's server's defaults: ``max_tokens`` else the response length that fits,
        ``logprobs`` a flag, and :data:`CONFIG_DEFAULTS` from the rollout config."""
        params = vllm_names(dict(given))
        limit = params.pop("max_tokens", None)
        room = self.config.prompt_length + self.config.response_length - prompt_len
        if limit is None:
            limit = min(self.config.response_length, room)
        params["max_tokens"] = max(1, limit)
        params["logprobs"] = 0 if params.pop("logprobs", False) else None
        for name in CONFIG_DEFAULTS:
            params.setdefault(name, getattr(self.config, name))
        return {name: value for name, value in params.items() if value is not None}

    async def generate(self, prompt_ids: list[int], sampling_params: dict[str, Any], request_id: str,
                       image_data: Optional[list[Any]] = None, video_data: Optional[list[Any]] = None,
                       audio_data: Optional[list[Any]] = None, mm_processor_kwargs: Optional[dict] = None,
                       priority: int = 0) -> TokenOutput:
        """Tokens in, tokens out: one ``/inference/v1/generate`` call. Images, video and audio are refused (the
        tokens-in route takes ids only)."""
        if image_data or video_data or audio_data or mm_processor_kwargs:
            raise NotImplementedError("the megatron-serve rollout takes token ids only (no image, video or audio)")
        body = {"token_ids": list(map(int, prompt_ids)), "request_id": request_id, "priority": priority,
                "sampling_params": self._sampling(len(prompt_ids), sampling_params)}
        choice = (await self._post("/inference/v1/generate", json=body))["choices"][0]
        log_probs = [entry["logprob"] for entry in choice["logprobs"]["content"]] if choice["logprobs"] else None
        return TokenOutput(token_ids=choice["token_ids"], log_probs=log_probs,
                           stop_reason=STOP_REASONS.get(choice["finish_reason"], choice["finish_reason"]),
                           extra_fields={"weight_version": choice["weight_version"]})

    async def wake_up(self) -> None:
        """vLLM's wake-up: the weights and KV cache back, serving again (a standalone server never slept)."""
        if self.rollout_mode != RolloutMode.STANDALONE and self.config.free_cache_engine:
            await self._post("/wake_up")

    async def sleep(self) -> None:
        """vLLM's level-1 sleep for a server that shares its devices with the trainer: pause, then suspend
        (weights to host memory, the KV cache dropped)."""
        if self.rollout_mode != RolloutMode.STANDALONE and self.config.free_cache_engine:
            await self._post("/sleep", params={"level": 1, "mode": "abort"})

    async def abort_all_requests(self, reset_prefix_cache: bool = True, reject_request: bool = False) -> None:
        """Pause in ``abort`` mode: every unfinished request answers ``abort`` with its tokens so far (verl resubmits
        the rest), and new ones wait for :meth:`resume_generation`. ``reject_request`` is not honoured (the fleet
        queues them); ``reset_prefix_cache`` needs nothing (a weight update forgets every KV tier itself)."""
        await self._post("/pause", params={"mode": "abort"})

    async def abort_request(self, request_id: str) -> dict:
        """One request ends with ``abort`` and its tokens so far (found by the ``request_id`` verl gave it)."""
        answer = await self._post("/abort_requests", json={"request_ids": [request_id]})
        return {"aborted": answer["aborted"] > 0, "request_id": request_id}

    async def resume_generation(self) -> None:
        await self._post("/resume")

    async def clear_kv_cache(self) -> None:
        await self._post("/reset_prefix_cache")

    async def release_kv_cache(self) -> None:
        """Nothing to free: the weights reach the engines through host memory, and the REFIT forgets every KV tier
        itself."""

    async def resume_kv_cache(self) -> None:
        """See :meth:`release_kv_cache`."""

    async def start_profile(self, **kwargs: Any) -> None:
        """verl's profiler hooks: not served (megatron-serve's profiling is its own)."""

    async def stop_profile(self) -> None:
        """See :meth:`start_profile`."""

