"""`treadle checkpoints list|show|download|delete|retain`: model package groups from a shell.

    treadle checkpoints list                       # groups
    treadle checkpoints list math-sft [--kind sampler]
    treadle checkpoints show math-sft:latest
    treadle checkpoints download math-sft:7 exports/math-sft-7
    treadle checkpoints delete math-sft:3
    treadle checkpoints retain math-sft --keep-last 3 --state-ttl 7d

The server and key come from --base-url / --api-key or TREADLE_BASE_URL / TREADLE_API_KEY;
encrypted versions need --encryption-key or TREADLE_ENCRYPTION_KEY.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from typing import Any

_DURATION = re.compile(r"^(\d+(?:\.\d+)?)([smhdw]?)$")
_SECONDS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


def parse_duration(text: str) -> float:
    """`90`, `90s`, `15m`, `12h`, `7d`, `2w` → seconds."""
    m = _DURATION.match(text.strip())
    if m is None:
        raise argparse.ArgumentTypeError(f"expected a duration like 3600, 12h or 7d, got {text!r}")
    return float(m.group(1)) * _SECONDS[m.group(2)]


def add_parser(sub: Any) -> None:
    """The `checkpoints` subcommand and its actions, on cli.py's subparsers."""
    p = sub.add_parser("checkpoints", help="model package groups: list, download, retain")
    p.add_argument("--base-url", help="default TREADLE_BASE_URL or http://127.0.0.1:8000")
    p.add_argument("--api-key", help="default TREADLE_API_KEY")
    p.add_argument("--encryption-key", help="default TREADLE_ENCRYPTION_KEY")
    p.add_argument("--json", action="store_true", help="print JSON")
    actions = p.add_subparsers(dest="action", required=True)

    a = actions.add_parser("list", help="groups, or the versions of GROUP")
    a.add_argument("group", nargs="?")
    a.add_argument("--kind", choices=["sampler", "merged", "state"])
    a = actions.add_parser("show", help="one version (GROUP:N or GROUP:latest)")
    a.add_argument("ref")
    a = actions.add_parser("download", help="a version's files into a folder")
    a.add_argument("ref")
    a.add_argument("dest")
    a = actions.add_parser("delete", help="delete a version and its files")
    a.add_argument("ref")
    a = actions.add_parser("retain", help="set a group's retention and apply it now")
    a.add_argument("group")
    a.add_argument("--keep-last", type=int, help="sampler versions kept (per kind)")
    a.add_argument("--state-ttl", type=parse_duration, help="e.g. 7d: older states go")
    p.set_defaults(func=run)


def _human(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows, strict=True)]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    head = "  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True))
    return "\n".join([head, *lines])


def run(args: argparse.Namespace) -> None:
    from treadle.client.errors import APIError
    from treadle.client.service import ServiceClient

    key = args.encryption_key or os.environ.get("TREADLE_ENCRYPTION_KEY")
    try:
        client = ServiceClient(base_url=args.base_url, api_key=args.api_key, encryption_key=key)
    except APIError as e:
        sys.exit(f"treadle checkpoints: cannot reach the server: {e}")
    try:
        _dispatch(client, args)
    except APIError as e:
        sys.exit(f"treadle checkpoints {args.action}: {e}")
    finally:
        client.close()


def _dispatch(client: Any, args: argparse.Namespace) -> None:
    ck = client.checkpoints
    out: Any
    if args.action == "list" and args.group is None:
        groups = ck.list_groups()
        out = [g.model_dump() for g in groups]
        text = _table(
            [
                [g.name, g.versions, g.latest or "-", _human(g.size_bytes), g.keep_last or "-"]
                for g in groups
            ],
            ["GROUP", "VERSIONS", "LATEST", "SIZE", "KEEP_LAST"],
        )
    elif args.action == "list":
        versions = ck.list_versions(args.group, args.kind)
        out = [v.model_dump() for v in versions]
        text = _table(
            [
                [
                    v.ref,
                    v.kind,
                    v.step if v.step is not None else "-",
                    _human(v.size_bytes),
                    v.time[:19],
                    "yes" if v.encrypted else "no",
                    v.name or "-",
                ]
                for v in versions
            ],
            ["VERSION", "KIND", "STEP", "SIZE", "TIME", "ENCRYPTED", "NAME"],
        )
    elif args.action == "show":
        out = ck.get_version(args.ref).model_dump()
        text = "\n".join(f"{k}: {v}" for k, v in out.items())
    elif args.action == "download":
        path = ck.download(args.ref, args.dest)
        out = {"ref": args.ref, "dest": str(path)}
        text = f"downloaded {args.ref} to {path}"
    elif args.action == "delete":
        out = ck.delete_version(args.ref).model_dump()
        text = f"deleted {out['ref']}"
    else:
        if args.keep_last is None and args.state_ttl is None:
            sys.exit("treadle checkpoints retain: give --keep-last and/or --state-ttl")
        deleted = ck.set_retention(args.group, args.keep_last, args.state_ttl)
        out = {"deleted": [v.ref for v in deleted]}
        text = f"retention set; deleted {len(deleted)}: {', '.join(out['deleted']) or '-'}"
    print(json.dumps(out, indent=2, default=str) if args.json else text)


def build_help() -> list[str]:
    """The actions of `treadle checkpoints` (for docs and tests)."""
    parser = argparse.ArgumentParser(prog="treadle")
    add_parser(parser.add_subparsers(dest="command"))
    sub = parser._subparsers._group_actions[0].choices["checkpoints"]  # noqa: SLF001
    return sorted(sub._subparsers._group_actions[0].choices)  # noqa: SLF001
