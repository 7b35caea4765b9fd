"""A real MinIO server process for tests and ``posttrain dev up``.

MinIO (AGPL-3.0) runs unmodified as a separate program built by
tools/ensure-binaries.sh; posttrain talks to it only over the S3 API.
"""

from __future__ import annotations

import logging
import secrets
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from posttrain.api.env import S3_ENDPOINT, S3_SECURE
from posttrain.processes import ManagedProcess, StartError, free_port, http_ok, port_in_use

from .binaries import go_binary

log = logging.getLogger(__name__)


@dataclass
class MinioServer:
    """MinIO on a loopback port with its data in ``data_dir``."""

    data_dir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="posttrain-s3-")))
    port: int = 0
    host: str = "127.0.0.1"
    """Address it listens on (the real node's address, so pods reach it)."""
    access_key: str = "posttrain"
    secret_key: str = field(default_factory=lambda: secrets.token_hex(16))
    process: ManagedProcess | None = None

    @property
    def endpoint(self) -> str:
        """host:port, as the minio SDK wants it."""
        return f"{self.host}:{self.port}"

    @property
    def url(self) -> str:
        return f"http://{self.endpoint}"

    def start(self, timeout_s: float = 60.0) -> MinioServer:
        if self.port and port_in_use(self.port):
            raise StartError(
                f"port {self.port} on 127.0.0.1 is already in use; stop what listens there "
                "or choose another port"
            )
        self.port = self.port or free_port()
        console = free_port()
        self.process = ManagedProcess(
            name="minio",
            command=[
                str(go_binary("minio")),
                "server",
                str(self.data_dir / "data"),
                "--address",
                self.endpoint,
                "--console-address",
                f"127.0.0.1:{console}",
                "--quiet",
            ],
            log_path=self.data_dir / "minio.log",
            ready=self._serving,
            env={
                "MINIO_ROOT_USER": self.access_key,
                "MINIO_ROOT_PASSWORD": self.secret_key,
                "MINIO_BROWSER": "off",
                "MINIO_UPDATE": "off",
                # MinIO takes a drive offline when it does not answer within 30 s; with one
                # drive every request then fails ("listPathRaw: 0 drives provided") until a
                # health check brings it back. On a dev machine whose disk stalls under a
                # neighbour's checkpoint writes that turned a slow disk into failed runs: a
                # slow drive stays a slow drive here.
                "_MINIO_DRIVE_ACTIVE_MONITORING": "off",
                "MINIO_DRIVE_MAX_TIMEOUT": "10m",
            },
        )
        self.process.start(timeout_s)
        log.info("MinIO ready at %s (data %s)", self.url, self.data_dir)
        return self

    def _serving(self) -> bool:
        """Ready means an S3 call succeeds: /minio/health/ready can pass while the object
        layer still answers "Server not initialized"."""
        if not http_ok(f"{self.url}/minio/health/ready"):
            return False
        try:
            self.client().list_buckets()
        except Exception:
            return False
        return True

    def stop(self) -> None:
        """Stop the server but keep its data (a restart on the same port serves it again)."""
        if self.process is not None:
            self.process.stop()

    def restart(self, timeout_s: float = 60.0) -> None:
        self.stop()
        self.start(timeout_s)

    def empty_trash(self) -> int:
        """Delete what MinIO moved to its trash on deletes and overwrites; bytes freed.

        MinIO purges ``.minio.sys/tmp/.trash`` only on its own schedule (not within minutes
        here, whatever the cleanup-interval settings say), and a test suite that writes and
        drops GBs of checkpoints filled the disk with it. Entries arrive there by an atomic
        rename, so each one is whole and no longer reachable through S3."""
        trash = self.data_dir / "data" / ".minio.sys" / "tmp" / ".trash"
        freed = 0
        for entry in trash.iterdir() if trash.is_dir() else []:
            freed += sum(f.stat().st_size for f in entry.rglob("*") if f.is_file())
            shutil.rmtree(entry, ignore_errors=True)
        return freed

    def destroy(self) -> None:
        self.stop()
        shutil.rmtree(self.data_dir, ignore_errors=True)

    def client(self) -> Any:
        from minio import Minio

        return Minio(self.endpoint, self.access_key, self.secret_key, secure=False)

    def env(self) -> dict[str, str]:
        """Environment that points posttrain's storage at this server."""
        return {
            S3_ENDPOINT: self.endpoint,
            S3_SECURE: "false",
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
        }
