"""What an artefact is named and its content addressed by, and the blobs that hold the content:
Object Store `artefacts_<svc>`, object name = hex SHA-256 of the content.

Apart from the artefact store because content addressing is its own rule: a blob never
changes, uploading the same content twice is harmless, and every read re-hashes what came back,
so a missing or altered blob reads as None, never as content.
"""

from __future__ import annotations

import asyncio
import hashlib
import re

from nats.js.client import JetStreamContext
from nats.js.errors import APIError, BucketNotFoundError, DigestMismatchError, NotFoundError
from nats.js.object_store import ObjectStore

DIGEST_RE = re.compile(r"^sha256:([0-9a-f]{64})$")
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_./-]{0,127}$")
BLOB_TIMEOUT_S = 10.0


def digest_of(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


class ArtefactBlobs:
    """The blobs of one store, by digest `sha256:<hex>`."""

    objects: ObjectStore  # once `open`

    def __init__(self, js: JetStreamContext, bucket: str, kind: str):
        self.js, self.bucket, self.kind = js, bucket, kind

    async def open(self) -> None:
        """The Object Store, created if absent (or by a twin instance meanwhile)."""
        try:
            self.objects = await self.js.object_store(self.bucket)
            return
        except BucketNotFoundError:
            pass
        try:
            self.objects = await self.js.create_object_store(
                bucket=self.bucket,
                description=f"{self.kind} blobs, named by the SHA-256 of their content")
        except APIError:  # created meanwhile by a twin instance
            self.objects = await self.js.object_store(self.bucket)

    async def get(self, digest: str) -> bytes | None:
        """The content stored under `sha256:<hex>`, or None when missing or corrupt."""
        m = DIGEST_RE.match(digest or "")
        if m is None:
            return None
        try:
            got = await asyncio.wait_for(self.objects.get(m.group(1)), BLOB_TIMEOUT_S)
        except (NotFoundError, DigestMismatchError):
            return None
        data = got.data or b""
        return data if digest_of(data) == digest else None

    async def has(self, digest: str) -> bool:
        m = DIGEST_RE.match(digest)
        if m is None:  # names no blob
            return False
        try:
            await self.objects.get_info(m.group(1))
        except NotFoundError:
            return False
        return True

    async def put(self, data: bytes) -> str:
        """Upload `data` under its address unless it is there already; its digest."""
        digest = digest_of(data)
        if not await self.has(digest):
            await self.objects.put(digest.removeprefix("sha256:"), data)
        return digest
