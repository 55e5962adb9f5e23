"""An `openai-agents` agent with one function tool, run to completion against Spool's Responses API
(the real SmolLM2: the call is forced on the first turn, and the Agents SDK then lets the model
answer with the tool's result)."""

from __future__ import annotations

import asyncio
import importlib.util

import pytest

from tests.conftest import MODEL

# Imported in the test, not here: the Agents SDK takes ~1.5 CPU s to import, and every pytest process
# of a run (each shard's) collects this module; only one runs it.
pytestmark = pytest.mark.skipif(importlib.util.find_spec("agents") is None, reason="openai-agents is not installed")


def test_an_agent_with_a_function_tool_runs_to_completion(stack):
    import agents
    from openai import AsyncOpenAI

    calls: list[str] = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        calls.append(city)
        return f"It is 21 degrees and sunny in {city}."

    async def run() -> agents.RunResult:
        client = AsyncOpenAI(base_url=stack.base_url + "/v1", api_key=stack.keys["alpha"], max_retries=0)
        agent = agents.Agent(
            name="weather",
            instructions="You answer questions about the weather. Use the get_weather tool.",
            tools=[get_weather],
            model=agents.OpenAIResponsesModel(model=MODEL, openai_client=client),
            # The first turn must call the tool; the SDK resets the choice to `auto` after the call
            # (reset_tool_choice), so the second turn can answer in text.
            model_settings=agents.ModelSettings(tool_choice="required", max_tokens=60, temperature=0),
        )
        try:
            return await agents.Runner.run(agent, "What is the weather in Paris?", max_turns=6)
        finally:
            await client.close()

    agents.set_tracing_disabled(True)
    result = asyncio.run(run())
    assert calls and isinstance(calls[0], str)
    outputs = [i for i in result.new_items if i.type == "tool_call_output_item"]
    assert outputs and "21 degrees" in str(outputs[0].output)
    assert isinstance(result.final_output, str) and result.final_output.strip()
    assert result.last_response_id is None or result.last_response_id.startswith("resp_")
