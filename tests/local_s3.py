"""A local S3 endpoint (moto's threaded server, on 127.0.0.1 unless given another local
address) for the tests that read and write ``s3://`` URLs: no network, no credentials."""

from __future__ import annotations

import socket
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager

_SERVERS: dict[str, object] = {}  # endpoint URL -> its running server


@contextmanager
def local_s3(bucket: str, host: str = "127.0.0.1") -> Iterator[dict]:
    """A running endpoint on ``host`` with ``bucket`` created; yields the fsspec storage
    options that reach it, and stops the server afterwards."""
    import boto3

    with socket.socket() as s:
        s.bind((host, 0))
        port = s.getsockname()[1]
    options = {
        "endpoint_url": f"http://{host}:{port}",
        "key": "test",
        "secret": "test",
        "client_kwargs": {"region_name": "us-east-1"},
    }
    start_endpoint(options)
    try:
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
        stop_endpoint(options)


def stop_endpoint(options: dict) -> None:
    """Stop the endpoint of ``options``: its connections are refused until
    :func:`start_endpoint` (its objects stay: moto keeps them in this process)."""
    server = _SERVERS.pop(options["endpoint_url"], None)
    if server is not None:
        server.stop()


def start_endpoint(options: dict) -> None:
    """(Re)start the endpoint of ``options`` on its port."""
    from moto import server as moto_server

    host, port = options["endpoint_url"].removeprefix("http://").rsplit(":", 1)
    server = moto_server.ThreadedMotoServer(ip_address=host, port=int(port), verbose=False)
    server.start()
    _SERVERS[options["endpoint_url"]] = server
