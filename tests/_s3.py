"""moto's S3 server on a free local port, with a bucket, for the tests of S3 storage: the
environment the server reads (credentials, TREADLE_S3_ENDPOINT_URL) set for as long as it
runs."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import boto3
import pytest

from treadle.launch import free_port


@contextlib.contextmanager
def moto_s3(bucket: str) -> Iterator[str]:
    """→ the endpoint URL of a running moto S3 server holding an empty `bucket`."""
    moto_server = pytest.importorskip("moto.server")
    port = free_port()
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    url = f"http://127.0.0.1:{port}"
    try:
        with pytest.MonkeyPatch.context() as mp:
            for name, value in {
                "AWS_ACCESS_KEY_ID": "testing",
                "AWS_SECRET_ACCESS_KEY": "testing",
                "AWS_DEFAULT_REGION": "us-east-1",
                "TREADLE_S3_ENDPOINT_URL": url,
            }.items():
                mp.setenv(name, value)
            boto3.client("s3", endpoint_url=url).create_bucket(Bucket=bucket)
            yield url
    finally:
        server.stop()
