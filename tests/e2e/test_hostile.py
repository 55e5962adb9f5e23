"""One quick scenario of ops/hostile.py against this session's stack: poisoned resume ids from one
tenant while another streams; the attacker is refused (400s), nobody gets a 5xx, and the victim's
stream keeps flowing."""

from __future__ import annotations

from ops import hostile


def test_poisoned_resume_ids_scenario(stack):
    row = hostile.run(stack, "poisoned_resume_ids")
    assert row["attacker_statuses"] == [400]
    assert row["fivexx"] == 0
    assert row["victim_tokens"] > 0
