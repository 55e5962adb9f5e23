"""The `openai` SDK's own chat parameters on the wire (core/protocol/sdk_params.py): every accepted one
at once in one short request answers a completion, and each refused one is a 400 naming it."""

from __future__ import annotations

import pytest

from tests.conftest import MODEL

FUNCTION = {"name": "get_weather", "description": "The weather in a city.", "parameters": {"type": "object"}}


@pytest.fixture
def client(stack):
    import openai  # a heavy import, only where it is used (CONTRIBUTING: Tests)

    return openai.OpenAI(base_url=stack.base_url + "/v1", api_key=stack.keys["alpha"], max_retries=0)


def test_every_accepted_chat_parameter_at_once_through_the_sdk(client):
    r = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Say hi."}],
        max_completion_tokens=3,
        temperature=0,
        top_p=0.9,
        seed=7,
        n=1,
        stop=["\n\n"],
        frequency_penalty=0.1,
        presence_penalty=0.1,
        logit_bias={"42": 1},
        logprobs=True,
        top_logprobs=1,
        user="u-1",
        response_format={"type": "text"},
        functions=[FUNCTION],
        function_call="auto",
        metadata={"app": "spool-e2e"},
        store=True,
        service_tier="flex",
        prompt_cache_key="tenant-alpha-greeting",
        prompt_cache_retention="24h",
        prompt_cache_options={"mode": "implicit", "ttl": "30m"},
        safety_identifier="hashed-user-1",
        reasoning_effort="low",
        verbosity="low",
        modalities=["text"],
        prediction={"type": "content", "content": "Hi"},
        moderation={"model": "omni-moderation-latest"},
    )
    [choice] = r.choices
    assert choice.finish_reason in ("length", "stop", "tool_calls")
    assert r.usage is not None and 1 <= r.usage.completion_tokens <= 3
    assert choice.logprobs is not None and choice.logprobs.content  # logprobs honoured beside the rest
    assert r.service_tier == "flex"  # served at the tier it asked for, and says so (core/jobs/tiers.py)


@pytest.mark.parametrize(
    ("kw", "param", "why"),
    [
        ({"audio": {"format": "wav", "voice": "alloy"}}, "audio", "text only"),
        ({"modalities": ["text", "audio"]}, "modalities", "text only"),
        ({"web_search_options": {"search_context_size": "low"}}, "web_search_options", "web search"),
    ],
)
def test_a_refused_chat_parameter_is_a_400_naming_it_and_saying_why(client, kw, param, why):
    import openai

    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=1, **kw)
    assert (e.value.param, e.value.code) == (param, "unsupported_parameter")
    assert why in e.value.message and "Unrecognized" not in e.value.message
