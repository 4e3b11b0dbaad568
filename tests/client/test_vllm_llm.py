"""vLLM's ``LLM`` as vLLM users write it: ``megatron_serve.LLM`` with vLLM's keywords and ``RequestOutput`` results.

Before this work (issue 41) ``MegatronLLM(model, max_model_len=...)`` and ``generate(..., use_tqdm=False)``
raised ``TypeError``, ``out.outputs[0].text`` ``AttributeError``, ``{"prompt_token_ids": [...]}``
``ValueError``, and ``n=2`` over 2 prompts gave a flat list of 4 results.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from megatron_serve import LLM, InferenceConfig, MegatronLLM, RequestOutput, SamplingParams
from megatron_serve.client.vllm_args import parse_llm_keywords

pytestmark = pytest.mark.timeout(600)

#: A vLLM offline script as its users write it; the test changes its import line only.
VLLM_SCRIPT = '''\
import json
import sys

from vllm import LLM, SamplingParams

llm = LLM(model=sys.argv[1], tokenizer=sys.argv[1], dtype="float32", max_model_len=256, tensor_parallel_size=1,
          data_parallel_size=1, gpu_memory_utilization=0.2, enforce_eager=True, enable_prefix_caching=True,
          max_num_seqs=16, max_num_batched_tokens=512, seed=0, quantization=None, kv_cache_dtype="auto",
          trust_remote_code=True)
prompts = ["Hello, my name is", "The capital of France is"]
greedy = SamplingParams(temperature=0.0, max_tokens=8)
result = {"greedy": [], "tokens": [], "sampled": [], "chat": []}
for output in llm.generate(prompts, greedy, use_tqdm=False):
    result["greedy"].append([output.prompt, output.prompt_token_ids, output.outputs[0].text,
                             output.outputs[0].token_ids, output.outputs[0].finish_reason])
for output in llm.generate([{"prompt_token_ids": [5, 6, 7, 8]}, {"prompt_token_ids": [9, 10]}], greedy,
                           use_tqdm=False):
    result["tokens"].append([output.prompt_token_ids, output.outputs[0].token_ids])
sampled = SamplingParams(n=2, temperature=1.0, top_p=0.95, seed=7, max_tokens=8)
for output in llm.generate(prompts, sampled, use_tqdm=False):
    result["sampled"].append([[c.index, c.text, c.token_ids] for c in output.outputs])
conversation = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say hi"}]
for output in llm.chat(conversation, greedy, use_tqdm=False):
    result["chat"].append([output.prompt, output.outputs[0].text])
tokenizer = llm.get_tokenizer()
result["encoded"] = tokenizer.encode("Hello, my name is")
result["rendered"] = tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
print(json.dumps(result))
'''

PROMPTS = ["Hello, my name is", "The capital of France is"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8)
SAMPLED = SamplingParams(n=2, temperature=1.0, top_p=0.95, seed=7, max_tokens=8)
CONVERSATION = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say hi"}]


def test_a_vllm_offline_script_runs_unchanged_but_for_the_import(tiny_llama, tmp_path):
    script = tmp_path / "offline.py"
    script.write_text(VLLM_SCRIPT.replace("from vllm import", "from megatron_serve import"))
    assert script.read_text().count("megatron_serve") == 1  # the only change
    done = subprocess.run([sys.executable, str(script), tiny_llama], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert "trust_remote_code is accepted for vLLM compatibility and changes nothing" in done.stderr

    # The native API, same model and settings: the same tokens and texts.
    config = InferenceConfig(dtype="float32", max_sequence_length=256, kv_cache_memory_fraction=0.2,
                             enable_cuda_graphs=False, max_requests=16, max_batch_tokens=512, seed=0)
    with MegatronLLM(tiny_llama, config) as native:
        greedy = native.generate(PROMPTS, GREEDY)
        tokens = native.generate([[5, 6, 7, 8], [9, 10]], GREEDY)
        sampled = native.generate(PROMPTS, SAMPLED)
        (chat,) = native.chat(CONVERSATION, GREEDY)
        hf = native.tokenizer.hf_tokenizer
    assert got["greedy"] == [[r.prompt, r.prompt_tokens, r.generated_text, r.generated_tokens, "length"]
                             for r in greedy]
    assert got["tokens"] == [[r.prompt_tokens, r.generated_tokens] for r in tokens]
    flat = [[i % 2, r.generated_text, r.generated_tokens] for i, r in enumerate(sampled)]
    assert got["sampled"] == [flat[:2], flat[2:]]  # n grouped per prompt, prompt by prompt
    assert got["sampled"][0][0][2] != got["sampled"][0][1][2]  # seeded choices differ
    assert got["chat"] == [[chat.prompt, chat.generated_text]]
    assert got["encoded"] == hf.encode("Hello, my name is")
    assert got["rendered"] == chat.prompt


@pytest.fixture(scope="module")
def llm(tiny_llama):
    with LLM(tiny_llama, gpu_memory_utilization=0.2, max_model_len=128, enforce_eager=True) as llm:
        yield llm


def test_results_are_request_outputs_with_the_records_beside(llm):
    params = SamplingParams(max_tokens=5, temperature=0, logprobs=2, stop_token_ids=[])
    (out,) = llm.generate("Hello", params, use_tqdm=False)
    assert isinstance(out, RequestOutput) and out.finished and out.prompt == "Hello"
    (choice,) = out.outputs
    record = choice.request
    assert (choice.index, choice.text, choice.token_ids, choice.finish_reason, choice.stop_reason) == (
        0, record.generated_text, record.generated_tokens, "length", None)
    assert choice.policy_epochs == record.policy_epochs and len(choice.policy_epochs) == 5  # Megatron's, beside
    assert choice.cumulative_logprob == sum(record.generated_log_probs)
    for token, entry, log_prob in zip(choice.token_ids, choice.logprobs, record.generated_log_probs):
        assert entry[token].logprob == log_prob and len(entry) in (2, 3)  # the sampled one and the 2 likeliest
        assert sorted(e.rank for e in entry.values() if e.rank is not None)[:2] == [1, 2]
        assert entry[token].decoded_token == llm.tokenizer.token_text(token)
    stop_id = record.generated_tokens[1]
    stopped = llm.generate("Hello", SamplingParams(max_tokens=8, temperature=0, stop_token_ids=[stop_id]),
                           use_tqdm=False)[0].outputs[0]
    # as vLLM's: token_ids end with the stop token, stop_reason names it
    assert (stopped.finish_reason, stopped.stop_reason, stopped.token_ids) == ("stop", stop_id,
                                                                               record.generated_tokens[:2])
    assert stopped.text == llm.tokenizer.decode(record.generated_tokens[:1])  # its text is not in the text
    word = llm.tokenizer.decode(record.generated_tokens[2:4])
    (by_word,) = llm.generate("Hello", SamplingParams(max_tokens=8, temperature=0, stop=[word, "never there"]),
                              use_tqdm=False)
    assert (by_word.outputs[0].finish_reason, by_word.outputs[0].stop_reason) == ("stop", word)


def test_scoring_through_prompt_logprobs(llm):
    text = "The quick brown fox jumps over the lazy dog"
    (out,) = llm.generate(text, SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0), use_tqdm=False)
    (native,) = MegatronLLM.generate(llm, text, SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0))
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(out.prompt_token_ids)
    assert [entry[token].logprob for entry, token in zip(out.prompt_logprobs[1:], out.prompt_token_ids[1:])] == \
        native.prompt_log_probs
    assert llm.generate(text, GREEDY, use_tqdm=False)[0].prompt_logprobs is None  # not asked


def test_prompt_shapes_and_their_refusals(llm):
    tokens = llm.get_tokenizer().encode("Hello")
    by_text, by_ids, by_dict, by_text_dict = llm.generate(
        ["Hello", tokens, {"prompt_token_ids": tokens}, {"prompt": "Hello"}], GREEDY, use_tqdm=False)
    assert by_text.outputs[0].token_ids == by_ids.outputs[0].token_ids == by_dict.outputs[0].token_ids == \
        by_text_dict.outputs[0].token_ids
    assert (by_dict.prompt, by_text_dict.prompt) == (None, "Hello")
    (single,) = llm.generate({"prompt_token_ids": tokens}, GREEDY, use_tqdm=False)
    assert single.prompt_token_ids == tokens
    with pytest.raises(ValueError, match="'multi_modal_data' beside 'prompt_token_ids'"):
        llm.generate({"prompt_token_ids": tokens, "multi_modal_data": {}}, use_tqdm=False)
    with pytest.raises(TypeError, match=r"prompts\[1\]\['prompt_token_ids'\] must be"):
        llm.generate(["Hi", {"prompt_token_ids": "Ho"}], use_tqdm=False)
    with pytest.raises(ValueError, match=r"The decoder prompt cannot be empty \(prompts\[1\]\['prompt_token_ids'\]"):
        llm.generate(["Hi", {"prompt_token_ids": []}], use_tqdm=False)
    with pytest.raises(TypeError, match="lora_request must be a LoRARequest"):
        llm.generate("Hi", GREEDY, lora_request=object())
    with pytest.raises(ValueError, match="priority holds 1 values for 2 prompts"):
        llm.generate(["Hi", "Ho"], GREEDY, use_tqdm=False, priority=[1])
    first, second = llm.generate(["Hi", "Ho"], GREEDY, use_tqdm=False, priority=[1, -1])
    assert (first.outputs[0].request.sampling_params.priority, second.outputs[0].request.sampling_params.priority) \
        == (1, -1)


class _Bar:
    """A tqdm-like class, as vLLM's ``use_tqdm`` takes: records how it was made and stepped."""

    made: list[dict] = []

    def __init__(self, **kwargs):
        self.steps = 0
        self.closed = False
        _Bar.made.append(self)
        self.kwargs = kwargs

    def update(self, count):
        self.steps += count

    def close(self):
        self.closed = True


