"""Each kind of blocking API work has thread capacity of its own (core/infra/threads.py)."""

from __future__ import annotations

import contextlib
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


def test_one_tenant_holds_at_most_its_share_of_the_prepare_threads():
    """A tenant named in SHARE (api/request_gate.py names it for every request) runs at most its share of
    prepare work at once; another tenant's work still finds threads while the first one's waits."""
    share = threads.share_size()
    release = threading.Event()
    running: dict[int, int] = {1: 0, 2: 0}
    most: dict[int, int] = {1: 0, 2: 0}
    lock = threading.Lock()

    def hold(tenant: int) -> None:
        with lock:
            running[tenant] += 1
            most[tenant] = max(most[tenant], running[tenant])
        release.wait()
        with lock:
            running[tenant] -= 1

    async def as_tenant(tenant: int) -> None:
        threads.SHARE.set(tenant)  # a task's own context: as the rate gate sets it per request
        await threads.run("prepare", hold, tenant)

    async def go() -> None:
        async with anyio.create_task_group() as tg:
            for _ in range(share + 3):
                tg.start_soon(as_tenant, 1)
            while running[1] < share:  # noqa: ASYNC110
                await anyio.sleep(0.01)  # polling a count: there is no event to wait on
            tg.start_soon(as_tenant, 2)
            with anyio.fail_after(30):
                while running[2] < 1:  # noqa: ASYNC110
                    await anyio.sleep(0.01)
            assert running[1] == share  # the rest of tenant 1's wait for its share, not for threads
            release.set()

    anyio.run(go)
    assert most == {1: share, 2: 1}
    assert share < get_settings().prepare_threads


def test_a_tenants_abandoned_lookups_keep_its_dns_share_until_they_end():
    """A lookup cancelled by its deadline returns at once, but its thread still runs: the tenant's
    share stays taken until it ends, so hung lookups never take more than the share, and another
    tenant's lookup finds a thread."""
    share = threads.share_size("dns")
    release = threading.Event()

    async def lookup(tenant: int, fn, deadline_s: float):
        threads.SHARE.set(tenant)
        with anyio.fail_after(deadline_s):
            return await threads.run("dns", fn)

    async def go() -> None:
        for _ in range(share):
            with contextlib.suppress(TimeoutError):
                await lookup(1, release.wait, 0.1)  # hung: abandoned at its deadline
        with contextlib.suppress(TimeoutError):
            await lookup(1, lambda: "never", 0.3)  # the tenant's share is still held by the hung ones
            raise AssertionError("tenant 1 ran a lookup past its share")
        assert await lookup(2, lambda: "resolved", 5) == "resolved"
        release.set()
        assert await lookup(1, lambda: "again", 5) == "again"  # the hung ones ended: the share is back

    anyio.run(go)
