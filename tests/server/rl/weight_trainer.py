"""A trainer process for the weight-route tests: one framework's weight-update calls and its broadcast, over gloo.

``python weight_trainer.py PROTOCOL URL MODEL_DIR GROUP_PORT [options]`` (the admin key in ``$ADMIN_KEY``) pushes
MODEL_DIR's tensors into the server at URL as the framework does, and prints one JSON line per HTTP answer
(``{"call", "status", "body"}``). The calls replay each framework's own client, named per protocol below; only the
collective is gloo (:mod:`megatron_serve.client.trainer_group`) where the framework's is NCCL.

Options: ``--version N`` (the weight version to name), ``--corrupt name|shape|dtype`` (the last tensor announced
under a name the model lacks, with a wrong shape, or with a dtype that cannot travel), ``--unpacked`` (vLLM: one
broadcast per tensor), ``--no-start`` (vLLM before 0.19: ``/update_weights`` alone), ``--skyrl`` (SkyRL HEAD's sync: its
worker methods through ``/collective_rpc``, see :func:`skyrl`), ``--backend nccl`` (vLLM:
the broadcast over NCCL from this process's GPU, as TRL's is; the GPU session's two-GPU leg), ``--legacy``
(primerl-nccl: the body of prime-rl's earlier orchestrators, ``server_rank`` and ``num_inference_server``),
``--disk`` (areal: its directory update). ``stalled``: a trainer that stops mid-update (:func:`stalled`).

``python weight_trainer.py --serve``: the same runs, one per line of stdin, in one process (see :func:`serve`).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import pickle
import re
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import httpx
import torch
from safetensors.torch import load_file

from megatron_serve.client.trainer_group import trainer_init, trainer_send_weights
from megatron_serve.weights.framework_groups import TRL_PREFIX, sglang_prefixes

GROUP = "weight_update_group"


def tensors_of(model_dir: str, corrupt: str | None) -> tuple[list[tuple[str, torch.Tensor]], list[str]]:
    """The checkpoint's tensors in a fixed order, and the dtype names to announce (one corrupted on request)."""
    named = sorted(load_file(os.path.join(model_dir, "model.safetensors")).items())
    dtypes = [str(t.dtype).removeprefix("torch.") for _, t in named]
    if corrupt == "name":
        named[-1] = ("model.layers.99.mlp.nope.weight", named[-1][1])
    elif corrupt == "shape":
        named[-1] = (named[-1][0], torch.zeros(3, 3, dtype=named[-1][1].dtype))
    elif corrupt == "dtype":
        dtypes[-1] = "int8"
    return named, dtypes


class Calls:
    """The server's routes, each answer printed; ``alongside``: a call answered while this process broadcasts."""

    def __init__(self, url: str) -> None:
        # verify=False: the URL is plain HTTP, and a client that verifies loads the CA bundle (~40 ms of CPU a run)
        self.http = httpx.Client(base_url=url, timeout=600, verify=False,
                                 headers={"Authorization": f"Bearer {os.environ['ADMIN_KEY']}"})
        self.pool = concurrent.futures.ThreadPoolExecutor(1)

    def post(self, path: str, body: Any = None) -> httpx.Response:
        response = self.http.post(path, json=body) if body is not None else self.http.post(path)
        print(json.dumps({"call": path, "status": response.status_code, "body": _json(response)}), flush=True)
        return response

    def alongside(self, path: str, body: Any, work: Callable[[], Any]) -> tuple[httpx.Response, Any]:
        """Post while ``work`` runs here (the server blocks in the collective while it answers)."""
        answer = self.pool.submit(self.post, path, body)
        done = work()
        return answer.result(), done


def _json(response: httpx.Response) -> Any:
    try:
        return response.json()
    except ValueError:
        return response.text


