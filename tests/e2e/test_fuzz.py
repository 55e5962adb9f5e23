"""Property-based fuzzing of every operation in Spool's OpenAPI schema: whatever schemathesis sends,
valid or not, the answer is never a 5xx.

It runs with an admin key and really changes things (it revokes keys, edits tenants), so it gets a
stack of its own (own database, own Redis db, fresh keys): test order does not matter."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from ops.harness import side_redis
from tests.conftest import TEST_DB, running_stack


@pytest.fixture(scope="module")
def fuzz_stack(tmp_path_factory):
    with running_stack(
        tmp_path_factory.mktemp("fuzz-logs"),
        TEST_DB.rsplit("/", 1)[0] + "/spool_fuzz",
        side_redis("fuzz"),
    ) as st:
        yield st


def test_no_generated_request_gets_a_server_error(fuzz_stack):
    stack = fuzz_stack
    st = shutil.which("st") or str(Path(sys.executable).with_name("st"))
    if not Path(st).exists():
        pytest.skip("schemathesis is not installed")
    run = subprocess.run(
        [
            st,
            "run",
            f"{stack.base_url}/openapi.json",
            "-H",
            f"Authorization: Bearer {stack.keys['admin']}",
            "--checks",
            "not_a_server_error",
            "--max-examples",
            "25",
            "--workers",
            "1",
            "--seed",
            "1",
        ],
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert run.returncode == 0, run.stdout[-4000:]
    assert "unhandled error" not in stack.log("api")
