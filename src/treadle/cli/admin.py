"""`treadle admin ...` (tenants, keys, quotas) and `treadle usage`.

Both work on the server's database, found like `treadle serve` finds it (--data-dir, --db,
or a --config file's data_dir / db_url); `treadle usage --url` asks a running server
instead, for the tenant of --api-key.

treadle admin create-tenant acme --requests-per-minute 600
treadle admin create-key acme          # prints the key once (--admin: it sees every tenant
                                       # in the console)
treadle admin revoke-key tml-AbCdEfGh
treadle admin set-quotas acme --max-concurrent-sessions 4
treadle admin set-spend-cap acme --period day --usd 20 --tokens 5000000
treadle admin set-spend-cap acme --key tml-AbCdEfGh --period month --usd 100
treadle admin list
treadle usage --tenant acme --since 2026-11-01 --by model
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from treadle.errors import TreadleError

QUOTA_FLAGS = {
    "max_concurrent_sessions": "sessions of the tenant active at once",
    "max_adapters_in_memory": "LoRA adapters held in memory (models + loaded samplers)",
    "max_lora_rank": "largest LoRA rank",
    "max_tokens_per_request": "tokens of one request",
    "requests_per_minute": "operations per sliding minute",
}


def _settings(args: argparse.Namespace) -> dict[str, Any]:
    return json.loads(Path(args.config).read_text()) if args.config else {}


def _db_url(args: argparse.Namespace, settings: dict[str, Any]) -> str:
    # the same rule as ServerConfig.resolved_db_url
    if args.db or settings.get("db_url"):
        return args.db or settings["db_url"]
    data_dir = args.data_dir or settings.get("data_dir") or "./treadle-data"
    return f"sqlite:///{Path(data_dir).resolve() / 'treadle.db'}"


def _store(args: argparse.Namespace):
    from treadle.server.storage.database import Store

    settings = _settings(args)
    url = _db_url(args, settings)
    if url.startswith("sqlite:///"):
        Path(url.removeprefix("sqlite:///")).parent.mkdir(parents=True, exist_ok=True)
    return Store(url)


def _quotas(args: argparse.Namespace) -> dict[str, int | None]:
    return {name: getattr(args, name) for name in QUOTA_FLAGS}


def _run(fn) -> None:
    try:
        fn()
    except (TreadleError, ValueError) as e:
        sys.exit(f"treadle: {e}")


def admin(args: argparse.Namespace) -> None:
    from treadle.server.tenancy import spend, tenants

    def go() -> None:
        store = _store(args)
        try:
            if args.admin_command == "create-tenant":
                row = tenants.create_tenant(store, args.name, _quotas(args))
                print(f"created tenant {row.name} (id {row.tenant_id})")
            elif args.admin_command == "create-key":
                key, row = tenants.create_key(store, args.tenant, admin=args.admin)
                print(key)
                print(
                    f"{'admin ' if args.admin else ''}key {row.key_id}... for tenant "
                    f"{args.tenant}: shown once, only its hash is stored",
                    file=sys.stderr,
                )
            elif args.admin_command == "revoke-key":
                row = tenants.revoke_key(store, args.key)
                print(f"revoked key {row.key_id}...")
            elif args.admin_command == "set-quotas":
                row = tenants.set_quotas(store, args.tenant, _quotas(args))
                print(f"tenant {row.name} quotas: {json.dumps(row.quotas or {})}")
            elif args.admin_command == "set-spend-cap":
                cap = spend.set_cap(
                    store, args.tenant, args.period, args.tokens, args.usd, key=args.key
                )
                who = f"key {args.key[:12]}..." if args.key else f"tenant {args.tenant}"
                if cap is None:
                    print(f"{who}: no spend cap per {args.period}")
                else:
                    print(f"{who}: spend cap per {args.period} (UTC): {json.dumps(cap)}")
            elif args.admin_command == "list":
                listed = tenants.list_tenants(store)
                caps = spend.list_caps(store)
                for t in listed:
                    t["spend_caps"] = [c for c in caps if c["tenant"] == t["name"]]
                print(json.dumps(listed, indent=2))
        finally:
            store.close()

    _run(go)


def usage(args: argparse.Namespace) -> None:
    from treadle.server.tenancy import metering

    def go() -> None:
        if args.url:
            report = _usage_from_server(args)
        else:
            report = _usage_from_db(args)
        print(json.dumps(report, indent=2) if args.json else metering.format_report(report))

    _run(go)


def _usage_from_db(args: argparse.Namespace) -> dict[str, Any]:
    from treadle.server.config import Price
    from treadle.server.tenancy import metering, tenants

    settings = _settings(args)
    prices = {m: Price(**p) for m, p in settings.get("prices", {}).items()}
    store = _store(args)
    try:
        tenant_id = None
        if args.tenant:
            if args.tenant == "default":
                tenant_id = "default"
            else:
                tenant_id = tenants.find_tenant(store, args.tenant).tenant_id
        return metering.usage_report(
            store.engine, prices, tenant_id, metering.parse_since(args.since), args.by
        )
    finally:
        store.close()


def _usage_from_server(args: argparse.Namespace) -> dict[str, Any]:
    import httpx

    key = args.api_key or os.environ.get("TREADLE_API_KEY") or os.environ.get("TINKER_API_KEY")
    params = {k: v for k, v in (("since", args.since), ("by", args.by)) if v}
    resp = httpx.get(
        f"{args.url.rstrip('/')}/api/v1/treadle/usage",
        params=params,
        headers={"X-API-Key": key} if key else {},
        timeout=30,
    )
    if resp.status_code != 200:
        raise ValueError(f"HTTP {resp.status_code}: {resp.text}")
    return resp.json()


def _db_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--data-dir", help="the server's data folder (default ./treadle-data)")
    p.add_argument("--db", help="the server's SQLAlchemy URL (default: SQLite under --data-dir)")
    p.add_argument("--config", help="the server's JSON config file (data_dir, db_url, prices)")


def _quota_flags(p: argparse.ArgumentParser) -> None:
    for name, help_text in QUOTA_FLAGS.items():
        p.add_argument(f"--{name.replace('_', '-')}", dest=name, type=int, help=help_text)


def add_parsers(sub: Any) -> None:
    """The `admin` and `usage` subcommands of the `treadle` parser."""
    p = sub.add_parser("admin", help="tenants, API keys and quotas (on the server's database)")
    admin_sub = p.add_subparsers(dest="admin_command", required=True)
    q = admin_sub.add_parser("create-tenant", help="add a tenant (ends development mode)")
    q.add_argument("name")
    _quota_flags(q)
    q = admin_sub.add_parser("create-key", help="a new API key for a tenant, printed once")
    q.add_argument("tenant", help="tenant name or id")
    q.add_argument(
        "--admin", action="store_true", help="the key also sees every tenant in the console"
    )
    q = admin_sub.add_parser(
        "revoke-key", help="stop a key (a running server stops it within --auth-cache-ttl-s)"
    )
    q.add_argument("key", help="the key, or its id (its first 12 characters, see list)")
    q = admin_sub.add_parser("set-quotas", help="set a tenant's quotas (0 clears one)")
    q.add_argument("tenant", help="tenant name or id")
    _quota_flags(q)
    q = admin_sub.add_parser(
        "set-spend-cap",
        help="cap what a tenant (or one of its keys) spends per UTC day or month; 0 clears",
    )
    q.add_argument("tenant", help="tenant name or id")
    q.add_argument("--period", choices=["day", "month"], required=True)
    q.add_argument("--tokens", type=int, help="prefill + sample + train tokens (0 clears)")
    q.add_argument("--usd", type=float, help="dollars, from the config's prices (0 clears)")
    q.add_argument("--key", help="cap only this key of the tenant (the key or its id)")
    admin_sub.add_parser("list", help="tenants, their quotas, spend caps and key ids, as JSON")
    for q in admin_sub.choices.values():
        _db_flags(q)
    p.set_defaults(func=admin)

    p = sub.add_parser("usage", help="metered tokens and their cost")
    p.add_argument("--tenant", help="one tenant (name or id); default all")
    p.add_argument("--since", help="a date (YYYY-MM-DD) or ISO time, UTC")
    p.add_argument("--by", choices=["session", "day", "model"], help="rows by; default tenant")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--url", help="ask a running server instead (for the tenant of the key)")
    p.add_argument("--api-key", help="with --url (default $TREADLE_API_KEY / $TINKER_API_KEY)")
    _db_flags(p)
    p.set_defaults(func=usage)
