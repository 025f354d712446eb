"""A local S3 endpoint (moto's threaded server on 127.0.0.1) for the tests that read and
write ``s3://`` URLs: no network, no credentials."""

from __future__ import annotations

import socket
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def local_s3(bucket: str) -> Iterator[dict]:
    """A running endpoint with ``bucket`` created; yields the fsspec storage options
    that reach it, and stops the server afterwards."""
    import boto3
    from moto import server as moto_server

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    try:
        options = {
            "endpoint_url": f"http://127.0.0.1:{port}",
            "key": "test",
            "secret": "test",
            "client_kwargs": {"region_name": "us-east-1"},
        }
        # moto keeps its buckets in the process, across servers: start empty (a second
        # pytest run in one process, as mutmut's, would find the last run's objects)
        urllib.request.urlopen(
            urllib.request.Request(f"{options['endpoint_url']}/moto-api/reset", method="POST")
        ).close()
        boto3.client(
            "s3",
            endpoint_url=options["endpoint_url"],
            aws_access_key_id="test",
            aws_secret_access_key="test",
            region_name="us-east-1",
        ).create_bucket(Bucket=bucket)
        yield options
    finally:
        server.stop()
