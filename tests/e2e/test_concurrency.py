"""16 concurrent streaming requests: all complete, and the worker really ran them at the same time."""

from __future__ import annotations

import asyncio
import json

from core.infra.streams import keys
from tests.conftest import MODEL


def test_sixteen_concurrent_streams(stack, rds, db):
    import openai

    client = openai.AsyncOpenAI(
        base_url=stack.base_url + "/v1", api_key=stack.keys["alpha"], max_retries=0, timeout=300
    )
    prompts = [f"Write a short sentence about the number {i}." for i in range(16)]

    async def one(prompt: str):
        stream = await client.completions.create(
            model=MODEL,
            prompt=prompt,
            max_tokens=24,
            temperature=0.7,
            seed=11,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        parts, job_id, finish = [], None, None
        async for chunk in stream:
            job_id = chunk.id
            if chunk.choices:
                parts.append(chunk.choices[0].text)
                finish = chunk.choices[0].finish_reason or finish
        return job_id, "".join(parts), finish

    async def main():
        return await asyncio.gather(*(one(p) for p in prompts))

    results = asyncio.run(main())
    assert len({r[0] for r in results}) == 16
    for job_id, text, finish in results:
        assert finish == "length" and text, (job_id, text, finish)

    # Evidence from the worker itself: the time span of each job's generated deltas (worker clock,
    # written with every event). Sequential service would give disjoint spans.
    spans = []
    for job_id, text, _ in results:
        entries = [json.loads(keys.payload(f)) for _, f in rds.xrange(keys.stream_key(job_id))]
        deltas = [e for e in entries if e["type"] == "delta"]
        assert "".join(e["text"] for e in deltas) == text
        spans.append((deltas[0]["t"], deltas[-1]["t"]))
    most_at_once = max(sum(1 for s, e in spans if s <= t <= e) for t, _ in spans)
    assert most_at_once >= 12, f"at most {most_at_once} of 16 jobs were generating at the same moment"