def vllm(calls: Calls, args: argparse.Namespace) -> None:
    """TRL 1.16's ``VLLMClient`` (``trl/generation/vllm_client.py``: init_communicator, weight_update,
    update_named_params) over vLLM's weight routes; packed broadcast unless ``--unpacked``."""
    named, dtypes = tensors_of(args.model, args.corrupt)
    init_info = {"master_address": "127.0.0.1", "master_port": args.port, "rank_offset": 1, "world_size": 2,
                 "packed": not args.unpacked}
    _, group = calls.alongside("/init_weight_transfer_engine", {"init_info": init_info},
                               lambda: trainer_init("127.0.0.1", args.port, 2, timeout=120, backend=args.backend))
    update_info = {"names": [n for n, _ in named], "dtype_names": dtypes, "shapes": [list(t.shape) for _, t in named]}
    if args.skyrl:
        skyrl(calls, group, named, update_info)
        return
    if not args.no_start:
        calls.post("/start_weight_update", {"is_checkpoint_format": True})
    if args.corrupt == "dtype":  # refused before any byte moves: nothing to broadcast
        calls.post("/update_weights", {"update_info": update_info})
        return
    calls.alongside("/update_weights", {"update_info": update_info},
                    lambda: trainer_send_weights(named, group, packed=not args.unpacked))
    if not args.no_start:
        calls.post("/finish_weight_update", {"weight_version": args.version} if args.version else {})


def skyrl(calls: Calls, group: Any, named: list[tuple[str, torch.Tensor]], update_info: dict) -> None:
    """SkyRL HEAD (a956457)'s fully-async weight sync with the KV offloaded (``workers/worker_dispatch.py``, the
    client calls of ``inference_servers/remote_inference_client.py``, the sender of
    ``weight_sync/broadcast_strategy.py``'s ``_send_chunks_vllm_native``): ``/pause?mode=keep``, its worker methods
    through ``/collective_rpc`` (sleep, wake the weights, start, ``update_weights_nccl`` alongside the packed
    broadcast, finish, wake the KV cache), ``/resume``."""
    calls.post("/pause?mode=keep&clear_cache=false")
    rpc = [("skyrl_sleep_for_weight_sync", {"offload_kv": True}), ("skyrl_wake_for_weight_sync", {"tags": ["weights"]}),
           ("skyrl_start_weight_update", {"is_checkpoint_format": True})]
    for method, kwargs in rpc:
        calls.post("/collective_rpc", {"method": method, "kwargs": kwargs})
    calls.alongside("/collective_rpc", {"method": "update_weights_nccl",
                                        "kwargs": {"update_info": {**update_info, "packed": True}}},
                    lambda: trainer_send_weights(named, group, packed=True))
    calls.post("/collective_rpc", {"method": "skyrl_finish_weight_update"})
    calls.post("/collective_rpc", {"method": "skyrl_wake_for_weight_sync", "kwargs": {"tags": ["kv_cache"]}})
    calls.post("/resume")


def trl_client(_: Calls, args: argparse.Namespace) -> None:
    """TRL 1.16's own ``VLLMClient`` (``trl/generation/vllm_client.py``), unchanged but for vLLM's NCCL trainer
    endpoint: its rendezvous (``open_trainer_endpoint``) and packed broadcast (``packed_nccl_broadcast_producer``)
    are replaced by gloo's (:mod:`megatron_serve.client.trainer_group`), with the vLLM imports they come with
    (``is_vllm_available``, ``get_ip``). Its session carries the admin key (TRL sends none of its own). Prints each
    weight call's answer as the session saw it."""
    from types import SimpleNamespace  # noqa: PLC0415 - only this protocol

    import trl.generation.vllm_client as trl_vllm  # noqa: PLC0415 - only this protocol needs TRL

    def endpoint(init_info: dict) -> SimpleNamespace:
        group = trainer_init(init_info["master_address"], init_info["master_port"], init_info["world_size"],
                             timeout=120)
        return SimpleNamespace(pg=group, group=SimpleNamespace(store=None, socket=None))  # what close_communicator clears

    def broadcast(iterator, group, src, post_iter_func) -> None:  # noqa: ANN001 - vLLM's signature
        trainer_send_weights(((name, post_iter_func((name, t))) for name, t in iterator), group.pg, packed=True,
                             src=src)

    trl_vllm.is_vllm_available = lambda *_, **__: True
    trl_vllm.get_ip = lambda: "127.0.0.1"
    trl_vllm._HAS_STATEFUL_TRAINER_ENGINE = True
    trl_vllm.open_trainer_endpoint = endpoint
    trl_vllm.packed_nccl_broadcast_producer = broadcast

    def printed(response: Any, *_: Any, **__: Any) -> None:
        if response.request.method == "POST":
            print(json.dumps({"call": "/" + response.url.rsplit("/", 1)[-1], "status": response.status_code,
                              "body": response.json()}), flush=True)

    client = trl_vllm.VLLMClient(base_url=args.url, group_port=args.port)
    client.session.headers["Authorization"] = f"Bearer {os.environ['ADMIN_KEY']}"
    client.session.hooks["response"].append(printed)
    client.init_communicator(device=torch.device("cuda"))  # no index: TRL leaves the (absent) current device as is
    client.update_model_params(_Parameters(tensors_of(args.model, None)[0]))
    client.close_communicator()


