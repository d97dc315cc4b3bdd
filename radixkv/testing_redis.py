"""Launch real ``redis-server`` processes on loopback: one server, a 3-node cluster, TLS material.

Used by the test fixtures (``tests/_redis_servers.py``) and by the Redis tier benchmark. Every server
runs in the foreground of a child process with persistence off (``--save '' --appendonly no``), in its
own work directory, on a free loopback port; :meth:`RedisServerProcess.stop` kills it and waits, and
:meth:`RedisServerProcess.start` brings it back on the *same* port (to test reconnects).

Nothing here is imported by the cache itself.
"""

from __future__ import annotations

import os
import shutil
import socket
import ssl
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

__all__ = [
    "RedisServerProcess",
    "RedisClusterProcesses",
    "TlsFiles",
    "redis_server_binary",
    "free_port",
    "make_tls_files",
]

_READY_TIMEOUT_S = 10.0


def _die_with_parent() -> None:
    """In the child: ask Linux to SIGKILL it when the thread that started it dies, so a crashed test
    run leaves no redis-server behind (no-op elsewhere)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, 9)  # PR_SET_PDEATHSIG, SIGKILL
    except (OSError, AttributeError):
        pass


def redis_server_binary() -> str | None:
    """Path of ``redis-server`` (or ``valkey-server``) on PATH, or None."""
    return shutil.which("redis-server") or shutil.which("valkey-server")


def redis_cli_binary() -> str | None:
    return shutil.which("redis-cli") or shutil.which("valkey-cli")


def free_port(exclude: Sequence[int] = ()) -> int:
    """A TCP port that is free on 127.0.0.1 right now (the kernel picks it)."""
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in exclude:
            return port


@dataclass(frozen=True, slots=True)
class TlsFiles:
    """A self-signed certificate for 127.0.0.1/localhost; the cert is its own CA."""

    cert_file: Path
    key_file: Path

    @property
    def ca_file(self) -> Path:
        return self.cert_file


def make_tls_files(directory: Path) -> TlsFiles:
    """Generate a P-256 self-signed certificate with the ``openssl`` CLI (raises if it is missing)."""
    openssl = shutil.which("openssl")
    if openssl is None:
        raise FileNotFoundError("openssl CLI not on PATH; install openssl to run TLS tests")
    directory.mkdir(parents=True, exist_ok=True)
    cert, key = directory / "cert.pem", directory / "key.pem"
    subprocess.run(
        [openssl, "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
         "-nodes", "-keyout", str(key), "-out", str(cert), "-days", "2", "-subj", "/CN=localhost",
         "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost"],
        check=True, capture_output=True, timeout=30,
    )
    return TlsFiles(cert_file=cert, key_file=key)


@dataclass(slots=True)
class RedisServerProcess:
    """One ``redis-server`` child process on 127.0.0.1:``port`` (chosen free if 0).

    ``password`` sets ``--requirepass``; ``tls`` serves TLS only (plain port disabled);
    ``extra_args`` are appended verbatim (e.g. ``["--cluster-enabled", "yes"]``).
    """

    workdir: Path
    port: int = 0
    password: str | None = None
    tls: TlsFiles | None = None
    extra_args: Sequence[str] = ()
    _proc: subprocess.Popen[bytes] | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.port == 0:
            self.port = free_port()
        self.workdir = Path(self.workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)

    @property
    def url(self) -> str:
        scheme = "rediss" if self.tls else "redis"
        auth = f":{self.password}@" if self.password else ""
        query = f"?ssl_ca_certs={self.tls.ca_file}" if self.tls else ""
        return f"{scheme}://{auth}127.0.0.1:{self.port}/0{query}"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def _argv(self) -> list[str]:
        binary = redis_server_binary()
        if binary is None:
            raise FileNotFoundError("redis-server not on PATH (apt install redis-server redis-tools)")
        argv = [binary, "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                "--dir", str(self.workdir), "--daemonize", "no", "--protected-mode", "no",
                "--logfile", str(self.workdir / f"redis-{self.port}.log")]
        if self.tls is not None:
            argv += ["--port", "0", "--tls-port", str(self.port),
                     "--tls-cert-file", str(self.tls.cert_file), "--tls-key-file", str(self.tls.key_file),
                     "--tls-ca-cert-file", str(self.tls.ca_file), "--tls-auth-clients", "no"]
        else:
            argv += ["--port", str(self.port)]
        if self.password:
            argv += ["--requirepass", self.password]
        return argv + list(self.extra_args)

    def start(self) -> RedisServerProcess:
        """Start (or restart) the server on the same port; returns once it answers PING."""
        if self.running:
            return self
        self._proc = subprocess.Popen(self._argv(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                      preexec_fn=_die_with_parent)
        deadline = time.monotonic() + _READY_TIMEOUT_S
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                err = self._proc.stderr.read().decode(errors="replace") if self._proc.stderr else ""
                log = self.workdir / f"redis-{self.port}.log"
                tail = log.read_text(errors="replace")[-2000:] if log.exists() else ""
                raise RuntimeError(f"redis-server on port {self.port} exited: {err}{tail}")
            if self._answers_ping():
                return self
            time.sleep(0.02)
        self.stop()
        raise RuntimeError(f"redis-server on port {self.port} did not answer within {_READY_TIMEOUT_S} s")

    def _answers_ping(self) -> bool:
        try:
            raw = socket.create_connection(("127.0.0.1", self.port), timeout=0.5)
        except OSError:
            return False
        sock: socket.socket = raw
        try:
            if self.tls is not None:
                ctx = ssl.create_default_context(cafile=str(self.tls.ca_file))
                # its own certificate as the client's: a server started with --tls-auth-clients yes
                # (in extra_args) requires one, and the others do not ask
                ctx.load_cert_chain(str(self.tls.cert_file), str(self.tls.key_file))
                sock = ctx.wrap_socket(raw, server_hostname="127.0.0.1")
            sock.sendall(b"PING\r\n")
            reply = sock.recv(64)
            # -NOAUTH also proves the server is up and serving.
            return reply.startswith((b"+PONG", b"-NOAUTH"))
        except OSError:
            return False
        finally:
            sock.close()
            raw.close()

    def stop(self) -> None:
        """Kill the server (SIGKILL: no goodbye to clients) and wait for it to exit. Idempotent."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=10)
        if proc.stderr is not None:
            proc.stderr.close()

    def pause(self) -> None:
        """SIGSTOP: the server keeps its sockets but answers nothing (a 'slow' server)."""
        assert self._proc is not None, "server not running"
        os.kill(self._proc.pid, 19)

    def resume(self) -> None:
        assert self._proc is not None, "server not running"
        os.kill(self._proc.pid, 18)


