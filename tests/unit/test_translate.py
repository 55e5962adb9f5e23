"""OpenAI JSON -> GenerationParams + token-id prompts: the one translation at the edge."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from core.config import Settings
from core.errors import DomainError
from core.generation.prompt import Prompt
from core.infra.tokenizers import tokenizer_for
from core.protocol.schemas import ChatCompletionRequest, CompletionRequest
from core.protocol.translate import chat_to_generation, reservation, to_generation

MODEL = "smollm2-135m-instruct"
SETTINGS = Settings(n_ctx=1024)


@pytest.fixture(scope="module")
def tok():
    return tokenizer_for(MODEL)


def translate(tok, **kw):
    req = CompletionRequest.model_validate({"model": MODEL, "prompt": "p", **kw})
    return to_generation(req, SETTINGS, tok)


def test_defaults_follow_openai(tok):
    p, prompts = translate(tok)
    assert (p.max_tokens, p.temperature, p.top_p, p.n, p.best_of, p.stop) == (16, 1.0, 1.0, 1, 1, ())
    assert isinstance(p.seed, int)  # chosen at the edge, so a resumed attempt replays
    assert prompts == [Prompt(tok.encode("p"), "p")]
    assert prompts[0].to_json() == {"ids": tok.encode("p"), "text": "p"}  # the stored shape, unchanged


def test_null_and_minus_one_max_tokens_mean_rest_of_context(tok):
    assert translate(tok, max_tokens=None)[0].max_tokens is None
    assert translate(tok, max_tokens=-1)[0].max_tokens is None
    assert translate(tok, max_tokens=0)[0].max_tokens == 0


def test_aliases(tok):
    p, _ = translate(tok, repeat_penalty=1.3, mirostat=2, mirostat_target=3.0, mirostat_lr=0.2, logprobs=True)
    assert (p.repetition_penalty, p.mirostat_tau, p.mirostat_eta, p.logprobs) == (1.3, 3.0, 0.2, 1)
    assert translate(tok, logprobs=False)[0].logprobs is None


@pytest.mark.parametrize(
    ("prompt", "count"),
    [("a", 1), (["a", "b"], 2), ([1, 2], 1), ([[1], [2, 3]], 2), ([1, "a", 2], 1), (["a", [1, "b"]], 2)],
)
def test_prompt_forms(tok, prompt, count):
    _, prompts = translate(tok, prompt=prompt)
    assert len(prompts) == count


def test_mixed_prompt_concatenates_pieces(tok):
    _, prompts = translate(tok, prompt=[504, " capital", 282])
    assert prompts[0].ids == [504, *tok.encode(" capital", add_special=True), 282]


@pytest.mark.parametrize(
    ("kw", "param"),
    [
        ({"prompt": [10**6]}, "prompt"),
        ({"best_of": 1, "n": 2}, "best_of"),
        ({"best_of": 3, "stream": True}, "best_of"),
        ({"min_tokens": 10, "max_tokens": 5}, "min_tokens"),
        ({"logit_bias": [["abc", 101]]}, "logit_bias"),
        ({"logit_bias": [[5, True]]}, "logit_bias"),
        ({"logit_bias": [[1.5, 1]]}, "logit_bias"),
        ({"logit_bias": {"": 1}}, "logit_bias"),
        ({"logit_bias": [[99999999, 1]]}, "logit_bias"),
        ({"logit_bias": [["abc", True]]}, "logit_bias"),
        ({"logit_bias": {"99999999": 1}}, "logit_bias"),
        ({"suffix": "x"}, "suffix"),
        ({"images": ["data:image/png;base64,AAAA"]}, "images"),
        ({"regex": "[a-"}, "regex"),
        ({"grammar": "root ::= ("}, "grammar"),
        ({"json_schema": {"type": "bogus"}}, "json_schema"),
        ({"regex": "a", "guided_choice": ["b"]}, "regex"),
        ({"response_format": {"type": "xml"}}, "response_format"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
        ({"max_tokens": 2000}, "max_tokens"),
        ({"prompt": "word " * 1100, "max_tokens": 5}, "prompt"),
        ({"prompt": ["a"] * 20, "n": 10}, "n"),
    ],
)
def test_refused_with_the_parameter_named(tok, kw, param):
    with pytest.raises(DomainError) as err:
        translate(tok, **kw)
    assert err.value.kind == "invalid" and err.value.param == param, err.value.message


def test_context_overflow_choices(tok):
    long = "word " * 1100
    assert translate(tok, max_tokens=2000, context_length_exceeded_behavior="truncate")[0].max_tokens == 2000
    _, prompts = translate(tok, prompt=long, max_tokens=10, truncate_sequence=True)
    assert len(prompts[0].ids) == 1024 - 10
    assert prompts[0].ids == tok.encode(long)[-(1024 - 10) :]  # cut from the left


@pytest.mark.parametrize(
    "bad",
    [
        {"max_tokens": "5"},
        {"temperature": 2.5},
        {"n": 129},
        {"stop": ["a"] * 17},
        {"prompt": []},
        {"prompt": [[]]},
        {"prompt": [-1]},
        {"stream": 1},
        {"mirostat": 3},
        {"logprobs": 6},
        {"top_p": 1.5},
    ],
)
def test_schema_rejects(bad):
    with pytest.raises(ValidationError):
        CompletionRequest.model_validate({"model": MODEL, "prompt": "p", **bad})


def test_unknown_fields_are_collected_not_silently_used():
    req = CompletionRequest.model_validate({"model": MODEL, "prompt": "p", "frobnicate": 1})
    assert req.unknown_fields() == ["frobnicate"]


class FimTokenizer:
    """A tokenizer stand-in with fill-in-the-middle tokens (SmolLM2 has none)."""

    n_vocab = 100
    train_context = 64
    eos = 0

    def encode(self, text, *, add_special=True):
        return [10 + (ord(c) % 50) for c in text]

    def fim_tokens(self):
        return (1, 2, 3)


def test_suffix_builds_a_fill_in_the_middle_prompt():
    req = CompletionRequest.model_validate({"model": MODEL, "prompt": "ab", "suffix": "c", "max_tokens": 4})
    _, prompts = to_generation(req, SETTINGS, FimTokenizer())
    assert prompts == [Prompt([1, 10 + ord("a") % 50, 10 + ord("b") % 50, 2, 10 + ord("c") % 50, 3])]


def test_a_parameter_the_engine_cannot_honour_is_refused_by_name(tok):
    req = CompletionRequest.model_validate({"model": MODEL, "prompt": "p", "mirostat": 1})
    with pytest.raises(DomainError) as err:
        to_generation(req, Settings(n_ctx=1024, engine="exllamav2"), tok)
    assert err.value.param == "mirostat" and err.value.code == "unsupported_parameter"
    to_generation(req, SETTINGS, tok)  # llama.cpp has Mirostat 1


def test_gpu_cache_size_bounds_admission(tok):
    small = Settings(n_ctx=1024, engine="exllamav2", exl2_cache_tokens=256)
    req = CompletionRequest.model_validate({"model": MODEL, "prompt": "word " * 200, "max_tokens": 100})
    with pytest.raises(DomainError) as err:
        to_generation(req, small, tok)
    assert err.value.code == "context_length_exceeded" and "256" in err.value.message


def test_logit_bias_key_of_non_ascii_digits_is_a_text_not_a_crash(tok):
    # int("²") fails; a key that is not an ASCII integer is a text (llama.cpp: strtol, then tokenize).
    assert translate(tok, logit_bias={"²": 1.0})[0].logit_bias == dict.fromkeys(tok.encode("²", add_special=False), 1.0)


def test_dry_sequence_breakers_are_bounded():
    with pytest.raises(ValidationError):
        CompletionRequest.model_validate({"model": MODEL, "prompt": "p", "dry_sequence_breakers": ["x"] * 17})
    with pytest.raises(ValidationError):
        CompletionRequest.model_validate({"model": MODEL, "prompt": "p", "dry_sequence_breakers": ["x" * 65]})


def test_response_size_is_bounded_naming_the_limit(tok):
    # 6 prompts x 20 choices x 1,000 tokens x (5 + 1) entries = 720,000: past the 200,000 default.
    with pytest.raises(DomainError) as err:
        translate(tok, prompt=["p"] * 6, n=20, logprobs=5, max_tokens=1000)
    assert err.value.param == "logprobs" and err.value.code == "response_too_large"
    assert "200000" in err.value.message
    translate(tok, n=2, logprobs=5, max_tokens=100)  # an ordinary scoring request is fine


def test_llamacpp_native_names_are_aliases_or_refused_by_name(tok):
    p, _ = translate(tok, n_predict=7, n_probs=2, repeat_last_n=64, repetition_penalty=1.1)
    assert (p.max_tokens, p.logprobs, p.penalty_last_n) == (7, 2, 64)
    with pytest.raises(DomainError) as err:
        translate(tok, n_keep=10)
    assert err.value.param == "n_keep" and err.value.code == "unsupported_parameter"


def test_integral_floats_are_integers_and_others_refused(tok):
    p, _ = translate(tok, max_tokens=16.0, n=2.0, seed=3.0)
    assert (p.max_tokens, p.n, p.seed) == (16, 2, 3)
    with pytest.raises(ValidationError):
        CompletionRequest.model_validate({"model": MODEL, "prompt": "p", "max_tokens": 16.5})


def test_mirostat_target_alone_turns_mirostat_2_on(tok):
    p, _ = translate(tok, mirostat_target=3.0)
    assert (p.mirostat, p.mirostat_tau) == (2, 3.0)
    assert translate(tok, mirostat_lr=0.2)[0].mirostat == 2
    assert translate(tok, mirostat=0, mirostat_target=3.0)[0].mirostat == 0  # an explicit off stays off
    assert translate(tok)[0].mirostat == 0


def test_negative_seed_is_no_seed_and_every_other_seed_replays(tok):
    a, b = translate(tok, seed=-1)[0], translate(tok, seed=-1)[0]
    assert a.seed != b.seed  # random, but on record: a resumed attempt stays seeded
    big = translate(tok, seed=4294967295)[0]
    assert big.seed == 4294967295


def test_tools_on_completions_are_refused_not_ignored(tok):
    with pytest.raises(DomainError) as err:
        translate(tok, tools=[{"type": "function", "function": {"name": "f"}}])
    assert err.value.param == "tools"


# -- chat: its own defaults and ranges, not completions' ---------------------------------------------


def chat(tok, **kw):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **kw}
    return chat_to_generation(ChatCompletionRequest.model_validate(body), SETTINGS, tok, tok.chat_template())


def test_chat_without_max_tokens_runs_to_the_context_end_and_reserves_it(tok):
    params, prompts, _ = chat(tok)
    assert params.max_tokens is None  # not completions' 16: OpenAI and vLLM stop at the model's end
    n = len(prompts[0].ids)
    # Rate limits reserve what it may really cost: the whole room left in the context, per candidate.
    assert reservation(params, prompts, 1024) == 1024
    assert reservation(chat(tok, n=3)[0], prompts, 1024) == n + 3 * (1024 - n)
    for kw in ({"continue_final_message": True}, {"response_format": {"type": "json_object"}}):
        msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello"}]
        assert chat(tok, messages=msgs, **kw)[0].max_tokens is None
    assert chat(tok, max_tokens=7)[0].max_tokens == 7
    assert chat(tok, max_completion_tokens=9)[0].max_tokens == 9
    assert chat(tok, max_tokens=None)[0].max_tokens is None
    assert translate(tok)[0].max_tokens == 16  # legacy completions keep OpenAI's 16


def test_chat_top_logprobs_goes_to_20_and_completions_stay_at_5(tok):
    params, _, meta = chat(tok, logprobs=True, top_logprobs=20, max_tokens=5)
    assert params.logprobs == 20 and meta["top_logprobs"] == 20
    assert chat(tok, logprobs=True, max_tokens=5)[0].logprobs == 0
    with pytest.raises(ValidationError):
        CompletionRequest.model_validate({"model": MODEL, "prompt": "p", "logprobs": 6})


def test_chat_logprobs_past_the_response_bound_name_top_logprobs(tok):
    with pytest.raises(DomainError) as err:
        chat(tok, logprobs=True, top_logprobs=20, n=20)
    assert err.value.param == "top_logprobs" and err.value.code == "response_too_large"


def test_a_forced_tool_call_names_its_functions_for_rendering(tok):
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
    named = {"type": "function", "function": {"name": "get_weather"}}
    assert chat(tok, tools=[tool], tool_choice=named)[2]["forced"] == ["get_weather"]
    assert chat(tok, tools=[tool], tool_choice="required")[2]["forced"] == ["get_weather"]
    assert "forced" not in chat(tok, tools=[tool])[2]  # auto: the model may answer in words
