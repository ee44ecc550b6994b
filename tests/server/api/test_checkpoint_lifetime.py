"""Checkpoint lifetime against a real server (in this process) with moto's S3 server as a
real object store: a checkpoint's TTL (given at save, or set and cleared later through the
tinker SDK) ends in its files deleted, locally and the versions published from it in S3,
with its row saying so, while a version its group's retention rule keeps stays; storage
per tenant is reported (billing/usage/checkpoints/current) and capped by max_storage_bytes.

    .venv/bin/python -m pytest -q tests/server/api/test_checkpoint_lifetime.py
"""

from __future__ import annotations

import sqlite3
import time
from pathlib import Path

import pytest
from _s3 import moto_s3
from _tenancy import TINY, Api, make_tenants

from treadle import ServiceClient
from treadle.client.transport import RetryPolicy

tinker = pytest.importorskip("tinker")
boto3 = pytest.importorskip("boto3")

BUCKET = "lifetime"
SWEEP_S = 0.2
TTL_S = 3
WAIT = 120
FAST_RETRY = RetryPolicy(initial_backoff_s=0.01, max_backoff_s=0.1, deadline_s=20)


@pytest.fixture(scope="module")
def s3():
    with moto_s3(BUCKET) as url:
        yield boto3.client("s3", endpoint_url=url)


@pytest.fixture(scope="module")
def server(s3, tiny_model_dir, tmp_path_factory):
    from _inproc import InProcessServer

    data = tmp_path_factory.mktemp("lifetime")
    quota = 150_000  # bytes: one adapter of the tiny model fits (about 100 kB), two do not
    keys = make_tenants(data, {"alice": None, "carol": {"max_storage_bytes": quota}})
    config = {"checkpoint_sweep_s": SWEEP_S}
    with InProcessServer({TINY: tiny_model_dir}, data, config=config) as srv:
        srv.keys, srv.quota = keys, quota
        yield srv


def objects(s3, prefix: str) -> set[str]:
    listed = s3.list_objects_v2(Bucket=BUCKET, Prefix=prefix).get("Contents", [])
    return {o["Key"] for o in listed}


def checkpoint_row(server, path: str) -> dict:
    with sqlite3.connect(server.data_dir / "treadle.db") as db:
        db.row_factory = sqlite3.Row
        found = db.execute("SELECT * FROM checkpoints WHERE tinker_path = ?", (path,)).fetchone()
    return dict(found)


def folder_of(server, path: str) -> Path:
    return Path(checkpoint_row(server, path)["dir"])


def wait_for(pred, what: str) -> None:
    deadline = time.monotonic() + WAIT
    while not pred():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def test_ttl_deletes_files_local_and_s3_and_the_row_says_so(server, s3):
    key = server.keys["alice"]
    plain = ServiceClient(base_url=server.url, api_key=key, retry=FAST_RETRY)
    loose = ServiceClient(
        base_url=server.url, api_key=key, retry=FAST_RETRY,
        model_package_group="loose", output_path=f"s3://{BUCKET}/loose",
    )  # fmt: skip
    ruled = ServiceClient(
        base_url=server.url, api_key=key, retry=FAST_RETRY,
        model_package_group="ruled", output_path=f"s3://{BUCKET}/ruled",
    )  # fmt: skip
    try:
        kept = plain.create_lora_training_client(TINY, rank=2).save_state("kept").result(WAIT)
        tc = loose.create_lora_training_client(TINY, rank=2)
        # each checked as soon as it is saved: a TTL short enough to wait for runs out
        # while a loaded machine makes the next client
        short = tc.save_weights_for_sampler("short", ttl_seconds=TTL_S).result(WAIT)
        assert objects(s3, "loose/") and folder_of(server, short.path).is_dir()
        rtc = ruled.create_lora_training_client(TINY, rank=2)
        rtc.save_weights_for_sampler("anchor").result(WAIT)  # makes the group
        ruled.checkpoints.set_retention("ruled", keep_last=5)
        by_rule = rtc.save_weights_for_sampler("by-rule", ttl_seconds=TTL_S).result(WAIT)
        assert objects(s3, "ruled/") and folder_of(server, by_rule.path).is_dir()
        local = [folder_of(server, p) for p in (short.path, by_rule.path)]

        wait_for(lambda: checkpoint_row(server, short.path)["expired_at"] is not None, "expiry")
        wait_for(lambda: checkpoint_row(server, by_rule.path)["expired_at"] is not None, "expiry")
        assert not any(f.exists() for f in local)  # the checkpoints' own folders
        assert objects(s3, "loose/") == set()  # its version went with it (no rule)
        assert objects(s3, "ruled/")  # kept: the group's rule keeps its versions
        assert [v.ref for v in ruled.checkpoints.list_versions("ruled")] == ["ruled:1", "ruled:2"]
        assert loose.checkpoints.list_versions("loose") == []
        row = checkpoint_row(server, short.path)
        assert row["size_bytes"] == 0 and row["expires_at"] is not None
        assert folder_of(server, kept.path).is_dir()  # no TTL: untouched

        # an expired checkpoint is a 404 that says so, and listings leave it out
        rest = tinker.RestClient(base_url=server.url, api_key=key)
        with pytest.raises(tinker.NotFoundError, match="expired"):
            rest.get_weights_info_by_tinker_path(short.path).result(timeout=WAIT)
        listed = rest.list_user_checkpoints().result(timeout=WAIT).checkpoints
        assert short.path not in {c.tinker_path for c in listed}
        assert kept.path in {c.tinker_path for c in listed}
    finally:
        for c in (plain, loose, ruled):
            c.close()


