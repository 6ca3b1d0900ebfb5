"""The S3 tier: any S3-compatible store through boto3 (imported lazily).

The endpoint, region and credentials come from the standard AWS variables (AWS_ENDPOINT_URL,
AWS_REGION / AWS_DEFAULT_REGION, AWS_ACCESS_KEY_ID, AWS_PROFILE...), which boto3 reads itself. Weight data
moves as ranged GETs, many in flight (the loader's reader threads each hold one).

One retry policy for every call, this module's: at most `S3Options.attempts` attempts with exponential
backoff and jitter, for 5xx, 429, connection errors and bodies cut short (which botocore cannot retry: the
break comes after its call returned). botocore's and s3transfer's own retries are turned off, so that the
attempts do not multiply.
"""

from __future__ import annotations

import os
import random
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from runtime.logs import get_logger
from runtime.weights.errors import WeightsError

log = get_logger("weights.s3")

MiB = 1 << 20


@dataclass(frozen=True)
class S3Options:
    concurrency: int = 16  # ranged GETs in flight, and multipart parts in flight when uploading
    part_bytes: int = 16 * MiB  # one ranged GET; one multipart part
    attempts: int = 5  # per call, all causes together
    backoff_s: float = 0.2  # first retry waits about this long, doubling each time

    @classmethod
    def from_env(cls) -> "S3Options":
        from runtime.config import Settings

        settings = Settings.from_env()
        return cls(concurrency=settings.s3_concurrency, part_bytes=int(settings.s3_part_mb * MiB))


def is_s3(ref: str | os.PathLike | None) -> bool:
    return isinstance(ref, str) and ref.startswith("s3://")


def split_url(url: str) -> tuple[str, str]:
    """s3://bucket/some/prefix -> ("bucket", "some/prefix")."""
    if not is_s3(url) or not url[5:].split("/", 1)[0]:
        raise WeightsError(f"{url!r} is not an s3://bucket/prefix URL")
    bucket, _, key = url[5:].partition("/")
    return bucket, key.strip("/")


def join_key(prefix: str, name: str) -> str:
    return f"{prefix}/{name}" if prefix else name


class S3Store:
    def __init__(self, options: S3Options | None = None) -> None:
        self.options = options or S3Options.from_env()
        self._client = None
        self._lock = threading.Lock()

    @property
    def client(self):
        with self._lock:
            if self._client is None:
                import boto3
                from botocore.config import Config

                self._client = boto3.session.Session().client("s3", config=Config(
                    max_pool_connections=max(10, self.options.concurrency + 4),
                    retries={"mode": "standard", "total_max_attempts": 1}))  # _retrying retries
            return self._client

    # -- small objects and listings ------------------------------------------------------------------

    def get_bytes(self, bucket: str, key: str) -> bytes:
        return self._retrying(bucket, key, lambda: self.client.get_object(Bucket=bucket, Key=key)["Body"].read())

    def exists(self, bucket: str, key: str) -> bool:
        try:
            self._retrying(bucket, key, lambda: self.client.head_object(Bucket=bucket, Key=key))
            return True
        except ObjectMissing:
            return False

    def list(self, bucket: str, prefix: str) -> dict[str, int]:
        """Object names directly and indirectly under `prefix/` -> size."""
        start = f"{prefix}/" if prefix else ""

        def listing() -> dict[str, int]:  # a retry lists from the start
            out: dict[str, int] = {}
            for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=start):
                out.update({o["Key"][len(start):]: o["Size"] for o in page.get("Contents", [])})
            return out

        return self._retrying(bucket, start, listing)

    # -- weight data ----------------------------------------------------------------------------------

    def read_into(self, bucket: str, key: str, offset: int, out: memoryview) -> None:
        """Fill `out` with the object's bytes [offset, offset + len(out)): one ranged GET, retried."""

        def get() -> None:
            rng = f"bytes={offset}-{offset + len(out) - 1}"
            body = self.client.get_object(Bucket=bucket, Key=key, Range=rng)["Body"]
            got = 0
            for piece in body.iter_chunks(4 * MiB):
                if got + len(piece) > len(out):
                    raise WeightsError(f"s3://{bucket}/{key}: more bytes than asked for at {offset}")
                out[got:got + len(piece)] = piece
                got += len(piece)
            if got != len(out):
                raise _ShortRead(f"s3://{bucket}/{key}: {got} of {len(out)} bytes at offset {offset}")

        self._retrying(bucket, key, get)

    def download(self, bucket: str, key: str, path: Path) -> None:

        self._retrying(bucket, key, lambda: self.client.download_file(
            bucket, key, str(path), Config=self._transfer_config()))

    def upload(self, path: Path, bucket: str, key: str) -> None:
        """Multipart when large; a failed upload is aborted by boto3, leaving no object."""
        self._retrying(bucket, key, lambda: self.client.upload_file(
            str(path), bucket, key, Config=self._transfer_config()))

    def put_bytes(self, bucket: str, key: str, data: bytes) -> None:
        self._retrying(bucket, key, lambda: self.client.put_object(Bucket=bucket, Key=key, Body=data))

    def delete(self, bucket: str, keys: list[str]) -> None:
        """Delete KEYS (1000 to a request, each request retried); a key S3 could not delete is an error."""
        for i in range(0, len(keys), 1000):
            batch = keys[i:i + 1000]

            def delete_batch() -> None:
                answer = self.client.delete_objects(Bucket=bucket, Delete={"Objects": [{"Key": k} for k in batch]})
                errors = answer.get("Errors") or []
                if errors:
                    raise _NotDeleted(f"{len(errors)} not deleted, e.g. {errors[0].get('Key')}: "
                                      f"{errors[0].get('Message') or errors[0].get('Code')}")

            self._retrying(bucket, batch[0], delete_batch)

    def _transfer_config(self):
        from boto3.s3.transfer import TransferConfig

        return TransferConfig(multipart_threshold=self.options.part_bytes, multipart_chunksize=self.options.part_bytes,
                              max_concurrency=self.options.concurrency, num_download_attempts=1)

    def _retrying(self, bucket: str, key: str, call):
        from botocore.exceptions import BotoCoreError, ClientError

        where = f"s3://{bucket}/{key}"
        for attempt in range(1, self.options.attempts + 1):
            try:
                return call()
            except ClientError as exc:
                status = _status(exc)
                if status == 404 or exc.response.get("Error", {}).get("Code") in ("NoSuchKey", "NoSuchBucket"):
                    raise ObjectMissing(f"{where}: no such object") from None
                if status is not None and status < 500 and status != 429 or attempt == self.options.attempts:
                    raise WeightsError(f"{where}: {exc}") from None
                why = str(exc)
            except (BotoCoreError, _ShortRead, _NotDeleted, OSError) as exc:
                if attempt == self.options.attempts:
                    raise WeightsError(f"{where}: gave up after {attempt} attempts: {exc}") from None
                why = f"{type(exc).__name__}: {exc}"
            delay = self.options.backoff_s * 2 ** (attempt - 1) * (0.5 + random.random())
            log.warning("%s: attempt %d failed (%s); retrying in %.2fs", where, attempt, why, delay)
            time.sleep(delay)


class ObjectMissing(WeightsError):
    """The object (or its bucket) does not exist."""


class _ShortRead(Exception):
    pass


class _NotDeleted(Exception):
    pass


def _status(exc) -> int | None:
    return exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
