"""Each kind of blocking API work has thread capacity of its own (core/infra/threads.py)."""

from __future__ import annotations

import threading

import anyio

from core.config import get_settings
from core.infra import threads


def test_full_upload_and_default_pools_leave_preparation_its_threads():
    release = threading.Event()

    async def go() -> None:
        async with anyio.create_task_group() as tg:
            for _ in range(get_settings().upload_threads):
                tg.start_soon(threads.run, "upload", release.wait)
            for _ in range(40):  # anyio's default limiter: everything else's, full too
                tg.start_soon(anyio.to_thread.run_sync, release.wait)
            while threads.limiter("upload").borrowed_tokens < get_settings().upload_threads:  # noqa: ASYNC110
                await anyio.sleep(0.01)  # polling a limiter's count: there is no event to wait on
            with anyio.fail_after(30):
                assert await threads.run("prepare", sum, [1, 2]) == 3
                assert await threads.run("dns", len, "abc") == 3
            release.set()

    anyio.run(go)
