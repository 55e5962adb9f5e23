"""`python -m workers` (what `spool worker` runs): load the model, then start Celery.

Threads pool: prefork would give each child its own model (and breaks CUDA), while threads let every
task feed the one engine loop that batches them all.
"""

from __future__ import annotations

import logging
import sys
from typing import NoReturn

from core.config import get_settings

EXIT_NOT_READY = 78  # EX_CONFIG: the model did not load or could not generate (see the log line before)


def main(argv: list[str] | None = None) -> None:
    s = get_settings()
    from core.infra import logs

    logs.setup(s.log_format)
    from workers.runtime import batch_slots, runner
    from workers.tasks import app

    try:
        r = runner()  # load the model and generate with it before announcing anything
    except Exception as exc:
        _could_not_start(s, exc)
    slots = batch_slots(s.worker_model_ids[0], s)
    _heartbeat(r.worker_name, s, r.loop, slots, lambda: r.in_hand)
    from core.infra import broker, kv
    from core.jobs import live_workers

    r.slot_wake = lambda: live_workers.wake_dispatcher(r.redis)
    model = s.worker_model_ids[0]
    broker_rds = kv.client(s.celery_broker_url)
    r.on_load = lambda n: broker.set_load(broker_rds, model, r.worker_name, n)
    # Celery's "received" and "succeeded in" lines repeat ours (which carry job and request ids) for
    # every job: at hundreds of jobs a second their formatting alone is a noticeable share of a core.
    for name in ("celery.app.trace", "celery.worker.strategy"):
        logging.getLogger(name).setLevel(logging.WARNING)
    if s.metrics_port:
        from prometheus_client import start_http_server

        start_http_server(s.metrics_port)
    # Its own queue first (requests sent to it by prefix affinity), then the model's shared ones.
    own = broker.direct_queue(model, r.worker_name)
    queues = ",".join([own, *broker.queues_for(model), broker.WEBHOOK_QUEUE])
    app.worker_main(
        [
            "worker",
            "--pool=threads",
            f"--concurrency={s.threads_for(slots)}",
            f"--queues={queues}",
            "--loglevel=INFO",
            "--without-gossip",
            "--without-mingle",
            "--without-heartbeat",
            *(argv if argv is not None else sys.argv[1:]),
        ]
    )


def _could_not_start(s, exc: BaseException) -> NoReturn:
    """The model did not load or could not generate: say so with the library's words (the log, and the
    model's worker record that /ready and /ui read), and exit non-zero without taking any message."""
    from core.infra import kv
    from core.jobs import live_workers
    from workers.runtime import worker_name

    model = s.worker_model_ids[0]
    message = f"{type(exc).__name__}: {exc}"
    logging.getLogger(__name__).critical("worker for %s could not start: %s", model, message, exc_info=exc)
    try:
        live_workers.failed(kv.client(s.redis_url), model, worker_name(), message)
    except Exception:
        logging.getLogger(__name__).warning("could not record the failure in Redis", exc_info=True)
    sys.exit(EXIT_NOT_READY)


def _heartbeat(name: str, s, loop, slots: int, load) -> None:
    """Tell the dispatcher (and /ready) this worker is alive and how much batch work it takes; a
    wedged engine stops the beat and ends the process (its supervisor restarts it; its jobs, no
    longer renewed, resume on another worker)."""
    import atexit
    import os
    import threading
    import time

    from core.infra import broker, kv
    from core.infra.metrics import RUNNING, WAITING
    from core.jobs import live_workers

    rds = kv.client(s.redis_url)
    broker_rds = kv.client(s.celery_broker_url)
    model = s.worker_model_ids[0]
    pace = _Pace(loop)

    def beat_forever() -> None:
        while True:
            try:
                beat_once()
            except Exception:  # a thread that died here would leave a working worker unheard: its jobs
                # would be given to others (core/dispatcher.py) while it goes on taking new ones
                logging.getLogger(__name__).exception("heartbeat pass failed; going on")
            time.sleep(live_workers.HEARTBEAT_S)

    def beat_once() -> None:
        pace.say()
        stalled = loop.stalled_for()
        if stalled > s.engine_stall_s:
            logging.getLogger(__name__).critical("engine wedged for %.0fs: leaving (a supervisor restarts me)", stalled)
            try:
                live_workers.gone(rds, model, name)
            finally:
                os._exit(70)  # a wedged C call cannot be interrupted; exit without waiting for it
        waiting = loop.waiting_count()
        RUNNING.labels(model, name).set(max(loop.live_count() - waiting, 0))
        WAITING.labels(model, name).set(waiting)
        try:
            live_workers.beat(rds, model, name, slots, s.interactive_slots, draining.is_set())
            if not draining.is_set():
                broker.announce(broker_rds, model, name, load())
        except Exception:
            logging.getLogger(__name__).warning("heartbeat failed; retrying", exc_info=True)

    def leave() -> None:
        live_workers.gone(rds, model, name)
        moved = broker.release(broker_rds, model, name)  # no new message comes once it is not live
        if moved:
            logging.getLogger(__name__).info("leaving: %d messages of my own queue go to the shared one", moved)

    def drain(**_: object) -> None:
        """SIGTERM (Celery's warm shutdown): it finishes its running jobs, within the grace period the
        deployment gives it (ops/k8s), but takes nothing new: its heartbeat says so at once (no slots,
        no own queue for the API and the dispatcher), and the messages of its own queue go to the others."""
        draining.set()
        try:
            live_workers.beat(rds, model, name, slots, s.interactive_slots, True)
            moved = broker.release(broker_rds, model, name)
            logging.getLogger(__name__).info("draining: %d messages of my own queue go to the shared one", moved)
        except Exception:
            log = logging.getLogger(__name__)
            log.warning("could not announce the drain; the dispatcher reclaims later", exc_info=True)

    draining = threading.Event()
    live_workers.beat(rds, model, name, slots, s.interactive_slots)
    broker.announce(broker_rds, model, name, load())
    threading.Thread(target=beat_forever, name="heartbeat", daemon=True).start()
    atexit.register(leave)
    broker.on_shutdown(drain)


class _Pace:
    """Logs the engine's pace once a minute while it steps, and when it goes idle: its steps, the
    time inside them, and the host's time between them (on a GPU, time the GPU waits for Spool)."""

    def __init__(self, loop) -> None:
        import time

        self.loop, self.clock = loop, time.monotonic
        self.mark = (self.clock(), 0, 0.0, 0.0)  # when, steps, step_s, between_s at the last line

    def say(self) -> None:
        loop, now = self.loop, self.clock()
        then, steps, inside, between = self.mark
        n = loop.steps - steps
        if now - then < 60 and not (n and loop.live_count() == 0):
            return
        if n:
            logging.getLogger(__name__).info(
                "engine: %d steps in %.0fs, %.2f ms a step inside the engine, %.2f ms between steps",
                n,
                now - then,
                (loop.step_s - inside) * 1000 / n,
                (loop.between_s - between) * 1000 / n,
            )
        self.mark = (now, loop.steps, loop.step_s, loop.between_s)


if __name__ == "__main__":
    main()
