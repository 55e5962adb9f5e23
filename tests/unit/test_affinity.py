"""Prefix affinity's keys (core/jobs/affinity.py) and rendezvous ranking (core/infra/broker.py `ranked`)."""

from __future__ import annotations

import collections

from core.infra import broker
from core.jobs import affinity

SYSTEM = {"role": "system", "content": "You are the support agent of ACME. " * 20}


def _turns(n: int) -> list[list[dict]]:
    """A conversation's requests: each turn sends the whole history so far."""
    history = [SYSTEM, {"role": "user", "content": "My order 1234 never came."}]
    out = [list(history)]
    for i in range(1, n):
        history += [{"role": "assistant", "content": f"answer {i}"}, {"role": "user", "content": f"follow-up {i}"}]
        out.append(list(history))
    return out


def test_every_turn_of_a_conversation_has_one_key():
    keys = {affinity.from_messages(7, m) for m in _turns(5)}
    assert len(keys) == 1


def test_keys_differ_between_conversations_and_tenants():
    a = _turns(1)[0]
    b = [{"role": "system", "content": "Another agent."}, a[1]]
    c = [a[0], {"role": "user", "content": "Where is my refund?"}]
    keys = {affinity.from_messages(7, a), affinity.from_messages(7, b), affinity.from_messages(7, c)}
    assert len(keys) == 3
    # The same conversation of another tenant: another key (no tenant can aim at another's worker).
    assert affinity.from_messages(8, a) != affinity.from_messages(7, a)
    assert affinity.from_cache_key(8, "k") != affinity.from_cache_key(7, "k")
    # A prompt_cache_key is its own namespace: never equal to a message key by construction of the kind.
    assert affinity.from_cache_key(7, "k") == affinity.from_cache_key(7, "k")


def test_a_completion_prompt_is_keyed_by_its_leading_tokens():
    lead = list(range(affinity.PREFIX_TOKENS))
    assert affinity.from_tokens(1, [*lead, 5, 6]) == affinity.from_tokens(1, [*lead, 9])
    assert affinity.from_tokens(1, [1, 2, 3]) != affinity.from_tokens(1, [1, 2, 4])


def test_keys_fit_a_postgres_bigint():
    for i in range(200):
        k = affinity.from_tokens(1, [i])
        assert -(2**63) <= k < 2**63


def test_rendezvous_spreads_keys_and_a_leaving_worker_moves_only_its_own():
    workers = ["w1", "w2", "w3", "w4"]
    keys = [affinity.from_tokens(1, [i]) for i in range(4000)]
    homes = {k: broker.ranked(k, workers)[0] for k in keys}
    counts = collections.Counter(homes.values())
    assert all(800 <= counts[w] <= 1200 for w in workers), counts  # 1,000 each, give or take
    # w3 leaves: only its keys move, each to its own second place; everyone else keeps its home.
    for k in keys:
        after = broker.ranked(k, [w for w in workers if w != "w3"])[0]
        if homes[k] != "w3":
            assert after == homes[k]
        else:
            assert after == broker.ranked(k, workers)[1]
    # A worker that joins takes about a fifth of the keys, each from whichever worker held it.
    moved = sum(broker.ranked(k, [*workers, "w5"])[0] == "w5" for k in keys)
    assert 600 <= moved <= 1000


def test_split_routed_sends_by_affinity_only_requests_with_a_key_and_several_workers():
    fleets = {"m": [("a", 12), ("b", 12)], "solo": [("a", 12)]}
    jobs = [
        ("j1", 1, "m", "interactive", 5),
        ("j2", 1, "m", "interactive", None),  # no key
        ("j3", 1, "m", "batch", 5),  # batch lines go by free batch slots, not affinity
        ("j4", 1, "solo", "interactive", 5),  # one worker: the shared queue, grouped as before
        ("j5", 1, "other", "interactive", 5),  # no fleet known
    ]
    routed, shared = broker.split_routed(jobs, fleets)
    assert [j[0] for j in routed] == ["j1"]
    assert [j[0] for j in shared] == ["j2", "j3", "j4", "j5"]