def test_a_ttl_set_later_through_the_sdk_and_cleared(server):
    svc = tinker.ServiceClient(base_url=server.url, api_key=server.keys["alice"])
    try:
        tc = svc.create_lora_training_client(base_model=TINY, rank=2).result()
        later = tc.save_state("later").result(timeout=WAIT).path
        spared = tc.save_state("spared").result(timeout=WAIT).path
        rest = tinker.RestClient(base_url=server.url, api_key=server.keys["alice"])
        rest.set_checkpoint_ttl_from_tinker_path(spared, 1).result(timeout=WAIT)
        rest.set_checkpoint_ttl_from_tinker_path(spared, None).result(timeout=WAIT)  # cleared
        rest.set_checkpoint_ttl_from_tinker_path(later, 1).result(timeout=WAIT)
        listed = {c.tinker_path: c for c in rest.list_checkpoints(tc.model_id).result().checkpoints}
        assert listed[later].expires_at is not None and listed[spared].expires_at is None
        wait_for(lambda: checkpoint_row(server, later)["expired_at"] is not None, "expiry")
        time.sleep(4 * SWEEP_S)
        assert checkpoint_row(server, spared)["expired_at"] is None
        assert folder_of(server, spared).is_dir() and not folder_of(server, later).exists()
        with pytest.raises(tinker.NotFoundError, match="expired"):
            svc.create_training_client_from_state(later).result(timeout=WAIT)
    finally:
        svc.close("success").result(timeout=30)


def test_storage_is_reported_and_capped_by_the_quota(server):
    svc = tinker.ServiceClient(base_url=server.url, api_key=server.keys["carol"], project_id="p")
    try:
        rest = tinker.RestClient(base_url=server.url, api_key=server.keys["carol"])
        admin = tinker.AdminClient(base_url=server.url, api_key=server.keys["carol"])
        tc = svc.create_lora_training_client(base_model=TINY, rank=2).result()
        first = tc.save_weights_for_sampler("first").result(timeout=WAIT)
        usage = admin.get_current_checkpoint_storage_usage().result(timeout=WAIT)
        size = checkpoint_row(server, first.path)["size_bytes"]
        assert [(u.project_id, u.checkpoint_count, u.size_bytes) for u in usage.data] == [
            ("p", 1, size)
        ]
        assert size < server.quota < 2 * size
        tc.save_weights_for_sampler("second").result(timeout=WAIT)  # under the quota at filing
        with pytest.raises(tinker.PermissionDeniedError, match="max_storage_bytes"):
            tc.save_state("third").result(timeout=WAIT)
        # the refused save held its place in the order: the client's next op runs
        rest.delete_checkpoint_from_tinker_path(first.path).result(timeout=WAIT)
        tc.save_state("fourth").result(timeout=WAIT)  # room again
        other = Api(server.url, server.keys["alice"])
        assert "carol" not in other.get("billing/usage/checkpoints/current").text
        other.close()
    finally:
        svc.close("success").result(timeout=30)