class _Parameters(torch.nn.Module):
    """A module whose ``named_parameters`` are a checkpoint's tensors under its names (what TRL sends)."""

    def __init__(self, named: list[tuple[str, torch.Tensor]]) -> None:
        super().__init__()
        self.named = named

    def named_parameters(self, *_, **__):  # noqa: ANN201 - torch's signature
        return iter([(name, torch.nn.Parameter(tensor, requires_grad=False)) for name, tensor in self.named])


def sglang(calls: Calls, args: argparse.Namespace) -> None:
    """slime's weight sync over SGLang's routes (``slime/backends/megatron_utils/update_weight_utils.py``:
    ``init_weights_update_group``, ``update_weights_from_distributed`` with one broadcast per tensor in the order of
    ``names``, ``destroy_weights_update_group``)."""
    named, dtypes = tensors_of(args.model, args.corrupt)
    group_body = {"master_address": "127.0.0.1", "master_port": args.port, "rank_offset": 1, "world_size": 2,
                  "group_name": GROUP, "backend": "gloo"}
    _, group = calls.alongside("/init_weights_update_group", group_body,
                               lambda: trainer_init("127.0.0.1", args.port, 2, prefixes=sglang_prefixes(GROUP, "gloo"),
                                                    timeout=120))
    update = {"names": [n for n, _ in named], "dtypes": dtypes, "shapes": [list(t.shape) for _, t in named],
              "group_name": GROUP, "flush_cache": True, **({"weight_version": args.version} if args.version else {})}
    if args.corrupt == "dtype":  # refused before any byte moves: nothing to broadcast
        calls.post("/update_weights_from_distributed", update)
    else:
        calls.alongside("/update_weights_from_distributed", update,
                        lambda: trainer_send_weights(named, group, packed=False))
    calls.post("/destroy_weights_update_group", {"group_name": GROUP})


def trl(calls: Calls, args: argparse.Namespace) -> None:
    """TRL 1.10's ``VLLMClient`` (``trl/generation/vllm_client.py``: ``init_communicator``,
    ``update_model_params`` = ``update_named_param`` per parameter, ``close_communicator``), the client the last
    rank of the group whose store the server serves, keys under TRL's ``client2server`` prefix."""
    named, dtypes = tensors_of(args.model, args.corrupt)
    calls.post("/init_communicator/", {"host": "0.0.0.0", "port": args.port, "world_size": 2,
                                       "client_device_uuid": "42"})
    group = trainer_init("127.0.0.1", args.port, 2, rank=1, prefixes=(TRL_PREFIX,), serves_store=False,
                         timeout=120)
    for (name, tensor), dtype in zip(named, dtypes):
        answer = calls.post("/update_named_param/", {"name": name, "dtype": f"torch.{dtype}",
                                                     "shape": list(tensor.shape)})
        if answer.status_code != 200:  # TRL's client raises here: nothing broadcast
            break
        trainer_send_weights([(name, tensor)], group, src=1)
        group.barrier().wait()
    calls.post("/close_communicator/")


