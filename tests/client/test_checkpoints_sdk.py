"""SDK-side pieces of model package groups that need no server: version references the
SDK resolves itself, and the CLI's duration flag.

    .venv/bin/python -m pytest -q tests/client/test_checkpoints_sdk.py
"""

from __future__ import annotations

import argparse

import pytest

from treadle.checkpoints_cli import build_help, parse_duration
from treadle.client.service import _is_version_ref


def test_version_references_are_told_from_paths():
    assert _is_version_ref("math-sft:3") and _is_version_ref("math-sft:latest")
    for path in ("tinker://run/sampler_weights/x", "/abs/folder", "g:", "g:abc", "a/b:1"):
        assert not _is_version_ref(path)


def test_durations():
    assert parse_duration("90") == 90 and parse_duration("15m") == 900
    assert parse_duration("12h") == 43200 and parse_duration("7d") == 604800
    with pytest.raises(argparse.ArgumentTypeError, match="duration"):
        parse_duration("soon")


def test_cli_actions():
    assert {"list", "show", "download", "delete", "retain"} <= set(build_help())
