"""Pytest plugin: real ``redis-server`` processes on loopback (loaded from tests/conftest.py).

Fixtures
--------
``redis_url`` (session)          URL of one standalone server shared by the whole session.
``redis_cluster_url`` (session)  ``redis+cluster://`` URL of a 3-node Redis Cluster (no replicas).
``redis_server`` (function)      A private :class:`~radixkv.testing_redis.RedisServerProcess` with
                                 ``.url``, ``.port``, ``.stop()`` (SIGKILL + wait), ``.start()`` (same
                                 port), ``.pause()``/``.resume()`` (SIGSTOP/SIGCONT); safe to kill.
``redis_server_factory`` (function)  ``factory(password=None, tls=False, extra_args=())`` starts more
                                 private servers; all are killed when the test ends.
``redis_cluster`` (function)     A private 3-node :class:`~radixkv.testing_redis.RedisClusterProcesses`
                                 (``.url``, ``.nodes``, ``.wait_ok()``, ``.move_slot()``) for tests
                                 that kill nodes or reshard.
``redis_cluster_with_replicas`` (function)  The same with 3 primaries and 3 replicas (failovers).
``redis_tls_cluster`` (function) The same over TLS only (``rediss+cluster://...?ssl_ca_certs=...``).
``redis_tls_files`` (session)    A self-signed cert/key for 127.0.0.1 (generated with openssl).

Shared servers are never flushed: tests isolate themselves with unique namespaces (``uuid4().hex``).
Every fixture skips with a reason when ``redis-server`` (or ``redis-cli`` for the cluster) is missing.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

from radixkv.testing_redis import (
    RedisClusterProcesses,
    RedisServerProcess,
    TlsFiles,
    make_tls_files,
    redis_cli_binary,
    redis_server_binary,
)

_INSTALL_HINT = "install it (Debian/Ubuntu: apt-get install redis-server redis-tools) to run Redis tests"


def _require_server() -> None:
    if redis_server_binary() is None:
        pytest.skip(f"redis-server not on PATH; {_INSTALL_HINT}")


@pytest.fixture(scope="session")
def _redis_session_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServerProcess]:
    _require_server()
    server = RedisServerProcess(tmp_path_factory.mktemp("redis-standalone")).start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def redis_url(_redis_session_server: RedisServerProcess) -> str:
    return _redis_session_server.url


def _require_cluster_tools() -> None:
    _require_server()
    if redis_cli_binary() is None:
        pytest.skip(f"redis-cli not on PATH (needed to create a cluster); {_INSTALL_HINT}")


@pytest.fixture(scope="session")
def redis_cluster_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    _require_cluster_tools()
    cluster = RedisClusterProcesses(tmp_path_factory.mktemp("redis-cluster"), n_nodes=3).start()
    yield cluster.url
    cluster.stop()


@pytest.fixture
def redis_cluster(tmp_path: Path) -> Iterator[RedisClusterProcesses]:
    _require_cluster_tools()
    cluster = RedisClusterProcesses(tmp_path / "cluster", n_nodes=3).start()
    yield cluster
    cluster.stop()


@pytest.fixture
def redis_cluster_with_replicas(tmp_path: Path) -> Iterator[RedisClusterProcesses]:
    _require_cluster_tools()
    cluster = RedisClusterProcesses(tmp_path / "cluster", n_nodes=6, replicas=1).start()
    yield cluster
    cluster.stop()


@pytest.fixture
def redis_tls_cluster(tmp_path: Path, redis_tls_files: TlsFiles) -> Iterator[RedisClusterProcesses]:
    _require_cluster_tools()
    cluster = RedisClusterProcesses(tmp_path / "tls-cluster", n_nodes=3, tls=redis_tls_files).start()
    yield cluster
    cluster.stop()


@pytest.fixture(scope="session")
def redis_tls_files(tmp_path_factory: pytest.TempPathFactory) -> TlsFiles:
    if shutil.which("openssl") is None:
        pytest.skip("openssl CLI not on PATH; install openssl to run the TLS test")
    return make_tls_files(tmp_path_factory.mktemp("redis-tls"))


@pytest.fixture
def redis_server_factory(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Callable[..., RedisServerProcess]]:
    _require_server()
    started: list[RedisServerProcess] = []

    def factory(password: str | None = None, tls: bool = False, extra_args: Any = ()) -> RedisServerProcess:
        tls_files = request.getfixturevalue("redis_tls_files") if tls else None
        server = RedisServerProcess(tmp_path / f"redis-{len(started)}", password=password, tls=tls_files,
                                    extra_args=tuple(extra_args))
        started.append(server)
        return server.start()

    yield factory
    for server in started:
        server.stop()  # SIGKILL also ends a SIGSTOPped server


@pytest.fixture
def redis_server(redis_server_factory: Callable[..., RedisServerProcess]) -> RedisServerProcess:
    return redis_server_factory()