def areal(calls: Calls, args: argparse.Namespace) -> None:
    """AReaL's vLLM backend (``areal/engine/vllm_remote.py`` at AReaL 4aef98d: ``get_pause_request``,
    ``build_init_weights_group_request``, ``build_distributed_weight_update_requests``, ``get_resume_request``, as
    ``areal/infra/remote_inf_engine.py`` runs them) and its trainer's broadcast, one tensor at a time in the order of
    ``names`` (``areal_update_weight_xccl``'s receiver). ``--disk``: ``build_disk_weight_update_requests`` instead."""
    calls.post("/areal_pause_generation", {})
    if args.disk:
        calls.post("/areal_update_weights", {"model_path": args.model})
        calls.post("/areal_continue_generation", {})
        return
    named, dtypes = tensors_of(args.model, args.corrupt)
    group_body = {"master_address": "127.0.0.1", "master_port": str(args.port), "rank_offset": 1, "world_size": 2,
                  "backend": "gloo", "group_name": GROUP}
    _, group = calls.alongside("/areal_init_weights_update_group", group_body,
                               lambda: trainer_init("127.0.0.1", args.port, 2, prefixes=sglang_prefixes(GROUP, "gloo"),
                                                    timeout=120))
    calls.post("/areal_set_update_weight_meta", {"names": [n for n, _ in named], "dtypes": dtypes,
                                                 "shapes": [list(t.shape) for _, t in named], "group_name": GROUP})
    calls.alongside("/areal_update_weights_xccl", {}, lambda: trainer_send_weights(named, group, packed=False))
    calls.post("/areal_continue_generation", {})


def stalled(calls: Calls, args: argparse.Namespace) -> None:
    """A trainer that stalls mid-update: vLLM's init, start and ``/update_weights``, then nothing broadcast; prints
    ``{"stalled": true}`` once the update call is under way (the test then stops this process)."""
    named, dtypes = tensors_of(args.model, None)
    init_info = {"master_address": "127.0.0.1", "master_port": args.port, "rank_offset": 1, "world_size": 2}
    _, group = calls.alongside("/init_weight_transfer_engine", {"init_info": init_info},
                               lambda: trainer_init("127.0.0.1", args.port, 2, timeout=120))
    calls.post("/start_weight_update", {"is_checkpoint_format": True})
    update_info = {"names": [n for n, _ in named], "dtype_names": dtypes, "shapes": [list(t.shape) for _, t in named]}
    calls.pool.submit(calls.post, "/update_weights", {"update_info": update_info})
    print(json.dumps({"stalled": True}), flush=True)
    time.sleep(600)  # the group held open, nothing sent: the server's receive waits (the test ends this first)
    del group


def disk(calls: Calls, args: argparse.Namespace) -> None:
    """SGLang's ``update_weights_from_disk`` (``slime/backends/sglang_utils/sglang_engine.py``): the server reads
    the directory."""
    calls.post("/update_weights_from_disk", {"model_path": args.model, "flush_cache": True,
                                             **({"weight_version": args.version} if args.version else {})})


def primerl(calls: Calls, args: argparse.Namespace) -> None:
    """prime-rl's orchestrator once the trainer wrote a checkpoint (``prime_rl/orchestrator/client.py``:
    ``update_weights``): ``/update_weights {weight_dir}``."""
    calls.post("/update_weights", {"weight_dir": args.model})


def primerl_nccl(calls: Calls, args: argparse.Namespace) -> None:
    """prime-rl's NCCL broadcast: its orchestrator's ``init_nccl_broadcast`` and ``update_weights``
    (``src/prime_rl/orchestrator/client.py``: ``/init_broadcaster``, then ``NCCL_READY`` touched in the step's
    directory and ``/update_weights {weight_dir}``) and its trainer's ``NCCLWeightBroadcast``
    (``src/prime_rl/trainer/rl/broadcast/nccl.py``: rank 0 of inference world + 1, waits for ``NCCL_READY``, then
    ``broadcast_integer`` and ``broadcast_state_dict`` per layer, then removes the marker); gloo where prime-rl's
    ``PyNcclCommunicator`` is NCCL. ``--corrupt dtype`` sends the last tensor as int8."""
    named, _ = tensors_of(args.model, args.corrupt)
    if args.corrupt == "dtype":
        named[-1] = (named[-1][0], named[-1][1].to(torch.int8))
    ranks = ({"server_rank": 0, "num_inference_server": 1} if args.legacy else
             {"rank_offset": 0, "inference_world_size": 1, "quantize_in_weight_transfer": False})
    _, group = calls.alongside("/init_broadcaster", {"host": "127.0.0.1", "port": args.port, "timeout": 120, **ranks},
                               lambda: trainer_init("127.0.0.1", args.port, 2, timeout=120))
    with tempfile.TemporaryDirectory() as step_dir:
        ready = Path(step_dir, "NCCL_READY")
        ready.touch()
        calls.alongside("/update_weights", {"weight_dir": step_dir}, lambda: _primerl_broadcast(named, group, ready))


