"""What an ended job leaves in Redis, and what it counts to its tenant (issue 49).

    python -m ops.bench.redis_bytes [--jobs 2000]

On a redis-server of its own (no persistence), `--jobs` jobs of each kind are ended through the same
script the lifecycle uses (core/infra/streams/write.queue_end): a batch line that never ran (its window
expired) and a short completed job (ten one-word deltas, then its result). Reported per job: the
growth of `used_memory`, the keys left and `MEMORY USAGE` of each kind with its TTL, what is still held
once the ended stream's lifetime is over, and the bytes counted to the tenant (`GET /v1/usage`'s
`redis_bytes`, the gauge `spool_tenant_redis_bytes`)."""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

from core.generation.events import ChoiceResult, Delta, Done, Failed, JobResult, Usage, encode, inline_result
from core.infra import kv, redis_keys
from core.infra.streams import keys, write
from core.jobs.lifecycle import BATCH_EXPIRED
from ops.bench.paced import private_redis

ENDED_TTL_S = 300  # SPOOL_ENDED_EVENTS_TTL_S's default
TENANT = 7


def _end(r: Any, job_id: str, payload: str) -> None:
    pipe = r.pipeline(transaction=False)
    write.queue_end(pipe, job_id, TENANT, [payload], ENDED_TTL_S)
    pipe.execute()


def never_run(r: Any, job_id: str) -> None:
    _end(r, job_id, encode(Failed(attempt=1, error=BATCH_EXPIRED)))


def short_job(r: Any, job_id: str) -> None:
    write.raise_fence(r, job_id, 1, 86400)
    words = [" The", " quick", " brown", " fox", " jumps", " over", " the", " lazy", " dog", "."]
    deltas = [
        encode(Delta(attempt=1, choice=0, text=w, token_ids=[100 + i], finish_reason="stop" if i == 9 else None))
        for i, w in enumerate(words)
    ]
    write.append_fenced(r, job_id, 1, deltas, 86400, start=1)
    result = JobResult(choices=[ChoiceResult(index=0, text="".join(words), finish_reason="stop")])
    done = Done(
        attempt=1,
        usage=Usage(prompt_tokens=12, completion_tokens=10),
        result=inline_result(result, result.model_dump(mode="json")),
    )
    _end(r, job_id, encode(done))


def measure(r: Any, case: Callable[[Any, str], None], n: int) -> dict[str, Any]:
    r.flushdb()
    time.sleep(0.2)  # the allocator settles after the flush
    base = int(r.info("memory")["used_memory"])
    for i in range(n):
        case(r, f"{case.__name__}-{i:06d}")
    grown = int(r.info("memory")["used_memory"]) - base
    patterns = (keys.stream_key("*"), keys.fence_key("*"), keys.marks_key("*"), keys.cancel_key("*"))
    found = [k for p in patterns for k in r.scan_iter(match=p, count=10_000)]
    kinds: dict[str, list[int]] = {}
    for k in found:
        kind = k.decode().rsplit(":", 1)[1]  # events, fence, marks, cancel
        row = kinds.setdefault(kind, [0, 0, 0])
        row[0] += 1
        row[1] += int(r.memory_usage(k) or 0)
        row[2] = int(r.ttl(k))
    counted = sum(int(v) for v in r.hvals(redis_keys.stored_bytes(write.stored_window(ENDED_TTL_S))))
    return {
        "case": case.__name__,
        "used_memory_per_job": round(grown / n),
        "keys_per_job": round(len(found) / n, 2),
        # kind: (keys a job, MEMORY USAGE of each, TTL s)
        "kinds": {k: (round(v[0] / n, 2), v[1] // max(1, v[0]), v[2]) for k, v in kinds.items()},
        "held_past_ended_ttl_per_job": round(sum(v[1] for v in kinds.values() if v[2] > ENDED_TTL_S) / n),
        "counted_to_tenant_per_job": round(counted / n),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--jobs", type=int, default=2000)
    args = ap.parse_args()
    with private_redis() as (url, _):
        r = kv.client(url)
        print(f"redis {r.info('server')['redis_version']}, {args.jobs} jobs of each kind")
        for case in (never_run, short_job):
            print(measure(r, case, args.jobs))


if __name__ == "__main__":
    main()
