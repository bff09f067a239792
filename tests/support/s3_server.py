"""A real S3 endpoint for tests: moto's server on 127.0.0.1, reached through `AWS_ENDPOINT_URL`."""

from __future__ import annotations

import socket
from pathlib import Path


class S3Server:
    """`with S3Server() as s3:` a moto S3 server on a free port; `s3.env` is the environment that
    points boto3 / s3fs at it, `s3.upload(directory, "s3://bucket/prefix")` puts a directory there."""

    def __enter__(self) -> "S3Server":
        import boto3
        from moto.server import ThreadedMotoServer

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self._server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
        self._server.start()
        self.env = {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}", "AWS_ACCESS_KEY_ID": "testing",
                    "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}
        self.client = boto3.client("s3", endpoint_url=self.env["AWS_ENDPOINT_URL"], region_name="us-east-1",
                                   aws_access_key_id="testing", aws_secret_access_key="testing")
        return self

    def __exit__(self, *exc) -> None:
        self._server.stop()

    def put(self, uri: str, data: bytes) -> None:
        """Write one object (its bucket is made if missing)."""
        bucket, key = uri.removeprefix("s3://").split("/", 1)
        if bucket not in {b["Name"] for b in self.client.list_buckets()["Buckets"]}:
            self.client.create_bucket(Bucket=bucket)
        self.client.put_object(Bucket=bucket, Key=key, Body=data)

    def upload(self, directory: Path, uri: str) -> None:
        """Every file under `directory`, at the same relative key under `uri`."""
        for path in sorted(directory.rglob("*")):
            if path.is_file():
                self.put(f"{uri.rstrip('/')}/{path.relative_to(directory)}", path.read_bytes())
