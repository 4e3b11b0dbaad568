"""AReaL 1.0.4's own remote engines against a server: generation, weight updates (distributed, then from disk by
each engine), generation after each.

``python areal_client.py ADDR MODEL_DIR NEW_MODEL_DIR PROMPTS_JSON GROUP_PORT WORK_DIR`` under ``.venv-verl``'s Python
with ``.anchors-areal`` on ``PYTHONPATH`` (``make setup``: areal and the packages its import chain needs beyond that
venv, ``--no-deps``; the venv holds Ray, torchdata, hydra and uvloop, which AReaL's ``remote_inf_engine.py`` imports,
and this project). ``ADDR`` is AReaL's server address (``HOST:PORT``), with the admin key as the password of its
userinfo (``areal:KEY@HOST:PORT``), which AReaL's aiohttp and requests calls send as HTTP Basic, as the server
takes it. ``WORK_DIR``: an empty directory for AReaL's name_resolve records and the trainer's saved checkpoints. Prints
one JSON line: ``{"vllm_before", "vllm_after", "vllm_disk", "sglang_disk"}``, each a list of AReaL's ``ModelResponse``
``{"output_tokens", "output_versions", "stop_reason"}``: before any update (``MODEL_DIR``'s weights, version 0), after
the distributed update of ``NEW_MODEL_DIR``'s (version 1), after ``RemotevLLMEngine``'s disk update back to
``MODEL_DIR``'s (version 2), after ``RemoteSGLangEngine``'s disk update to ``NEW_MODEL_DIR``'s (version 3).

What runs is AReaL's: ``RemotevLLMEngine`` (``areal/engine/vllm_remote.py`` over ``areal/infra/remote_inf_engine.py``):
``initialize``, ``agenerate`` (``/v1/completions`` with AReaL's body: no ``model``, ``use_beam_search: false``,
``logprobs: 0``, ``return_tokens_as_token_ids``), and its distributed weight update as AReaL's FSDP trainer drives it
(``areal/engine/fsdp_engine.py``: ``pause_generation``, ``init_weights_update_group`` while the trainer joins,
``update_weights_from_distributed`` while it broadcasts each tensor, ``continue_generation``, ``set_version``); its
disk update as the same FSDP engine drives it (``_update_weights_from_disk``: ``pause_generation``,
``update_weights_from_disk``, whose request waits in AReaL's ``name_resolve`` for the trainer's entry of this version,
the checkpoint saved, the entry added, ``continue_generation``), on AReaL's file-based ``name_resolve`` backend (its
``nfs`` type, as a single-node run configures it); then ``RemoteSGLangEngine`` (``areal/engine/sglang_remote.py``:
SGLang's ``/generate`` with ``image_data: []``, ``/update_weights_from_disk``) through the same disk update. Not
AReaL's: the trainer's side of the group (AReaL's ``init_custom_process_group`` and ``dist.broadcast`` inside its
FSDP engine, which needs its launcher) is :mod:`megatron_serve.client.trainer_group`, under the same store layout;
the trainer's save (``_save_model_to_hf`` of its FSDP model) is a copy of the checkpoint directory.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import sys
from datetime import datetime

from areal.api.alloc_mode import ModelAllocation
from areal.api.cli_args import GenerationHyperparameters, NameResolveConfig
from areal.api.io_struct import ModelRequest, ParamSpec, WeightUpdateMeta
from areal.engine.sglang_remote import RemoteSGLangEngine
from areal.engine.vllm_remote import RemotevLLMEngine
from areal.utils import name_resolve, names
from safetensors.torch import load_file

from megatron_serve.client.trainer_group import trainer_init, trainer_send_weights
from megatron_serve.weights.framework_groups import sglang_prefixes

TOKENS = 8
GROUP = "update_weight_group"  # AReaL's FSDP engine's name for a single group
EXPERIMENT, TRIAL = "megatron-serve", "disk-update"  # name the disk update's name_resolve entries and save root


def generate(engine: RemotevLLMEngine | RemoteSGLangEngine, prompts: list[list[int]]) -> list[dict]:
    async def one(ids: list[int]) -> dict:
        answer = await engine.agenerate(ModelRequest(input_ids=ids, gconfig=GenerationHyperparameters(
            max_new_tokens=TOKENS, greedy=True, ignore_eos=True)))
        return {"output_tokens": answer.output_tokens, "output_versions": answer.output_versions,
                "stop_reason": answer.stop_reason}

    async def every() -> list[dict]:
        return [await one(ids) for ids in prompts]

    return asyncio.run(every())


def push(engine: RemotevLLMEngine, model_dir: str, port: int) -> None:
    """``FSDPEngine._init_weight_update_from_distributed`` then ``_update_weights_from_distributed`` (one bucket)."""
    meta = WeightUpdateMeta(type="xccl", gen_allocation=ModelAllocation.from_str("vllm:d1", name="rollout"),
                            nccl_master_address="127.0.0.1", nccl_master_port=port, nccl_group_name=GROUP)
    joined = engine.init_weights_update_group(meta)
    group = trainer_init("127.0.0.1", port, meta.gen_allocation.parallel.world_size + 1,
                         prefixes=sglang_prefixes(GROUP, "gloo"), timeout=120)
    joined.result()
    named = sorted(load_file(f"{model_dir}/model.safetensors").items())
    engine.pause_generation()
    try:
        specs = [ParamSpec(name=name, shape=tuple(t.shape), dtype=str(t.dtype).removeprefix("torch."))
                 for name, t in named]
        updated = engine.update_weights_from_distributed(meta, specs)
        trainer_send_weights(named, group)  # dist.broadcast of each tensor, in the order of the specs
        updated.result()
    finally:
        engine.continue_generation()
    engine.set_version(1)


def load_from_disk(engine: RemotevLLMEngine | RemoteSGLangEngine, model_dir: str, work_dir: str) -> None:
    """``FSDPEngine._update_weights_from_disk`` on rank 0, then the version step AReaL's trainer takes after it: the
    engine's request is sent only once the trainer's ``name_resolve`` entry of the current version appears, which
    is added after the checkpoint is saved (here: ``model_dir`` copied to the update's path)."""
    meta = WeightUpdateMeta.from_disk(EXPERIMENT, TRIAL, work_dir)  # clears the checkpoint once loaded, as AReaL
    version = engine.get_version()
    engine.pause_generation()
    loaded = engine.update_weights_from_disk(meta)
    shutil.copytree(model_dir, meta.path)
    name_resolve.add(names.update_weights_from_disk(EXPERIMENT, TRIAL, version), str(datetime.now().timestamp()),
                     keepalive_ttl=120)
    loaded.result()
    engine.continue_generation()
    engine.set_version(version + 1)


def main(addr: str, model_dir: str, new_model_dir: str, prompts: list[list[int]], port: int, work_dir: str) -> dict:
    name_resolve.reconfigure(NameResolveConfig(type="nfs", nfs_record_root=f"{work_dir}/name_resolve"))
    names_given = {"experiment_name": EXPERIMENT, "trial_name": TRIAL}
    vllm = RemotevLLMEngine.from_pretrained(tokenizer_path=model_dir, **names_given)
    vllm.initialize(addr=addr)
    try:
        before = generate(vllm, prompts)
        push(vllm, new_model_dir, port)
        after = generate(vllm, prompts)
        load_from_disk(vllm, model_dir, work_dir)
        vllm_disk = generate(vllm, prompts)
    finally:
        vllm.destroy()
    sglang = RemoteSGLangEngine.from_pretrained(tokenizer_path=model_dir, **names_given)
    sglang.initialize(addr=addr)
    try:
        sglang.set_version(2)
        load_from_disk(sglang, new_model_dir, work_dir)
        sglang_disk = generate(sglang, prompts)
    finally:
        sglang.destroy()
    return {"vllm_before": before, "vllm_after": after, "vllm_disk": vllm_disk, "sglang_disk": sglang_disk}


if __name__ == "__main__":
    addr, model_dir, new_model_dir, prompts_json, port, work_dir = sys.argv[1:7]
    print(json.dumps(main(addr, model_dir, new_model_dir, json.loads(prompts_json), int(port), work_dir)), flush=True)