def test_use_tqdm_shows_processed_prompts(llm, capsys):
    outs = llm.generate(["Hello", "Hi", "Ho"], SamplingParams(n=2, max_tokens=2, temperature=1.0, seed=1),
                        use_tqdm=_Bar)
    (bar,) = _Bar.made
    assert len(outs) == 3 and [len(o.outputs) for o in outs] == [2, 2, 2]
    assert (bar.kwargs["total"], bar.kwargs["desc"], bar.steps, bar.closed) == (3, "Processed prompts", 3, True)
    llm.generate("Hello", GREEDY)  # vLLM's default: tqdm's own bar, on stderr
    assert "Processed prompts: 100%" in capsys.readouterr().err
    llm.generate("Hello", GREEDY, use_tqdm=False)
    assert "Processed prompts" not in capsys.readouterr().err


@pytest.mark.parametrize("kwargs,error,match", [
    ({"speculative_config": "ngram"}, ValueError, "speculative_config='ngram': must be a dict"),
    ({"max_lora_rank": 0}, ValueError, "max_lora_rank=0: must be a positive integer"),
    ({"pipeline_parallel_size": 0}, ValueError, "pipeline_parallel_size=0: must be a positive integer"),
    ({"quantization": "awq"}, ValueError, "quantization='awq': not supported by this build"),
    ({"kv_cache_dtype": "fp8_e5m2"}, ValueError, "kv_cache_dtype='fp8_e5m2': not supported by this build"),
    ({"max_num_seqs": "8"}, ValueError, "max_num_seqs='8': must be a positive integer"),
    ({"enforce_eager": "yes"}, ValueError, "enforce_eager='yes': must be True or False"),
    ({"gpu_memory_utilization": 90}, ValueError, "gpu_memory_utilization=90: must be a fraction"),
    ({"load_format": "pt"}, ValueError, "load_format='pt': expected one of auto, safetensors"),
    ({"api_key": "x"}, ValueError, "api_key is taken by megatron-serve run/serve, not by LLM"),
    ({"max_logprobs": 5}, ValueError, "max_logprobs is taken by megatron-serve run/serve, not by LLM"),
    ({"max_modle_len": 64}, TypeError, "unexpected keyword argument 'max_modle_len'"),
    ({"dtype": "float64"}, ValueError, "dtype='float64'"),
    ({"data_parallel_size": 0}, ValueError, "data_parallel_size=0: must be a positive integer"),
    ({"long_prefill_token_threshold": -1}, ValueError, "long_prefill_token_threshold=-1: must be a non-negative"),
    ({"max_long_partial_prefills": 0}, ValueError, "max_long_partial_prefills=0: must be a positive integer"),
])
def test_constructor_keywords_are_refused_by_name(tiny_llama, kwargs, error, match):
    with pytest.raises(error, match=match):
        LLM(tiny_llama, **kwargs)


