"""An engine's error message may quote text JSONB cannot hold (a NUL, an unpaired surrogate): the
job still fails with it, instead of the failure itself failing and the job being left to lapse."""

from __future__ import annotations

from core.generation.events import Delta, ErrorInfo, Failed, Usage, decode
from core.infra.orm import Job
from core.infra.streams import write
from core.jobs.lifecycle import Lifecycle
from core.states import JobState
from ops import factories


def test_a_failure_whose_message_quotes_a_nul_is_stored(session, sessions, rds, it_settings):
    t = factories.tenant(session)
    job = factories.job(session, t, state=JobState.running)
    lifecycle = Lifecycle(sessions, rds, it_settings)
    lifecycle.publish_deltas(job.id, 1, [Delta(choice=0, text="x", token_ids=[1])], 1)  # a stream to end
    err = ErrorInfo(message="Generation failed: bad piece 'a\x00b\udc80'", type="server_error", code="engine_error")
    assert lifecycle.fail(job, err, Usage())
    row = session.get(Job, job.id, populate_existing=True)
    assert row.state == JobState.failed.value
    assert row.error["message"] == "Generation failed: bad piece 'a\ufffdb?'"
    assert row.error["code"] == "engine_error"
    end = decode(write.entries(rds, job.id)[-1][1])
    assert isinstance(end, Failed) and end.error.message == row.error["message"]