def _primerl_broadcast(named: list[tuple[str, torch.Tensor]], group: Any, ready: Path) -> None:
    """``NCCLWeightBroadcast.broadcast_weights``: the weights outside the layers, then each layer's."""
    while not ready.exists():  # _wait_for_nccl_ready
        time.sleep(0.1)
    layers: dict[int, dict[str, torch.Tensor]] = {}
    for name, tensor in named:
        layer = re.match(r"model\.layers\.(\d+)\.", name)
        layers.setdefault(int(layer.group(1)) + 1 if layer else 0, {})[name] = tensor
    _primerl_send(torch.tensor([len(layers)], dtype=torch.long), group)  # broadcast_integer
    for index in sorted(layers):
        state_dict = layers[index]  # broadcast_state_dict: its tensors grouped by dtype, their metadata pickled
        by_dtype: dict[torch.dtype, list[tuple[str, torch.Tensor]]] = {}
        for name, tensor in state_dict.items():
            by_dtype.setdefault(tensor.dtype, []).append((name, tensor))
        metadata = pickle.dumps({dtype: [(name, t.shape, t.numel()) for name, t in items]
                                 for dtype, items in by_dtype.items()})
        _primerl_send(torch.tensor([len(metadata)], dtype=torch.long), group)
        _primerl_send(torch.ByteTensor(list(metadata)), group)
        for items in by_dtype.values():
            _primerl_send(torch.cat([t.flatten() for _, t in items]), group)
    ready.unlink()  # _cleanup_nccl_ready


def _primerl_send(tensor: torch.Tensor, group: Any) -> None:
    trainer_send_weights([("", tensor)], group)


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    parser.add_argument("protocol", choices=["vllm", "sglang", "trl", "disk", "primerl", "primerl-nccl",
                                                 "trl-client", "areal", "stalled"])
    parser.add_argument("url")
    parser.add_argument("model")
    parser.add_argument("port", type=int)
    parser.add_argument("--version", default=None)
    parser.add_argument("--corrupt", choices=["name", "shape", "dtype"], default=None)
    parser.add_argument("--unpacked", action="store_true")
    parser.add_argument("--no-start", action="store_true")
    parser.add_argument("--skyrl", action="store_true")
    parser.add_argument("--legacy", action="store_true")
    parser.add_argument("--disk", action="store_true")  # areal: its disk update
    parser.add_argument("--backend", choices=["gloo", "nccl"], default="gloo")  # vllm: the server's backend
    return parser


def run(argv: list[str]) -> None:
    """One trainer run: ``argv`` as on the command line."""
    args = parser().parse_args(argv)
    calls = Calls(args.url)
    try:
        {"vllm": vllm, "sglang": sglang, "trl": trl, "disk": disk, "primerl": primerl, "primerl-nccl": primerl_nccl,
         "trl-client": trl_client, "areal": areal, "stalled": stalled}[args.protocol](calls, args)
    finally:
        calls.pool.shutdown()
        calls.http.close()


def serve() -> None:
    """``--serve``: one trainer process for many runs (torch imported once): each line on stdin is a run's argv as
    a JSON list; after its JSON lines the run prints ``{"trainer_done": true, "error": null | traceback}``. Each run
    has its own HTTP session and its own group (a fresh port, store and gloo group), as a process of its own has."""
    for line in sys.stdin:
        error = None
        try:
            run(json.loads(line))
        except BaseException:  # noqa: BLE001 - reported to the test, which fails on it
            error = traceback.format_exc()
        print(json.dumps({"trainer_done": True, "error": error}), flush=True)


def main() -> None:
    if sys.argv[1:] == ["--serve"]:
        serve()
    else:
        run(sys.argv[1:])


if __name__ == "__main__":
    main()
