"""The harnesses' history checker (ops/history.py): a stream resumed exactly passes; an entry delivered
twice, text skipped at a resume point, and a replaying client's connection that strays are each found
and named, even when the final text would have hidden them."""

from __future__ import annotations

from ops.history import Record, Seen, Verdict, check, check_file, write

REF = "Once upon a time there was a fox"


def run(kind: str, events: list[Seen]) -> Verdict:
    v = Verdict()
    check(kind, "t", events, REF, v)
    return v


def test_a_stream_resumed_where_it_left_off_is_clean():
    v = run(
        "stream",
        [
            Seen(0, "0-1", "Once"),
            Seen(0, "0-3", " upon a"),
            Seen(1, "0-4", " time"),
            Seen(2, "0-9", " there was a fox"),
        ],
    )
    assert (v.histories, v.events, v.connections, v.repeated, v.skipped, v.problems) == (1, 4, 3, 0, 0, [])


def test_an_entry_delivered_again_after_a_reattach_is_a_repeat():
    # The re-attached connection starts at the entry the client already had (Last-Event-ID ignored).
    v = run("stream", [Seen(0, "0-1", "Once"), Seen(0, "0-2", " upon"), Seen(1, "0-2", " upon"), Seen(1, "0-3", " a")])
    assert (v.repeated, v.skipped) == (1, 0)
    assert "connection 1 delivered entry 0-2 again" in v.problems[0]


def test_text_delivered_twice_under_new_ids_is_a_repeat():
    v = run("stream", [Seen(0, "0-1", "Once upon"), Seen(1, "0-2", " upon"), Seen(1, "0-3", " a time")])
    assert (v.repeated, v.skipped) == (1, 0)
    assert "on connection 1 the text left the reference at char 10" in v.problems[0]


def test_text_missing_at_a_resume_point_is_a_skip():
    v = run("stream", [Seen(0, "0-1", "Once upon"), Seen(1, "0-4", " time there was a fox")])
    assert (v.repeated, v.skipped) == (0, 1)
    assert "char 10: got 'time there was a fox', expected 'a time there" in v.problems[0]


def test_a_replaying_client_starts_over_on_each_connection():
    # The openai SDK asked again under its key: the job's stream from its start, no ids.
    ok = run(
        "sdk-completion-stream",
        [
            Seen(0, None, "Once"),
            Seen(0, None, " upon"),
            Seen(1, None, "Once"),
            Seen(1, None, " upon a time there was a fox"),
        ],
    )
    assert (ok.repeated, ok.skipped, ok.connections) == (0, 0, 2)
    # The same events on a resuming client would be a repeat: the kinds are told apart.
    assert run("stream", [Seen(0, None, "Once"), Seen(1, None, "Once")]).repeated == 1
    # A replayed connection that strays from the reference is found on that connection.
    bad = run("sdk-chat-stream", [Seen(0, None, "Once upon"), Seen(1, None, "Once upon a tim"), Seen(1, None, "x")])
    assert (bad.repeated, bad.skipped) == (0, 1) and "connection 1" in bad.problems[0]


def test_an_id_that_is_not_a_stream_entry_is_named():
    v = run("stream", [Seen(0, "abc", "Once")])
    assert v.skipped == 1 and "'abc'" in v.problems[0]


def test_the_recorded_file_is_checked_again_as_written(tmp_path):
    refs = {"completion": {"p": REF}, "chat": {"p": "Hi"}, "response": {"p": "R"}}
    path = tmp_path / "history.jsonl"
    write(
        path,
        refs,
        [
            Record(
                "stream",
                "p",
                "cmpl-1",
                "succeeded",
                [Seen(0, "0-1", "Once"), Seen(1, "0-2", " upon a time there was a fox")],
            ),
            Record("sdk-chat-stream", "p", "cmpl-2", "succeeded", [Seen(0, None, "H"), Seen(0, None, "i")]),
            Record("stream", "p", "cmpl-3", "succeeded", [Seen(0, "0-1", "Once"), Seen(1, "0-1", "Once")]),
            Record("async", "p", "cmpl-4", "succeeded", []),  # nothing streamed: nothing to check
        ],
    )
    v = check_file(path)
    assert (v.histories, v.events, v.repeated, v.skipped) == (3, 6, 1, 0)
    assert v.problems[0].startswith("stream cmpl-3:")
