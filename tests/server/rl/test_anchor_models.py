"""The vLLM- and SGLang-shaped routes against those projects' own code, at vLLM 0.33.0 and SGLang 0.5.23.

``make setup`` installs both with ``--no-deps`` into ``.anchors`` (with the six small packages vLLM's protocol
modules import). vLLM's side: every request body the frameworks here send (TRL 1.16's client, AReaL's vLLM backend,
a chat, ``/inference/v1/generate``) and every answer this server gives them, whole and streamed, validate against
vLLM's own pydantic models (``CompletionRequest``/``CompletionResponse``/``CompletionStreamResponse``,
``ChatCompletionRequest``/``ChatCompletionResponse``, ``GenerateRequest``/``GenerateResponse`` of
``entrypoints/scale_out/token_in_token_out``), in a process of its own (``anchor_check.py``: importing vLLM here
would change what TRL's client imports). SGLang's side: its ``GenerateReqInput`` is a dataclass whose package does
not import without its GPU dependencies, so its fields are read from SGLang's own source (``io_struct.py``) and
every one is either served by ``/generate`` or refused by name, and every field ``/generate`` takes is SGLang's.
"""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

from megatron_serve.server.rl.sglang_generate import NEUTRAL, SglangGenerateRequest, SglangSamplingParams
from megatron_serve.server.rl.trl_generate import TRL_DEFAULTS
from megatron_serve.server.rl.vllm_sampling import VllmSamplingParams

from ...forked import run_scripts
from ..conftest import surface
from .tokens_app import MODEL, events, fake_http

ROOT = Path(__file__).resolve().parents[3]
ANCHORS = ROOT / ".anchors"
CHECKER = Path(__file__).with_name("anchor_check.py")
ANCHORED = Path(__file__).with_name("anchored.py")
COMPLETION = "vllm.entrypoints.openai.completion.protocol"
CHAT = "vllm.entrypoints.openai.chat_completion.protocol"
TOKENS = "vllm.entrypoints.scale_out.token_in_token_out.protocol"

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def anchors() -> Path:
    assert (ANCHORS / "vllm").is_dir() and (ANCHORS / "sglang").is_dir(), (
        f"{ANCHORS} is missing vLLM or SGLang: run `make setup` (it installs vllm==0.33.0 and sglang==0.5.23 there "
        "with --no-deps)")
    return ANCHORS


def validated(anchors: Path, cases: list[dict], tmp_path: Path) -> dict:
    """``anchor_check.py``'s verdict on ``cases``: forked from the worker's fork server, torch imported there already
    (:mod:`.anchored` puts ``anchors`` on its path as ``PYTHONPATH`` would)."""
    bodies = tmp_path / "bodies.json"
    bodies.write_text(json.dumps(cases))
    (done,) = run_scripts(ANCHORED, [[str(anchors), str(CHECKER), str(bodies)]], {"PYTHONPATH": str(anchors)},
                          timeout=240, via="forkserver")
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.splitlines()[-1])


#: Request bodies as the frameworks send them (their source named).
TRL_GENERATE = {"model": MODEL, "prompt": [[5, 6, 7], [8, 9]], "return_token_ids": True,
                "return_tokens_as_token_ids": True, "n": 2, "repetition_penalty": 1.0, "temperature": 1.0,
                "top_p": 1.0, "top_k": 0, "min_p": 0.0, "max_tokens": 4, "logprobs": 0}  # trl 1.16 generate()
TRL_SEQUENCE_LOGPROBS = {"model": MODEL, "prompt": [[5, 17, 300, 42, 9]], "max_tokens": 1, "temperature": 1.0,
                         "prompt_logprobs": 2}  # trl 1.16 get_sequence_logprobs()
AREAL = {"top_p": 1.0, "top_k": -1, "max_tokens": 3, "temperature": 1.0, "stop_token_ids": [],
         "ignore_eos": False, "skip_special_tokens": False, "return_tokens_as_token_ids": True, "logprobs": 0,
         "use_beam_search": False, "stream": False, "prompt": [5, 6, 7]}  # areal/engine/vllm_remote.py, 4aef98d
CHAT_BODY = {"model": MODEL, "messages": [{"role": "user", "content": "Which tokens?"}], "max_tokens": 3,
             "logprobs": True, "top_logprobs": 2, "return_token_ids": True}
GENERATE = {"token_ids": [5, 6, 7], "sampling_params": {"max_tokens": 3, "logprobs": 1, "temperature": 0.0}}


