"""A real S3 server for tests: moto's, in a thread of the test process, recording each request it receives; the
client under test (s3fs) talks to it over HTTP through the usual AWS_* environment."""
from __future__ import annotations

import shutil
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import fsspec
import pytest
from moto.server import ThreadedMotoServer

from raylm.configs.cache import cache_path, content_key
from raylm.configs.envs import cache_dir

BUCKET = f"raylm-test-{uuid.uuid4().hex[:8]}"  # a run's own URIs: their copies never meet another run's


class RecordingMotoServer(ThreadedMotoServer):
    """moto's threaded S3 server, its WSGI app wrapped to record each request's method, path and Range header."""

    def __init__(self) -> None:
        super().__init__(ip_address="127.0.0.1", port=0, verbose=False)
        self.requests: list[tuple[str, str, str | None]] = []

    def _server_entry(self) -> None:
        from moto.moto_server.threaded_moto_server import MotoRequestHandler
        from moto.server import DomainDispatcherApplication, create_backend_app
        from werkzeug.serving import make_server

        app = DomainDispatcherApplication(create_backend_app)

        def recording(environ: dict[str, Any], start_response: Any) -> Any:
            self.requests.append((environ["REQUEST_METHOD"], environ["PATH_INFO"], environ.get("HTTP_RANGE")))
            return app(environ, start_response)

        self._server = make_server(self._ip_address, self._port, recording, True, request_handler=MotoRequestHandler)
        self._server_ready_event.set()
        self._server.serve_forever()


@dataclass
class S3:
    server: RecordingMotoServer
    uploaded: set[str] = field(default_factory=set)

    def upload(self, local: Path, key: str) -> str:
        """Put a folder (or one file) at s3://BUCKET/key, once; its URI."""
        if key not in self.uploaded:
            fs = fsspec.filesystem("s3", skip_instance_cache=True)
            if local.is_dir():
                for path in sorted(p for p in local.rglob("*") if p.is_file()):
                    fs.pipe_file(f"{BUCKET}/{key}/{path.relative_to(local)}", path.read_bytes())
            else:
                fs.pipe_file(f"{BUCKET}/{key}", local.read_bytes())
            self.uploaded.add(key)
        return f"s3://{BUCKET}/{key}"

    def gets(self, key_part: str) -> list[str | None]:
        """The Range headers of the object GETs (not listings) whose path contains `key_part`."""
        return [rng for method, path, rng in self.server.requests
                if method == "GET" and key_part in path and path.count("/") > 1]


@pytest.fixture(scope="module", name="s3")
def s3_fixture() -> Iterator[S3]:
    """The server, its bucket, and the environment s3fs reads pointing at it, for one test module."""
    server = RecordingMotoServer()
    server.start()
    host, port = server.get_host_and_port()
    # moto keeps its buckets in the process, not in the server: a module after another starts from none.
    urllib.request.urlopen(urllib.request.Request(f"http://{host}:{port}/moto-api/reset", method="POST")).close()
    with pytest.MonkeyPatch.context() as env:
        # The usual environment, as s3fs (botocore) reads it, and nothing from this machine's own AWS set-up.
        for name, value in {"AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test",
                            "AWS_ENDPOINT_URL": f"http://{host}:{port}", "AWS_DEFAULT_REGION": "us-east-1",
                            "AWS_CONFIG_FILE": "/nonexistent", "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent",
                            "AWS_EC2_METADATA_DISABLED": "true"}.items():
            env.setenv(name, value)
        fsspec.filesystem("s3", skip_instance_cache=True).mkdir(BUCKET)
        yield S3(server)
    server.stop()


def copy_root(uri: str) -> Path:
    return cache_path("object-storage", content_key(uri))


@pytest.fixture(autouse=True, name="cache")
def cache_fixture(s3: S3) -> Iterator[Path]:
    """The user cache (its CPU kernels built already), holding no copy of this run's URIs when each test starts.
    A test module imports both fixtures (`s3_fixture`, `cache_fixture`) to use them."""
    yield cache_dir()
    for key in s3.uploaded:
        shutil.rmtree(copy_root(f"s3://{BUCKET}/{key}"), ignore_errors=True)


