"""The `spool` command line.

Process commands exec the real entrypoints by module path (uvicorn for `api`, `python -m workers`,
`python -m ops.bench` for `bench`), so this module, in the shared package, imports neither api/ nor
workers/ nor ops/ (import contracts).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import typer

from core.config import get_settings

if TYPE_CHECKING:
    from alembic.config import Config

app = typer.Typer(
    help="Spool: a queue-backed, OpenAI-compatible completion service.",
    no_args_is_help=True,
    pretty_exceptions_show_locals=False,
)
tenant_app = typer.Typer(help="Tenants.", no_args_is_help=True)
key_app = typer.Typer(help="API keys.", no_args_is_help=True)
app.add_typer(tenant_app, name="tenant")
app.add_typer(key_app, name="key")
batch_app = typer.Typer(help="Batches (OpenAI's Batch API) from the command line.", no_args_is_help=True)
app.add_typer(batch_app, name="batch")

ROOT = Path(__file__).resolve().parents[2]


def _logging() -> None:
    from core.infra import logs

    logs.setup(get_settings().log_format)


def alembic_config() -> Config:
    """Alembic's configuration, built here rather than read from alembic.ini: an installed Spool
    (`pip install .`, not `-e`) has no checkout around it. `migrations/` ships as a package beside
    `core/` (pyproject's packages), so ROOT / "migrations" is the checkout's folder or the installed
    one in site-packages alike; alembic.ini stays for the `alembic` command run in a checkout."""
    from alembic.config import Config

    cfg = Config()
    cfg.set_main_option("script_location", str(ROOT / "migrations"))
    return cfg


def _alembic_log() -> None:
    """What alembic.ini's logging gave `spool migrate`: alembic's INFO lines (each revision applied)
    on stderr, and nothing else's."""
    import logging

    log = logging.getLogger("alembic")
    if not log.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(levelname)-5.5s [%(name)s] %(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
        log.propagate = False


@app.command()
def migrate(revision: str = typer.Argument("head", help="Target revision.")) -> None:
    """Create the database if missing, then upgrade the schema (alembic upgrade)."""
    from alembic import command

    from core.infra.dbadmin import ensure_database

    ensure_database(get_settings().database_url)
    _alembic_log()
    command.upgrade(alembic_config(), revision)
    typer.echo(f"database at {revision}")


@app.command()
def init(tenant: str = typer.Option("admin", help="Tenant that gets the first admin key.")) -> None:
    """Migrate, then create a first admin key and print it once (none is made if the tenant has keys):
    what `docker compose`'s `migrate` service runs."""
    migrate("head")
    key = _ensure_first_key(tenant)
    if key:
        typer.echo(f"First admin API key for tenant '{tenant}' (shown once, keep it): {key}")
    else:
        typer.echo(f"Tenant '{tenant}' already has keys; none created.")


@app.command()
def api(host: str | None = None, port: int | None = None, workers: int = 1) -> None:
    """Run the HTTP API (uvicorn). With --workers N > 1 the processes share their metrics through
    prometheus_client's multiprocess mode, so /metrics on any of them is the sum over all."""
    s = get_settings()
    if workers > 1 and not os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        import tempfile

        os.environ["PROMETHEUS_MULTIPROC_DIR"] = tempfile.mkdtemp(prefix="spool-metrics-")
    os.execvp(
        sys.executable,
        [
            sys.executable,
            "-m",
            "uvicorn",
            "api.app:create_app",
            "--factory",
            "--host",
            host or s.api_host,
            "--port",
            str(port or s.api_port),
            "--workers",
            str(workers),
            "--no-access-log",
            "--timeout-graceful-shutdown",
            "5",
        ],
    )


@app.command()
def worker() -> None:
    """Run a Celery worker: loads the model once, then serves its queue with the threads pool."""
    os.execvp(sys.executable, [sys.executable, "-m", "workers"])


@app.command()
def dispatcher() -> None:
    """Run the dispatcher: sends queued jobs, re-sends lost messages, re-queues lapsed leases."""
    from core.dispatcher import Dispatcher
    from core.infra import kv
    from core.infra.db import sync_sessions

    _logging()
    s = get_settings()
    if s.metrics_port:
        from prometheus_client import start_http_server

        start_http_server(s.metrics_port)
    import threading

    from core.batches.ingest import run_validator

    # Batch validation (tokenizing every line) runs here, beside the loop, never in the API.
    threading.Thread(target=run_validator, args=(sync_sessions(), kv.client(s.redis_url), s), daemon=True).start()
    Dispatcher(sync_sessions(), kv.client(s.redis_url), kv.client(s.celery_broker_url), s).run_forever()


@app.command()
def up(
    tenant: str = typer.Option("default", help="Tenant to create a first key for, if it has none."),
    registry: Path | None = typer.Option(
        None, help="The model registry file for all three (SPOOL_MODELS_FILE), e.g. ops/models.host.example.toml."
    ),
) -> None:
    """Migrate, then run api + worker + dispatcher together until Ctrl-C (a one-host deployment)."""
    if registry is not None:
        _use_registry(registry)
    migrate("head")
    key = _ensure_first_key(tenant)
    if key:
        typer.echo(f"API key for tenant '{tenant}' (shown once): {key}")
    procs = [subprocess.Popen([sys.executable, "-m", "core.cli", cmd]) for cmd in ("worker", "dispatcher", "api")]
    s = get_settings()
    typer.echo(f"Spool is starting on http://{s.api_host}:{s.api_port}  (Ctrl-C stops it)")

    def stop(*_: object) -> None:
        for p in procs:
            p.terminate()

    signal.signal(signal.SIGTERM, stop)
    try:
        while all(p.poll() is None for p in procs):
            time.sleep(0.5)
    except KeyboardInterrupt:
        pass
    finally:
        stop()
        for p in procs:
            p.wait(timeout=20)


def _use_registry(path: Path) -> None:
    """Point this process and the ones it starts at a registry file, and name any model path in it that
    is not on this host (relative paths are read from the current directory)."""
    from core.registry import RegistryError, registry

    if not path.is_file():
        raise typer.BadParameter(f"no registry file at {path.resolve()}", param_hint="--registry")
    os.environ["SPOOL_MODELS_FILE"] = str(path.resolve())
    get_settings.cache_clear()
    try:
        models = registry(get_settings())
    except RegistryError as exc:
        raise typer.BadParameter(str(exc), param_hint="--registry") from None
    for spec in models.values():
        if spec.path and not Path(spec.path).exists():
            where = Path(spec.path).resolve()
            typer.echo(f"warning: model {spec.id!r}: {spec.path} ({where}) does not exist", err=True)


def _ensure_first_key(tenant_name: str) -> str | None:
    from core.infra.db import sync_sessions
    from core.tenancy import service as tenancy

    return tenancy.run(sync_sessions(), tenancy.ensure_first_key, tenant_name)


@app.command(
    context_settings={"allow_extra_args": True, "ignore_unknown_options": True, "help_option_names": []},
    add_help_option=False,
)
def bench(ctx: typer.Context) -> None:
    """Benchmark a server (and/or the engine alone): TTFT, ITL, E2E p50/p90/p99, tokens/s, requests/s.
    Its options: `spool bench --help`."""
    # The benchmark lives in ops/bench, which imports core, not the other way round: run it as a program.
    raise typer.Exit(subprocess.call([sys.executable, "-m", "ops.bench", *ctx.args]))


@app.command("settings")
def settings_table() -> None:
    """Print every SPOOL_* setting with its default and meaning, as Markdown tables by concern."""
    typer.echo(settings_markdown())


def settings_markdown() -> str:
    """The README's configuration tables: one per group of core/config.py's GROUPS, tuning knobs marked."""
    from core.config import GROUPS, TUNING, Settings

    out: list[str] = []
    for group, names in GROUPS.items():
        out += [f"**{group}**", "", "| variable | default | meaning |", "| --- | --- | --- |"]
        for name in names:
            f = Settings.model_fields[name]
            value = f.get_default(call_default_factory=True)
            default = "(unset)" if value is None else "(empty)" if value == "" else f"`{value}`"
            tuning = "*Tuning.* " if name in TUNING else ""
            out.append(f"| `SPOOL_{name.upper()}` | {default} | {tuning}{f.description or ''} |")
        out.append("")
    return "\n".join(out).rstrip("\n")


LimitOpt = typer.Option(None, help="Limit: a positive number, or 'none' for unlimited (omit: leave as is).")


# Stored-bytes quotas: unset (the deployment's default) is not the same as no limit (0).
StoreOpt = typer.Option(
    None, help="Bytes: a number, 0 or 'none' for no limit, 'default' for the deployment's (omit: leave as is)."
)
STORE_LIMITS = ("max_stored_bytes", "max_redis_bytes")
LIMITS = ("weight", "rpm", "tpm", "tpd", "max_concurrent", "max_queued", "max_storage_bytes", *STORE_LIMITS)


def commands_markdown() -> str:
    """README's command table: every command of the `spool` app (groups' subcommands too), its
    arguments and options, and the first sentence of its help. tests/unit/test_reference_tables.py
    keeps README's copy current; `python -m ops.docs` rewrites it."""
    from typing import Any

    def usage(cmd: Any) -> str:
        out = []
        for p in cmd.params:
            if p.param_type_name == "argument":
                out.append((p.metavar or p.name).upper())
            elif p.param_type_name == "option" and not p.hidden and "--help" not in p.opts:
                out.append(f"[{max(p.opts, key=len)}]")
        return " ".join(out)

    def first_sentence(cmd: Any) -> str:
        text = " ".join((cmd.help or "").split("\n\n")[0].split())
        return text.split(". ")[0].rstrip(".").replace("|", "\\|")

    rows = ["| command | arguments | does |", "| --- | --- | --- |"]

    def walk(cmd: Any, path: str) -> None:
        if hasattr(cmd, "commands"):  # a group (typer's own click)
            for name, sub in cmd.commands.items():
                walk(sub, f"{path} {name}")
        else:
            args = usage(cmd)
            rows.append(f"| `{path}` | {f'`{args}`' if args else ''} | {first_sentence(cmd)} |")

    walk(typer.main.get_command(app), "spool")
    return "\n".join(rows)


def _limits(args: dict[str, object]) -> dict[str, int | bool | None]:
    """The limit options among a command's arguments (its `locals()`, taken first thing), those given
    only, 'none' as None (unlimited): the same values /admin takes."""
    out: dict[str, int | bool | None] = {}
    allow = args.get("allow_priority")
    if isinstance(allow, bool):
        out["allow_priority"] = allow
    for k in LIMITS:
        v = args.get(k)
        if v is None:
            continue
        text = str(v).strip().lower()
        if k in STORE_LIMITS and text in ("none", "unlimited"):
            out[k] = 0
        elif text in ("none", "null", "unlimited", "default"):
            out[k] = None
        elif text.lstrip("-").isdigit():
            out[k] = int(text)
        else:
            raise typer.BadParameter(f"--{k.replace('_', '-')}: a positive number or 'none', not {v!r}")
    return out


def _service(fn, *args):
    """Run one tenancy service call; its errors are the same words /admin answers with."""
    from core.errors import DomainError
    from core.infra.db import sync_sessions
    from core.tenancy import service as tenancy

    try:
        return tenancy.run(sync_sessions(), fn, *args)
    except DomainError as exc:
        typer.echo(f"error: {exc.message}", err=True)
        raise typer.Exit(1) from exc


def _print(rows: list[dict], as_json: bool, columns: list[str]) -> None:
    import json

    if as_json:
        typer.echo(json.dumps(rows, indent=2))
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(*columns)
    for r in rows:
        table.add_row(*("" if r.get(c) is None else str(r.get(c)) for c in columns))
    Console().print(table)


JsonOpt = typer.Option(False, "--json", help="Print JSON instead of a table.")
TENANT_COLUMNS = ["id", "name", *LIMITS]
KEY_COLUMNS = ["id", "prefix", "name", "scope", "revoked", "rpm", "tpm", "expires_at"]


@tenant_app.command("create")
def tenant_create(
    name: str,
    weight: int = typer.Option(1, help="Share of the workers when tenants compete."),
    rpm: str | None = LimitOpt,
    tpm: str | None = LimitOpt,
    tpd: str | None = LimitOpt,
    max_concurrent: str | None = LimitOpt,
    max_queued: str | None = LimitOpt,
    max_storage_bytes: str | None = LimitOpt,
    max_stored_bytes: str | None = StoreOpt,
    max_redis_bytes: str | None = StoreOpt,
    allow_priority: bool = typer.Option(False, help="May be served at `service_tier: priority`."),
) -> None:
    """Create a tenant, optionally with limits (requests/tokens per minute, tokens per day, ...)."""
    values = _limits(locals())
    from core.tenancy import service as tenancy

    body = _service(lambda _s: tenancy.parse(tenancy.TenantCreate, {"name": name, **values}))
    t = _service(tenancy.create_tenant, body)
    typer.echo(f"tenant '{t.name}' created (id {t.id})")


@tenant_app.command("update")
def tenant_update(
    name: str,
    weight: int | None = typer.Option(None),
    rpm: str | None = LimitOpt,
    tpm: str | None = LimitOpt,
    tpd: str | None = LimitOpt,
    max_concurrent: str | None = LimitOpt,
    max_queued: str | None = LimitOpt,
    max_storage_bytes: str | None = LimitOpt,
    max_stored_bytes: str | None = StoreOpt,
    max_redis_bytes: str | None = StoreOpt,
    allow_priority: bool | None = typer.Option(None, help="May be served at `service_tier: priority`."),
    as_json: bool = JsonOpt,
) -> None:
    """Change a tenant's weight or limits ('none' clears a limit)."""
    values = _limits(locals())
    from core.protocol import render
    from core.tenancy import service as tenancy

    body = _service(lambda _s: tenancy.parse(tenancy.TenantLimits, values))
    _print([render.tenant(_service(tenancy.update_tenant, name, body))], as_json, TENANT_COLUMNS)


@tenant_app.command("list")
def tenant_list(as_json: bool = JsonOpt) -> None:
    """List tenants and their limits."""
    from core.protocol import render
    from core.tenancy import service as tenancy

    _print([render.tenant(t) for t in _service(tenancy.list_tenants)], as_json, TENANT_COLUMNS)


@key_app.command("create")
def key_create(
    tenant: str = typer.Option(..., "--tenant", help="Tenant name."),
    name: str | None = typer.Option(None, help="A label for the key."),
    scope: str = typer.Option("user", help="user, or admin (may call /admin)."),
    expires_days: float | None = typer.Option(None, help="Expire after this many days."),
    rpm: int | None = typer.Option(None, help="Per-key requests/minute, on top of the tenant's."),
    tpm: int | None = typer.Option(None, help="Per-key tokens/minute, on top of the tenant's."),
) -> None:
    """Create an API key and print it. It is stored hashed: this is the only time it is shown."""
    from core.tenancy import service as tenancy

    raw = {"name": name, "scope": scope, "expires_in_days": expires_days, "rpm": rpm, "tpm": tpm}
    body = _service(lambda _s: tenancy.parse(tenancy.KeyCreate, raw))
    key, _ = _service(tenancy.create_key, tenant, body)
    typer.echo(key)


@key_app.command("list")
def key_list(tenant: str = typer.Option(..., "--tenant"), as_json: bool = JsonOpt) -> None:
    """List a tenant's keys (prefix, scope, expiry, revoked; never the key)."""
    from core.protocol import render
    from core.tenancy import service as tenancy

    _print([render.api_key(k) for k in _service(tenancy.list_keys, tenant)], as_json, KEY_COLUMNS)


@key_app.command("revoke")
def key_revoke(key_id: int) -> None:
    """Revoke a key by id; the next request with it gets 401."""
    from core.infra import kv
    from core.tenancy import service as tenancy

    _service(tenancy.revoke_key, kv.client(get_settings().redis_url), key_id)
    typer.echo(f"key {key_id} revoked")


UrlOpt = typer.Option("http://127.0.0.1:8000", envvar="SPOOL_URL", help="Spool's base URL (or SPOOL_URL).")
KeyOpt = typer.Option(..., envvar="SPOOL_API_KEY", help="API key (or SPOOL_API_KEY).")


def _client(url: str, key: str):
    import httpx

    return httpx.Client(base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=600)


def _check(resp) -> dict:
    if resp.status_code >= 400:
        typer.echo(resp.text, err=True)
        raise typer.Exit(1)
    return resp.json()


@batch_app.command("submit")
def batch_submit(
    file: Path = typer.Argument(..., exists=True, readable=True, help="JSONL: one request per line."),
    url: str = UrlOpt,
    api_key: str = KeyOpt,
    window: str = typer.Option("24h", help="completion_window"),
    wait: bool = typer.Option(False, "--wait", help="Follow the batch with a progress bar until it ends."),
    output: Path | None = typer.Option(None, "-o", help="With --wait: write the results here."),
) -> None:
    """Upload FILE and start a batch on it; print the batch id (and follow it with --wait)."""
    with _client(url, api_key) as http, file.open("rb") as fh:
        f = _check(http.post("/v1/files", files={"file": (file.name, fh)}, data={"purpose": "batch"}))
        b = _check(
            http.post(
                "/v1/batches",
                json={"input_file_id": f["id"], "endpoint": "/v1/completions", "completion_window": window},
            )
        )
        typer.echo(b["id"])
        if wait:
            b = _follow(http, b["id"])
            if output:
                _download(http, b, output)


def _follow(http, batch_id: str) -> dict:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    from core.states import FINAL, BatchStatus

    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[failed]} failed"),
        TextColumn("{task.fields[rate]:.1f}/s"),
        TimeRemainingColumn(),
    )
    started = time.monotonic()
    with Progress(*columns) as bar:
        task = bar.add_task(BatchStatus.validating.value, total=None, failed=0, rate=0.0)
        while True:
            b = _check(http.get(f"/v1/batches/{batch_id}"))
            c = b["request_counts"]
            done = c["completed"] + c["failed"]
            bar.update(
                task,
                description=b["status"],
                total=c["total"] or None,
                completed=done,
                failed=c["failed"],
                rate=done / max(time.monotonic() - started, 1e-6),
            )
            if b["status"] in FINAL:
                break
            time.sleep(1)
    if b["status"] == BatchStatus.failed:
        for e in (b.get("errors") or {}).get("data", [])[:20]:
            typer.echo(f"line {e.get('line')}: {e.get('code')}: {e.get('message')}", err=True)
    typer.echo(f"{batch_id}: {b['status']} {b['request_counts']}")
    return b


