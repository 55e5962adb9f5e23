"""Tenants, limits and keys: the one service that `spool tenant|key` and /admin both call."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from core.errors import DomainError, ErrorKind
from core.infra import redis_keys
from core.infra.orm import Tenant
from core.tenancy import service as tenancy
from core.tenancy.keys import lookup_stmt
from tests.conftest import ROOT
from tests.integration.conftest import IT_DB


def _create(session, name: str, **limits) -> Tenant:
    return tenancy.create_tenant(session, tenancy.parse(tenancy.TenantCreate, {"name": name, **limits}))


def test_none_clears_a_limit_and_unset_leaves_it(session):
    t = _create(session, "svc-limits", rpm=10, tpm=100)
    t = tenancy.update_tenant(session, t.name, tenancy.parse(tenancy.TenantLimits, {"rpm": None}))
    assert (t.rpm, t.tpm) == (None, 100)


@pytest.mark.parametrize("value", [0, -1, 2**31])
def test_limits_out_of_range_are_invalid_naming_the_field(session, value):
    with pytest.raises(DomainError) as err:
        tenancy.parse(tenancy.TenantLimits, {"rpm": value})
    assert err.value.kind == ErrorKind.invalid and err.value.param == "rpm"


def test_duplicate_tenant_is_a_conflict(session):
    _create(session, "svc-dup")
    with pytest.raises(DomainError) as err:
        _create(session, "svc-dup")
    assert err.value.kind == ErrorKind.conflict


def test_key_lifecycle_create_lookup_revoke(session, rds):
    _create(session, "svc-keys")
    plain, k = tenancy.create_key(session, "svc-keys", tenancy.KeyCreate(scope="admin"))
    assert session.execute(lookup_stmt(plain)).first() is not None
    assert [x.id for x in tenancy.list_keys(session, "svc-keys")] == [k.id]
    tenancy.revoke_key(session, rds, k.id)
    assert session.execute(lookup_stmt(plain)).first() is None
    assert rds.exists(redis_keys.revoked(k.key_hash))  # announced to the API processes' key caches
    with pytest.raises(DomainError) as err:
        tenancy.revoke_key(session, rds, 10**12)
    assert err.value.kind == ErrorKind.not_found


def test_cli_speaks_the_same_limits_as_admin(session, sessions):
    """`--rpm none` clears (as null does in /admin); `--rpm 0` is refused, as 0 is in /admin."""
    _create(session, "svc-cli", rpm=7)
    env = {**os.environ, "SPOOL_DATABASE_URL": IT_DB}

    def cli(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "core.cli", *args], env=env, cwd=ROOT, capture_output=True, text=True
        )

    refused = cli("tenant", "update", "svc-cli", "--rpm", "0")
    assert refused.returncode != 0 and "rpm" in refused.stderr
    assert cli("tenant", "update", "svc-cli", "--rpm", "none", "--json").returncode == 0
    with sessions() as s:
        assert s.get(Tenant, tenancy.tenant(s, "svc-cli").id).rpm is None
    made = cli("tenant", "create", "svc-cli-made", "--weight", "3", "--tpm", "500", "--max-queued", "none")
    assert made.returncode == 0, made.stderr
    with sessions() as s:
        t = s.get(Tenant, tenancy.tenant(s, "svc-cli-made").id)
        assert (t.weight, t.tpm, t.max_queued, t.rpm) == (3, 500, None, None)
