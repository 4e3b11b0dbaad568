"""LoRA adapters in the engine: greedy tokens and log probs equal transformers + PEFT with the adapter; a step
mixing adapters and the base gives each row what it gets alone; the prefix cache never crosses adapters."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from megatron_serve import DynamicInferenceRequest, InferenceConfig, SamplingParams
from megatron_serve.engine import DynamicInferenceEngine, scheduler
from megatron_serve.model.lora.checkpoint import LoraAdapterError
from megatron_serve.model.tiny import make_tiny_model

from ..hf_greedy import greedy_choices
from ..lora_adapters import make_peft_adapter, peft_model
from ..prompts import PROMPTS, run_requests, run_to_end

NEW_TOKENS = 12
RANKS = (4, 8, 16)


#: Both architectures for the comparison with PEFT (where each model's modules take the adapter: Qwen3's q/k norms
#: sit between q_proj and attention); the tests of slots, scheduling, loads and kernels run on Llama only, since
#: what they hold (rows grouped by adapter, slot and host tables, the prefix cache's keys) does not depend on the
#: model's layers, and the Qwen3 repetition of each cost as much as the Llama one.
ARCHS = ["llama", "qwen3"]


@pytest.fixture(scope="module")
def base(request, tmp_path_factory):
    arch = getattr(request, "param", "llama")
    return make_tiny_model(tmp_path_factory.mktemp(f"lora-{arch}"), seed=5, arch=arch)


@pytest.fixture(scope="module")
def adapters(base, tmp_path_factory):
    """Ranks 4, 8 and 16; the rank-4 one on attention only (its MLP rows stay the base's)."""
    root = tmp_path_factory.mktemp("adapters")
    return {f"r{rank}": str(make_peft_adapter(base, root / f"r{rank}", rank=rank, seed=rank,
                                              targets=["q_proj", "v_proj", "o_proj"] if rank == 4 else None))
            for rank in RANKS}


def _engine(base, adapters, **overrides) -> DynamicInferenceEngine:
    # a pool of 64 blocks holds every test's requests; sized by memory, each engine zeroed a pool of the tiny
    # model's whole context for every request slot
    config = dict(dtype="float32", block_size_tokens=16, num_kv_blocks=64, enable_lora=True, max_loras=4,
                  max_lora_rank=16, lora_modules=adapters)
    config.update(overrides)
    return DynamicInferenceEngine.from_model_dir(base, InferenceConfig(**config))


def _greedy(lora_name: str | None = None, tokens: int = NEW_TOKENS, **extra) -> SamplingParams:
    return SamplingParams(temperature=0.0, num_tokens_to_generate=tokens, ignore_eos=True, return_log_probs=True,
                          lora_name=lora_name, **extra)


def _reference(model, token_lists, generated_lists):
    """transformers + PEFT greedy with ``min_new_tokens``: end of text never chosen."""
    return greedy_choices(model, token_lists, generated_lists)


def assert_adapter_matches_peft(engine: DynamicInferenceEngine, base, adapter_dir, name: str, reference) -> None:
    """The engine's greedy tokens and log probs under adapter ``name`` are ``reference``'s (transformers + PEFT,
    float32, within 1e-4), and differ from the base model's (control: the adapter matters)."""
    prompts = PROMPTS[:4]
    token_lists = [engine.tokenizer.encode(p) for p in prompts]
    outs = run_requests(engine, [(p, _greedy(name)) for p in prompts])
    base_outs = run_requests(engine, [(p, _greedy()) for p in prompts])
    expected = reference(peft_model(base, adapter_dir), token_lists, [o.generated_tokens for o in outs])
    for out, (tokens, log_probs) in zip(outs, expected):
        assert out.generated_tokens == tokens
        assert out.generated_log_probs == pytest.approx(log_probs, abs=1e-4)
    assert [o.generated_tokens for o in outs] != [o.generated_tokens for o in base_outs], "control: the adapter matters"


@pytest.mark.parametrize("base", ARCHS, indirect=True)
@pytest.mark.parametrize("name", [f"r{rank}" for rank in RANKS])
def test_greedy_equals_transformers_with_peft(base, adapters, name):
    assert_adapter_matches_peft(_engine(base, adapters), base, adapters[name], name, _reference)


def test_a_mixed_batch_gives_each_row_what_it_gets_alone(base, adapters):
    engine = _engine(base, adapters)
    names = [None, "r4", "r8", "r16"]
    assert_mixed_batch_matches_alone(engine, [(prompt, _greedy(names[i % 4])) for i, prompt in enumerate(PROMPTS)])


def assert_mixed_batch_matches_alone(engine, jobs: list) -> None:
    """Each job run alone in ``engine`` generates the tokens (and, to 1e-5, the log probs) it generated stepped
    together with the others: rows of different adapters in one batch do not leak into each other."""
    together = run_requests(engine, jobs)
    for job, mixed in zip(jobs, together):
        alone, = run_requests(engine, [job])
        assert mixed.generated_tokens == alone.generated_tokens
        assert mixed.generated_log_probs == pytest.approx(alone.generated_log_probs, abs=1e-5)


@pytest.mark.parametrize("grouped", [True, False], ids=["grouped", "control-scheduler-order"])
def test_a_step_holds_each_adapters_rows_in_one_slice(base, adapters, grouped, monkeypatch):
    """Requests admitted interleaved (base, r4, r8, r16, base, ...): the prefill step and every decode step lay
    each adapter's rows side by side (base rows first), so the reference kernels multiply one slice per adapter;
    the scheduler's own order (the control) interleaves them."""
    if not grouped:
        monkeypatch.setattr(scheduler, "step_order", lambda entry: entry[1] != 1)
    engine = _engine(base, adapters)
    names = [None, "r4", "r8", "r16"]
    for i, prompt in enumerate(PROMPTS[:8]):
        engine.add_request(DynamicInferenceRequest(str(i), prompt, engine.tokenizer.encode(prompt),
                                                   _greedy(names[i % 4])))
    runs = []
    while engine.has_unfinished_requests():
        engine.step()
        runs.append(engine.worker.runner.lora_rows.batch.runs)
    assert len(runs) >= NEW_TOKENS
    if grouped:
        assert all(r[0] == -1 and sorted(r) == sorted(set(r)) and len(r) == 4 for r in runs), runs
    else:
        assert all(len(r) == 8 for r in runs), runs


def test_prefix_cache_does_not_cross_adapters(base, adapters):
    engine = _engine(base, adapters)
    prompt = PROMPTS[6]  # several complete blocks
    first, = run_requests(engine, [(prompt, _greedy("r8"))])
    cached_before = engine.load().cached_tokens
    other, = run_requests(engine, [(prompt, _greedy("r16"))])
    assert engine.load().cached_tokens == cached_before, "another adapter's blocks were reused"
    again, = run_requests(engine, [(prompt, _greedy("r8"))])
    assert engine.load().cached_tokens > cached_before, "control: the same adapter reuses its blocks"
    assert again.generated_tokens == first.generated_tokens


def test_load_and_unload_while_requests_run(base, adapters):
    """An adapter loaded mid-run serves the next request; one unloaded mid-run lets its running requests finish
    under it (their tokens are those of a run without the unload) and refuses new ones, naming it."""
    engine = _engine(base, {"r8": adapters["r8"]}, max_loras=2, max_cpu_loras=2)
    expected, = run_requests(engine, [(PROMPTS[1], _greedy("r8"))])
    running = DynamicInferenceRequest("running", PROMPTS[1], engine.tokenizer.encode(PROMPTS[1]), _greedy("r8"))
    engine.add_request(running)
    engine.step()
    engine.step()
    assert engine.has_unfinished_requests()
    engine.adapters.unload("r8")
    engine.adapters.load("r16", adapters["r16"])
    late = [DynamicInferenceRequest(name, PROMPTS[2], engine.tokenizer.encode(PROMPTS[2]), _greedy(name))
            for name in ("r8", "r16")]
    run_to_end(engine, late)
    assert running.generated_tokens == expected.generated_tokens
    assert late[0].finish_reason.value != "length" and "'r8' is not loaded" in str(late[0].error)
    alone, = run_requests(_engine(base, {"r16": adapters["r16"]}), [(PROMPTS[2], _greedy("r16"))])
    assert late[1].generated_tokens == alone.generated_tokens


def _broken_copy(adapter_dir: str, path, edit) -> str:
    """A copy of a PEFT adapter whose tensors ``edit`` changed."""
    shutil.copytree(adapter_dir, path)
    tensors = load_file(path / "adapter_model.safetensors")
    edit(tensors)
    save_file(tensors, path / "adapter_model.safetensors")
    return str(path)


def test_bad_adapter_loads_change_nothing(base, adapters, tmp_path):
    """Refused by name (rank above the maximum, a module the model lacks, a shape that does not fit, a path that
    does not exist, a name already served); the engine serves what it served, the same tokens."""
    engine = _engine(base, {"r8": adapters["r8"]}, max_lora_rank=8)
    before, = run_requests(engine, [(PROMPTS[0], _greedy("r8"))])
    head = _broken_copy(adapters["r8"], tmp_path / "head", lambda t: t.update(
        {"base_model.model.lm_head.lora_A.weight": torch.zeros(8, 64)}))
    wide_key = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    wide = _broken_copy(adapters["r8"], tmp_path / "wide", lambda t: t.update({wide_key: torch.zeros(8, 65)}))
    with pytest.raises(LoraAdapterError, match="rank 16 is above --max-lora-rank 8"):
        engine.adapters.load("big", adapters["r16"])
    with pytest.raises(LoraAdapterError, match="lm_head.lora_A.weight is not a LoRA weight"):
        engine.adapters.load("head", head)
    with pytest.raises(LoraAdapterError, match=r"layers.0.q_proj has lora_A \(8, 65\)"):
        engine.adapters.load("wide", wide)
    with pytest.raises(LoraAdapterError, match="gone' does not exist"):
        engine.adapters.load("gone", str(tmp_path / "gone"))
    with pytest.raises(LoraAdapterError, match="'r8' is already loaded"):
        engine.adapters.load("r8", adapters["r4"])
    assert engine.loras.names() == {"r8": adapters["r8"]}
    after, = run_requests(engine, [(PROMPTS[0], _greedy("r8"))])
    assert after.generated_tokens == before.generated_tokens


def test_verify_stages_the_adapter_that_load_then_serves(base, adapters, tmp_path):
    """The fleet's LOAD_LORA: verify reads and checks (serving nothing), load registers the staged copy (the
    directory may be gone by then); the heartbeat's report names the adapters of waiting and running requests."""
    engine = _engine(base, {}, max_loras=2, lora_allowed_dirs=[str(tmp_path), str(Path(adapters["r8"]).parent)])
    moved = tmp_path / "r8"
    shutil.copytree(adapters["r8"], moved)
    assert engine.adapters.verify("r8", str(moved)) >= 0 and engine.adapters.names() == {}
    shutil.rmtree(moved)
    assert engine.adapters.load("r8", str(moved)) >= 0 and engine.adapters.names() == {"r8": str(moved)}
    with pytest.raises(LoraAdapterError, match="'r8' is already loaded"):
        engine.adapters.verify("r8", adapters["r8"])
    assert engine.metrics_snapshot()["lora"] == {"max_loras": 2, "running": [], "waiting": []}
    requests = [DynamicInferenceRequest(f"q{i}", PROMPTS[0], engine.tokenizer.encode(PROMPTS[0]), _greedy(name))
                for i, name in enumerate(("r8", None))]
    for request in requests:
        engine.add_request(request)
    assert engine.metrics_snapshot()["lora"]["waiting"] == ["r8"]  # the base request names none
    engine.step()
    assert engine.metrics_snapshot()["lora"] == {"max_loras": 2, "running": ["r8"], "waiting": []}
    alone, = run_requests(_engine(base, {"r8": adapters["r8"]}), [(PROMPTS[0], _greedy("r8"))])
    while engine.has_unfinished_requests():
        engine.step()
    assert requests[0].generated_tokens == alone.generated_tokens
    assert sum(engine.stats.histograms["lora_adapter_load_seconds"].counts) == 1  # the one load, observed


def test_triton_kernels_serve_a_mixed_batch_like_the_reference(base, adapters, monkeypatch):
    """The engine through the Triton shrink/expand (interpreted on CPU) gives the reference's tokens: the mixed
    prefill and three mixed decode steps (the interpreter makes each step cost many eager ones)."""
    jobs = [(prompt, _greedy(name, tokens=4)) for prompt, name in zip(PROMPTS[:3], ["r4", None, "r16"])]
    monkeypatch.setenv("MEGATRON_KERNELS", "reference")
    expected = run_requests(_engine(base, adapters), jobs)
    monkeypatch.setenv("MEGATRON_KERNELS", "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    got = run_requests(_engine(base, adapters, enable_cuda_graphs=False), jobs)
    assert [o.generated_tokens for o in got] == [o.generated_tokens for o in expected]


def test_slots_go_to_idle_adapters_and_a_full_table_makes_the_request_wait(base, adapters):
    """Two slots for three adapters: the third takes the slot no running request uses; while both slots run,
    a request of a third adapter waits for one, then gets what it gets alone, and the others are unaffected."""
    engine = _engine(base, adapters, max_loras=2, max_cpu_loras=3)
    solo = _engine(base, adapters)  # one request at a time: each alone (the prefix cache never crosses adapters)
    alone = {name: run_requests(solo, [(PROMPTS[3], _greedy(name))])[0].generated_tokens
             for name in ("r4", "r8", "r16")}
    for name in ("r4", "r8", "r16", "r4"):  # one at a time: each reuses an idle slot
        out, = run_requests(engine, [(PROMPTS[3], _greedy(name))])
        assert out.generated_tokens == alone[name]
    together = run_requests(engine, [(PROMPTS[3], _greedy("r4")), (PROMPTS[3], _greedy("r8")),
                                     (PROMPTS[3], _greedy("r16"))])
    assert [o.generated_tokens for o in together] == [alone["r4"], alone["r8"], alone["r16"]]
    assert [o.error for o in together] == [None, None, None]


def test_a_request_waits_for_the_one_slot_and_is_reported_waiting(base, adapters):
    """--max-loras 1 with two adapters in flight: the second waits (counted among the waiting requests and in the
    heartbeat's waiting adapters) while the first runs, then runs alone in the slot; an aborted waiter leaves."""
    engine = _engine(base, adapters, max_loras=1)
    solo = _engine(base, adapters)  # one request at a time: each alone (the prefix cache never crosses adapters)
    alone = {name: run_requests(solo, [(PROMPTS[3], _greedy(name))])[0].generated_tokens
             for name in ("r4", "r8")}
    first = DynamicInferenceRequest("a", PROMPTS[3], engine.tokenizer.encode(PROMPTS[3]), _greedy("r4"))
    second = DynamicInferenceRequest("b", PROMPTS[3], engine.tokenizer.encode(PROMPTS[3]), _greedy("r8"))
    third = DynamicInferenceRequest("c", PROMPTS[3], engine.tokenizer.encode(PROMPTS[3]), _greedy("r16"))
    for request in (first, second, third):
        engine.add_request(request)
    engine.step()
    assert (engine.load().running, engine.load().waiting) == (1, 2)
    assert engine.metrics_snapshot()["lora"] == {"max_loras": 1, "running": ["r4"], "waiting": ["r16", "r8"]}
    assert engine.abort_request("c") is third
    assert engine.load().waiting == 1
    first_tokens_when_second_started = None
    while engine.has_unfinished_requests():
        engine.step()
        if second.generated_tokens and first_tokens_when_second_started is None:
            first_tokens_when_second_started = len(first.generated_tokens)
    assert first_tokens_when_second_started == NEW_TOKENS  # it waited for the first to finish
    assert (first.generated_tokens, second.generated_tokens) == (alone["r4"], alone["r8"])
    assert (first.error, second.error) == (None, None)
    assert engine.metrics_snapshot()["lora"]["waiting"] == []


def test_every_adapter_given_at_start_is_loaded_and_beyond_the_host_limit_the_least_recent_leaves(base, adapters):
    """Three --lora-modules with one slot: all three load (the host limit defaults to their count) and each serves
    in turn from the one slot. A fourth load evicts the least recently used one's host copy (issue 54, as vLLM's
    LRU of CPU LoRAs): its name stays served, and a request naming it reads it again from its directory, with the
    tokens it had (==)."""
    engine = _engine(base, adapters, max_loras=1)
    assert sorted(engine.loras.names()) == ["r16", "r4", "r8"]
    outs = {name: run_requests(engine, [(PROMPTS[5], _greedy(name))])[0] for name in ("r4", "r8", "r16")}
    assert all(o.finish_reason.value == "length" for o in outs.values())
    assert outs["r4"].generated_tokens != outs["r8"].generated_tokens, "control: the adapters differ"
    engine.adapters.load("more", adapters["r4"])
    assert list(engine.loras.resident) == ["r8", "r16", "more"] and engine.loras.evicted == {"r4": (adapters["r4"], 0)}
    with pytest.raises(LoraAdapterError, match="'r4' is already loaded"):  # its host copy left, its name did not
        engine.adapters.load("r4", adapters["r8"])
    assert list(engine.loras.resident) == ["r8", "r16", "more"] and engine.loras.evicted == {"r4": (adapters["r4"], 0)}
    assert sorted(engine.loras.names()) == ["more", "r16", "r4", "r8"]
    again, = run_requests(engine, [(PROMPTS[5], _greedy("r4"))])
    assert again.generated_tokens == outs["r4"].generated_tokens
    assert list(engine.loras.resident) == ["r16", "more", "r4"] and set(engine.loras.evicted) == {"r8"}