def _download(http, b: dict, output: Path) -> None:
    with output.open("wb") as out:
        for fid in (b.get("output_file_id"), b.get("error_file_id")):
            if fid:
                with http.stream("GET", f"/v1/files/{fid}/content") as resp:
                    for chunk in resp.iter_bytes():
                        out.write(chunk)
    typer.echo(f"results written to {output}")


@batch_app.command("results")
def batch_results(
    batch_id: str,
    output: Path = typer.Option(..., "-o", help="Where to write the JSONL."),
    url: str = UrlOpt,
    api_key: str = KeyOpt,
) -> None:
    """Download a finished batch's output and error lines into one JSONL file."""
    with _client(url, api_key) as http:
        _download(http, _check(http.get(f"/v1/batches/{batch_id}")), output)


@batch_app.command("status")
def batch_status(
    batch_id: str, url: str = UrlOpt, api_key: str = KeyOpt, wait: bool = typer.Option(False, "--wait")
) -> None:
    """Show a batch (and follow it with --wait)."""
    import json

    with _client(url, api_key) as http:
        if wait:
            _follow(http, batch_id)
        else:
            typer.echo(json.dumps(_check(http.get(f"/v1/batches/{batch_id}")), indent=2))


def main() -> None:
    app()


if __name__ == "__main__":
    main()
