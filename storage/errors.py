"""Errors raised by the storage layer.

Every message names the place involved (endpoint, bucket, key or local path) and says
what to do, and none of them ever contains a secret key: callers log them verbatim.
"""

from __future__ import annotations


class StorageError(Exception):
    """Base class: something about durable storage went wrong."""


class StorageUnreachableError(StorageError):
    """The object store did not answer (connection refused, timeouts, 5xx) within the retry budget."""


class StorageAuthError(StorageError):
    """The object store rejected our credentials or denied access to the bucket."""


class BucketNotFoundError(StorageError):
    """The configured bucket does not exist and we were told not to create it."""


class ArtifactNotFoundError(StorageError):
    """A key that was expected to exist is not in the store."""


class CorruptArtifactError(StorageError):
    """A committed artifact failed verification (size, checksum, missing file or bad manifest)."""


class SpoolNotDrainedError(StorageError):
    """Trajectory chunks are still in the local spool after the drain deadline.

    The records are safe on local disk; the message says where, and the next writer that
    uses the same spool directory and writer id uploads them.
    """
