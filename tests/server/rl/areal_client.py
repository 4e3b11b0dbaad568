"""AReaL 1.0.4's own remote engines against a server: generation, one weight update, generation again.

``python areal_client.py ADDR MODEL_DIR NEW_MODEL_DIR PROMPTS_JSON GROUP_PORT`` under ``.venv-verl``'s Python with
``.anchors-areal`` on ``PYTHONPATH`` (``make setup``: areal and the packages its import chain needs beyond that venv,
``--no-deps``; the venv holds Ray, torchdata, hydra and uvloop, which AReaL's ``remote_inf_engine.py`` imports, and
this project). ``ADDR`` is AReaL's server address (``HOST:PORT``), with the admin key as the password of its
userinfo (``areal:KEY@HOST:PORT``), which AReaL's aiohttp and requests calls send as HTTP Basic, as the server
takes it. Prints one JSON line: ``{"vllm_before", "vllm_after", "sglang_after"}``, each a list of AReaL's
``ModelResponse`` ``{"output_tokens", "output_versions", "stop_reason"}``.

What runs is AReaL's: ``RemotevLLMEngine`` (``areal/engine/vllm_remote.py`` over ``areal/infra/remote_inf_engine.py``):
``initialize``, ``agenerate`` (``/v1/completions`` with AReaL's body: no ``model``, ``use_beam_search: false``,
``logprobs: 0``, ``return_tokens_as_token_ids``), and its distributed weight update as AReaL's FSDP trainer drives it
(``areal/engine/fsdp_engine.py``: ``pause_generation``, ``init_weights_update_group`` while the trainer joins,
``update_weights_from_distributed`` while it broadcasts each tensor, ``continue_generation``, ``set_version``); then
``RemoteSGLangEngine`` (``areal/engine/sglang_remote.py``: SGLang's ``/generate`` with ``image_data: []``). Not
AReaL's: the trainer's side of the group (AReaL's ``init_custom_process_group`` and ``dist.broadcast`` inside its
FSDP engine, which needs its launcher) is :mod:`megatron_serve.client.trainer_group`, under the same store layout.
"""

from __future__ import annotations

import asyncio
import json
import sys

from areal.api.alloc_mode import ModelAllocation
from areal.api.cli_args import GenerationHyperparameters
from areal.api.io_struct import ModelRequest, ParamSpec, WeightUpdateMeta
from areal.engine.sglang_remote import RemoteSGLangEngine
from areal.engine.vllm_remote import RemotevLLMEngine
from safetensors.torch import load_file

from megatron_serve.client.trainer_group import trainer_init, trainer_send_weights
from megatron_serve.weights.framework_groups import sglang_prefixes

TOKENS = 8
GROUP = "update_weight_group"  # AReaL's FSDP engine's name for a single group


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


def main(addr: str, model_dir: str, new_model_dir: str, prompts: list[list[int]], port: int) -> dict:
    vllm = RemotevLLMEngine.from_pretrained(tokenizer_path=model_dir)
    vllm.initialize(addr=addr)
    try:
        before = generate(vllm, prompts)
        push(vllm, new_model_dir, port)
        after = generate(vllm, prompts)
    finally:
        vllm.destroy()
    sglang = RemoteSGLangEngine.from_pretrained(tokenizer_path=model_dir)
    sglang.initialize(addr=addr)
    try:
        sglang.set_version(1)
        sglang_after = generate(sglang, prompts)
    finally:
        sglang.destroy()
    return {"vllm_before": before, "vllm_after": after, "sglang_after": sglang_after}


if __name__ == "__main__":
    addr, model_dir, new_model_dir, prompts_json, port = sys.argv[1:6]
    print(json.dumps(main(addr, model_dir, new_model_dir, json.loads(prompts_json), int(port))), flush=True)
