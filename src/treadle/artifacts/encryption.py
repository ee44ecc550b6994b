"""Encryption at rest of stored artifacts with a key the tenant provides (AES-256-GCM).

The key travels in the `X-Treadle-Encryption-Key` header (base64 or hex of 32 bytes) with
the requests that write or read a version; the server keeps it in memory for that request
only. What is stored is a key id (a hash, not the key), so that a wrong key is named as such.

File format (one stored object per artifact file):

    MAGIC (8 bytes) | nonce prefix (8 bytes) | chunk 0 | chunk 1 | ...

Each chunk is AES-GCM(plaintext of at most CHUNK bytes) with nonce = prefix + chunk index
(4 bytes, big endian) and associated data = file name + index + last-chunk flag, so chunks
cannot be reordered, truncated at a chunk boundary, or moved to another file unnoticed.
Streaming in chunks keeps memory flat for merged models of several GB.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import itertools
import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from treadle.errors import InvalidRequestError

HEADER = "X-Treadle-Encryption-Key"
MAGIC = b"TRDLENC1"
CHUNK = 4 << 20  # plaintext bytes per chunk
TAG = 16
PREFIX = 8


def parse_key(value: str | bytes | None, field: str = HEADER) -> bytes | None:
    """A 32-byte key from its base64 (standard or URL-safe) or hex text; None stays None."""
    if value is None or value == "":
        return None
    if isinstance(value, bytes) and len(value) == 32:
        return value
    text = value.decode() if isinstance(value, bytes) else value.strip()
    candidates = []
    if len(text) == 64:
        try:
            candidates.append(binascii.unhexlify(text))
        except binascii.Error:
            pass
    for decode in (base64.b64decode, base64.urlsafe_b64decode):
        try:
            candidates.append(decode(text + "=" * (-len(text) % 4)))
        except (binascii.Error, ValueError):
            pass
    for key in candidates:
        if len(key) == 32:
            return key
    raise InvalidRequestError(
        f"{field}: expected a 32-byte AES-256 key as base64 or 64 hex digits, "
        f"got {len(text)} characters that do not decode to 32 bytes"
    )


def new_key() -> str:
    """A fresh random key, as URL-safe base64 text (what the header and CLI take)."""
    return base64.urlsafe_b64encode(os.urandom(32)).decode()


def key_id(key: bytes) -> str:
    """A stable, non-reversible id of a key: stored beside encrypted versions."""
    return hashlib.sha256(b"treadle-key-id\0" + key).hexdigest()[:16]


def _aad(name: str, index: int, last: bool) -> bytes:
    return f"{name}\0{index}\0{int(last)}".encode()


def _blocks(chunks: Iterable[bytes], size: int) -> Iterator[tuple[bytes, bool]]:
    """Re-cut a byte stream into blocks of `size` (the last may be shorter, or empty for an
    empty stream), each with a flag telling whether it is the last."""
    buf = bytearray()
    pending: bytes | None = None
    for piece in chunks:
        buf += piece
        while len(buf) > size:  # more than a block: the block is surely not the last
            if pending is not None:
                yield pending, False
            pending = bytes(buf[:size])
            del buf[:size]
    if pending is not None:
        if buf:
            yield pending, False
            yield bytes(buf), True
        else:
            yield pending, True
    else:
        yield bytes(buf), True


def encrypt_stream(key: bytes, name: str, chunks: Iterable[bytes]) -> Iterator[bytes]:
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    aead = AESGCM(key)
    prefix = os.urandom(PREFIX)
    yield MAGIC + prefix
    for index, (block, last) in enumerate(_blocks(chunks, CHUNK)):
        nonce = prefix + index.to_bytes(4, "big")
        yield aead.encrypt(nonce, block, _aad(name, index, last))


def decrypt_stream(key: bytes, name: str, chunks: Iterable[bytes]) -> Iterator[bytes]:
    from cryptography.exceptions import InvalidTag
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    aead = AESGCM(key)
    it = iter(chunks)
    head = bytearray()
    for piece in it:
        head += piece
        if len(head) >= len(MAGIC) + PREFIX:
            break
    if len(head) < len(MAGIC) + PREFIX or not head.startswith(MAGIC):
        raise InvalidRequestError(f"{name}: not an encrypted artifact (bad header)")
    prefix = bytes(head[len(MAGIC) : len(MAGIC) + PREFIX])
    rest = itertools.chain([bytes(head[len(MAGIC) + PREFIX :])], it)
    for index, (block, last) in enumerate(_blocks(rest, CHUNK + TAG)):
        if len(block) < TAG:
            raise InvalidRequestError(f"{name}: encrypted artifact is truncated")
        nonce = prefix + index.to_bytes(4, "big")
        try:
            yield aead.decrypt(nonce, block, _aad(name, index, last))
        except InvalidTag as e:
            raise InvalidRequestError(
                f"{name}: decryption failed: wrong encryption key, or the stored file was "
                "altered or truncated"
            ) from e


def encrypt_bytes(key: bytes, name: str, data: bytes) -> bytes:
    return b"".join(encrypt_stream(key, name, [data]))


def decrypt_bytes(key: bytes, name: str, data: bytes) -> bytes:
    return b"".join(decrypt_stream(key, name, [data]))


# ---- age (save_weights_external's age_encryption_recipients) ----
AGE_SUFFIX = ".age"


def age_recipients(values: list[str], field: str = "age_encryption_recipients") -> list[Any]:
    """Parse age recipients: native "age1..." keys or SSH public keys."""
    try:
        import pyrage
    except ImportError as e:
        raise InvalidRequestError(
            f"{field}: age encryption needs pyrage on the server (pip install pyrage)"
        ) from e
    out = []
    for value in values:
        parse = pyrage.x25519.Recipient if value.startswith("age1") else pyrage.ssh.Recipient
        try:
            out.append(parse.from_str(value))
        except Exception as e:  # noqa: BLE001 - pyrage raises its own error types
            raise InvalidRequestError(
                f"{field}: expected age1... keys or SSH public keys, got {value[:24]!r}..."
            ) from e
    if not out:
        raise InvalidRequestError(f"{field}: expected at least one recipient, got none")
    return out


def age_encrypt_folder(folder: Path, recipients: list[str]) -> None:
    """Replace every file F of folder by F.age, encrypted to the recipients (what the
    tinker tools download and decrypt with `age -d` or pyrage)."""
    import pyrage

    parsed = age_recipients(recipients)
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        pyrage.encrypt_file(str(path), str(path) + AGE_SUFFIX, parsed)
        path.unlink()