@dataclass(slots=True)
class RedisClusterProcesses:
    """``n_nodes`` cluster-enabled servers joined with ``redis-cli --cluster create``, ``replicas`` per
    primary (``n_nodes`` counts them too); with ``tls`` every node, the cluster bus included, speaks
    TLS only."""

    workdir: Path
    n_nodes: int = 3
    tls: TlsFiles | None = None
    replicas: int = 0
    nodes: list[RedisServerProcess] = field(default_factory=list, init=False)

    @property
    def url(self) -> str:
        hosts = ",".join(f"127.0.0.1:{n.port}" for n in self.nodes)
        if self.tls is not None:
            return f"rediss+cluster://{hosts}?ssl_ca_certs={self.tls.ca_file}"
        return f"redis+cluster://{hosts}"

    def _cli(self) -> list[str]:
        cli = redis_cli_binary()
        if cli is None:
            raise FileNotFoundError("redis-cli not on PATH (apt install redis-tools)")
        return [cli] + (["--tls", "--cacert", str(self.tls.ca_file)] if self.tls is not None else [])

    def start(self) -> RedisClusterProcesses:
        cli = self._cli()
        tls_args = ["--tls-cluster", "yes"] if self.tls is not None else []
        used: list[int] = []
        for i in range(self.n_nodes):
            port = free_port(used)
            bus = free_port(used + [port])
            used += [port, bus]
            node_dir = Path(self.workdir) / f"node{i}"
            self.nodes.append(RedisServerProcess(node_dir, port=port, tls=self.tls, extra_args=[
                "--cluster-enabled", "yes", "--cluster-port", str(bus), *tls_args,
                "--cluster-config-file", str(node_dir / "nodes.conf"), "--cluster-node-timeout", "2000"]))
        try:
            for node in self.nodes:
                node.start()
            subprocess.run(
                [*cli, "--cluster", "create", *(f"127.0.0.1:{n.port}" for n in self.nodes),
                 "--cluster-replicas", str(self.replicas), "--cluster-yes"],
                check=True, capture_output=True, timeout=60,
            )
            self.wait_ok()
        except BaseException:
            self.stop()
            raise
        return self

    def wait_ok(self, timeout_s: float = 30.0) -> None:
        """Block until every running node reports cluster_state:ok with all 16384 slots served (and
        every replica's link to its primary is up)."""
        cli = self._cli()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            live = [n for n in self.nodes if n.running]
            infos = [subprocess.run([*cli, "-p", str(n.port), cmd, arg], capture_output=True,
                                    text=True, timeout=5).stdout
                     for n in live for cmd, arg in (("cluster", "info"), ("info", "replication"))]
            clusters, replication = infos[::2], infos[1::2]
            if (all("cluster_state:ok" in i and "cluster_slots_ok:16384" in i for i in clusters)
                    and all("role:master" in r or "master_link_status:up" in r for r in replication)):
                return
            time.sleep(0.1)
        raise RuntimeError(f"cluster on ports {[n.port for n in self.nodes]} never reached cluster_state:ok")

    def move_slot(self, slot: int) -> int:
        """Reshard ``slot`` and its keys to another primary, as ``redis-cli --cluster reshard`` does
        (IMPORTING/MIGRATING, MIGRATE every key, SETSLOT NODE on every node); returns the new
        owner's port. Clients keep their old slot map: their next command there gets MOVED."""
        cli = self._cli()

        def ask(port: int, *args: object) -> str:
            out = subprocess.run([*cli, "-p", str(port), *map(str, args)], capture_output=True, text=True,
                                 check=True, timeout=10).stdout
            if out.startswith(("ERR", "(error)")):
                raise RuntimeError(f"redis-cli -p {port} {' '.join(map(str, args))}: {out.strip()}")
            return out

        owners: dict[int, tuple[str, bool]] = {}  # primary's port -> (node id, serves slot)
        for line in ask(self.nodes[0].port, "cluster", "nodes").splitlines():
            f = line.split()
            if "master" not in f[2] or "fail" in f[2]:
                continue
            ranges = [r.split("-") for r in f[8:] if not r.startswith("[")]
            serves = any(int(r[0]) <= slot <= int(r[-1]) for r in ranges)
            owners[int(f[1].split("@")[0].rsplit(":", 1)[1])] = (f[0], serves)
        src = next(port for port, (_, serves) in owners.items() if serves)
        dst = next(port for port in owners if port != src)
        (src_id, _), (dst_id, _) = owners[src], owners[dst]
        ask(dst, "cluster", "setslot", slot, "importing", src_id)
        ask(src, "cluster", "setslot", slot, "migrating", dst_id)
        while keys := ask(src, "cluster", "getkeysinslot", slot, 100).split():
            ask(src, "migrate", "127.0.0.1", dst, "", 0, 5000, "keys", *keys)
        for node in self.nodes:
            ask(node.port, "cluster", "setslot", slot, "node", dst_id)
        return dst

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m radixkv.testing_redis [--cluster] [--password PW] [--tls]``: start servers in a temp
    dir, print the URL, and keep them up until Ctrl-C."""
    import argparse
    import tempfile

    ap = argparse.ArgumentParser(prog="python -m radixkv.testing_redis", description=main.__doc__)
    ap.add_argument("--cluster", action="store_true", help="3-node Redis Cluster instead of one server")
    ap.add_argument("--password", default=None, help="--requirepass for a single server")
    ap.add_argument("--tls", action="store_true", help="TLS-only single server with a self-signed cert")
    args = ap.parse_args(argv)
    workdir = Path(tempfile.mkdtemp(prefix="radixkv-redis-"))
    procs: RedisClusterProcesses | RedisServerProcess
    if args.cluster:
        procs = RedisClusterProcesses(workdir).start()
    else:
        tls = make_tls_files(workdir / "tls") if args.tls else None
        procs = RedisServerProcess(workdir / "server", password=args.password, tls=tls).start()
    print(procs.url, flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        procs.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