async def test_every_vllm_shaped_body_validates_against_vllms_own_models(anchors, tokenizer, tiny_model, tmp_path):
    cases: list[dict] = []

    def case(model: str, body: dict, what: str) -> None:
        cases.append({"model": model, "body": body, "what": what})

    async with fake_http(tokenizer) as http:
        for what, body in (("TRL generate", TRL_GENERATE), ("AReaL", AREAL)):
            case(f"{COMPLETION}:CompletionRequest", body, f"{what} request")
            answer = await http.post("/v1/completions", json=body)
            assert answer.status_code == 200, answer.text
            case(f"{COMPLETION}:CompletionResponse", answer.json(), f"{what} answer")
            streamed = await http.post("/v1/completions", json={**body, "stream": True})
            for i, chunk in enumerate(events(streamed.text)):
                case(f"{COMPLETION}:CompletionStreamResponse", chunk, f"{what} chunk {i}")
        case(f"{CHAT}:ChatCompletionRequest", CHAT_BODY, "chat request")
        chat = await http.post("/v1/chat/completions", json=CHAT_BODY)
        case(f"{CHAT}:ChatCompletionResponse", chat.json(), "chat answer")
        case(f"{TOKENS}:GenerateRequest", GENERATE, "generate request")
        generated = await http.post("/inference/v1/generate", json=GENERATE)
        case(f"{TOKENS}:GenerateResponse", generated.json(), "generate answer")
    async with surface(tiny_model, tokenizer) as (_, http):  # prompt log probs and their ranks need a model
        case(f"{COMPLETION}:CompletionRequest", TRL_SEQUENCE_LOGPROBS, "TRL sequence log probs request")
        scored = await http.post("/v1/completions", json=TRL_SEQUENCE_LOGPROBS)
        case(f"{COMPLETION}:CompletionResponse", scored.json(), "TRL sequence log probs answer")
    verdict = validated(anchors, cases, tmp_path)
    assert verdict["vllm"] == "0.33.0"
    assert verdict["checked"] == len(cases) > 12
    assert verdict["failures"] == []


def generate_req_input_fields(anchors: Path) -> dict[str, ast.expr | None]:
    """SGLang's ``GenerateReqInput`` fields and their defaults, read from its source (``io_struct.py``)."""
    tree = ast.parse((anchors / "sglang" / "srt" / "managers" / "io_struct.py").read_text())
    cls = next(node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == "GenerateReqInput")
    return {node.target.id: node.value for node in cls.body
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)}


def test_sglangs_generate_req_input_fields_are_each_served_or_refused_by_name(anchors):
    fields = generate_req_input_fields(anchors)
    assert "image_data" in fields and "input_ids" in fields and len(fields) > 60  # SGLang 0.5.23's
    served = set(SglangGenerateRequest.model_fields)
    assert served <= fields.keys(), f"/generate takes fields SGLang does not have: {served - fields.keys()}"
    assert fields.keys() <= served | NEUTRAL.keys() | {"sampling_params"}, (
        f"GenerateReqInput fields neither served nor refused by name: {fields.keys() - served - NEUTRAL.keys()}")
    for name, (value, _) in NEUTRAL.items():  # the neutral value is SGLang's own default
        default = fields[name]
        if isinstance(default, ast.Call):  # field(default=None, kw_only=True)
            default = next(k.value for k in default.keywords if k.arg == "default")
        assert ast.literal_eval(default) == value, name
    sampling = ast.parse((anchors / "sglang" / "srt" / "sampling" / "sampling_params.py").read_text())
    struct = next(node for node in sampling.body if isinstance(node, ast.ClassDef) and node.name == "SamplingParams")
    sglang_sampling = {node.target.id for node in struct.body
                       if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)}
    assert "max_new_tokens" in sglang_sampling and "custom_params" in sglang_sampling
    assert set(SglangSamplingParams.model_fields) <= sglang_sampling, (
        set(SglangSamplingParams.model_fields) - sglang_sampling)


def vllm_sampling_params_fields(anchors: Path) -> set[str]:
    """vLLM's ``SamplingParams`` fields, read from its source (``sampling_params.py``)."""
    tree = ast.parse((anchors / "vllm" / "sampling_params.py").read_text())
    struct = next(node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == "SamplingParams")
    return {node.target.id for node in struct.body
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)}


def test_the_vllm_bodies_sampling_fields_are_vllms_own(anchors):
    """``sampling_params`` of ``/inference/v1/generate`` and TRL's sampling fields (the table's rows by their vLLM names)
    are fields of vLLM 0.33's ``SamplingParams``, except ``truncate_prompt_tokens``: a field of its earlier releases
    (through 0.10), which clients pinned to them send and the table keeps."""
    vllm = vllm_sampling_params_fields(anchors)
    assert {"n", "max_tokens", "allowed_token_ids", "bad_words"} <= vllm  # vLLM 0.33's
    assert set(VllmSamplingParams.model_fields) - vllm == {"truncate_prompt_tokens"}
    assert set(TRL_DEFAULTS) <= vllm