def test_keywords_that_start_a_fleet():
    assert (parse_llm_keywords({}).use_coordinator, parse_llm_keywords({}).num_engines) == (False, 1)
    two = parse_llm_keywords({"data_parallel_size": 2, "pipeline_parallel_size": 1})
    assert (two.use_coordinator, two.num_engines) == (True, 2)
    # vLLM's data parallelism with expert parallelism: one group of two attention ranks sharing the experts
    gang = parse_llm_keywords({"data_parallel_size": 2, "enable_expert_parallel": True})
    assert (gang.use_coordinator, gang.num_engines, gang.config["data_parallel_size"]) == (True, 1, 2)
    assert "data_parallel_size" not in two.config
    sleepy = parse_llm_keywords({"enable_sleep_mode": True})
    assert (sleepy.use_coordinator, sleepy.num_engines) == (True, 1)
    accepted = parse_llm_keywords({"disable_frontend_multiprocessing": True, "tokenizer_mode": "auto"})
    assert [line.split(" is ")[0] for line in accepted.warnings] == ["disable_frontend_multiprocessing",
                                                                    "tokenizer_mode"]


def test_constructor_keywords_reach_the_engine(tiny_llama, caplog):
    with LLM(tiny_llama, max_model_len=64, max_num_seqs=3, max_num_batched_tokens=128, block_size=8,
             num_gpu_blocks_override=40, enable_prefix_caching=False, seed=5, swap_space=2,
             speculative_config=None, enable_lora=False, long_prefill_token_threshold=24,
             max_long_partial_prefills=2) as llm:
        config = llm.engine.config
        assert (config.max_sequence_length, config.max_requests, config.max_batch_tokens, config.block_size_tokens,
                config.num_kv_blocks, config.enable_prefix_caching, config.seed) == (64, 3, 128, 8, 40, False, 5)
        scheduler = llm.engine.scheduler
        assert (scheduler.long_prefill_token_threshold, scheduler.max_long_partial_prefills) == (24, 2)
        assert llm.engine.load().kv_blocks_total == 40
    assert [r.getMessage() for r in caplog.records if "accepted for vLLM" in r.getMessage()] == [
        "swap_space is accepted for vLLM compatibility and changes nothing: preempted requests are recomputed, "
        "never swapped to host memory"]  # None/False are vLLM's defaults: nothing to warn about


def test_data_parallel_attention_runs_as_a_fleet_of_one_gang(tiny_llama, tmp_path):
    """``InferenceConfig(data_parallel_size=2, enable_expert_parallel=True)`` in coordinator mode: the fleet started
    here is one group of two engine processes (each its rank); in this process it cannot run, and says so."""
    from megatron_serve.api.fleet_client import FleetClient

    config = InferenceConfig(enable_expert_parallel=True, data_parallel_size=2)
    client = FleetClient(None, model=tiny_llama, inference_config=config)
    try:
        fleet = client.fleet
        assert (fleet.groups, fleet.num_engines, fleet.data_parallel_size) == (1, 2, 2)
        assert fleet.engine_args[-2:] == ["--data-parallel-size", "2"]
    finally:
        fleet.kill()
    with pytest.raises(ValueError, match="data_parallel_size 2 is data-parallel attention: an engine process per "
                                         "rank, which a fleet starts"):
        MegatronLLM(tiny_llama, config)
