"""SDK-side pieces of model package groups that need no server: the CLI's flags.

.venv/bin/python -m pytest -q tests/client/test_checkpoints_sdk.py
"""

from __future__ import annotations

import argparse

import pytest

from treadle.cli.checkpoints import build_help, parse_duration


def test_durations():
    assert parse_duration("90") == 90 and parse_duration("15m") == 900
    assert parse_duration("12h") == 43200 and parse_duration("7d") == 604800
    with pytest.raises(argparse.ArgumentTypeError, match="duration"):
        parse_duration("soon")


def test_cli_actions():
    assert {"list", "show", "download", "delete", "retain"} <= set(build_help())
