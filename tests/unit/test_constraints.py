"""Constraint parameters: every malformed one is a ConstraintError naming it (a 400), never a crash."""

from __future__ import annotations

import pytest

from core.generation.constraints import ConstraintError, build


@pytest.mark.parametrize(
    ("kw", "param"),
    [
        ({"regex": "\ud800"}, "regex"),
        ({"regex": "a[\udfff]"}, "regex"),
        ({"guided_choice": ["ok", "\ud800"]}, "guided_choice"),
        ({"grammar": 'root ::= "\ud800"'}, "grammar"),
        ({"json_schema": {"type": "object", "properties": {"\ud800": {"type": "string"}}}}, "json_schema"),
    ],
)
def test_lone_surrogates_are_a_clear_error_naming_the_parameter(kw, param):
    with pytest.raises(ConstraintError) as err:
        build(**kw)
    assert err.value.param == param


def test_a_valid_regex_still_builds():
    assert build(regex="[a-z]{3}") is not None
