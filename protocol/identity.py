"""Node identity: an Ed25519 key that signs every message and (in node/) gives the libp2p peer id.

A node id is the hex of the raw 32-byte public key, so any receiver can verify a signature from
the sender field alone. Key files are PKCS#8 PEM, written atomically with mode 0600; a key file
that group or others can read is refused. This module knows nothing about messages.
"""

from __future__ import annotations

import contextlib
import os
import stat
from dataclasses import dataclass
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey


class KeyFileError(ValueError):
    """A key file is missing, unreadable, not an Ed25519 key, or readable by others."""


@dataclass(frozen=True)
class Identity:
    """An Ed25519 signing key and the node id derived from it."""

    private_key: Ed25519PrivateKey

    @classmethod
    def generate(cls) -> Identity:
        return cls(Ed25519PrivateKey.generate())

    @classmethod
    def from_seed(cls, seed: bytes) -> Identity:
        """Deterministic identity from a 32-byte seed (tests and simulations)."""
        return cls(Ed25519PrivateKey.from_private_bytes(seed))

    @property
    def node_id(self) -> str:
        return public_key_hex(self.private_key.public_key())

    @property
    def seed(self) -> bytes:
        """The raw 32-byte private key, for deriving the libp2p key pair."""
        return self.private_key.private_bytes(
            serialization.Encoding.Raw, serialization.PrivateFormat.Raw, serialization.NoEncryption()
        )

    def sign(self, data: bytes) -> bytes:
        return self.private_key.sign(data)


def public_key_hex(key: Ed25519PublicKey) -> str:
    return key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw).hex()


def verify(node_id: str, data: bytes, signature: bytes) -> bool:
    """True when `signature` is `node_id`'s Ed25519 signature of `data`; never raises."""
    try:
        key = Ed25519PublicKey.from_public_bytes(bytes.fromhex(node_id))
        key.verify(signature, data)
    except (ValueError, InvalidSignature):
        return False
    return True


def save_identity(identity: Identity, path: str | Path) -> None:
    """Write the key as PKCS#8 PEM with mode 0600, atomically; refuses to overwrite."""
    path = Path(path)
    if path.is_dir():
        raise KeyFileError(f"{path}: is a directory; give the key file's path")
    if path.exists():
        raise KeyFileError(f"{path}: a key file already exists; refusing to overwrite it")
    if path.parent.exists() and not path.parent.is_dir():
        raise KeyFileError(f"{path}: {path.parent} is not a directory")
    pem = identity.private_key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.write(fd, pem)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except OSError as exc:
        with contextlib.suppress(OSError):  # the temporary file may never have been created
            tmp.unlink()
        raise KeyFileError(f"{path}: cannot write the key file: {exc.strerror or exc}") from exc


def load_identity(path: str | Path) -> Identity:
    """Read a key file; raises KeyFileError naming the file and what is wrong with it."""
    path = Path(path)
    try:
        mode = path.stat().st_mode
        data = path.read_bytes()
    except FileNotFoundError as exc:
        raise KeyFileError(f"{path}: no such key file (create one with `tessera keygen --out {path}`)") from exc
    except OSError as exc:
        raise KeyFileError(f"{path}: cannot read key file: {exc}") from exc
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise KeyFileError(f"{path}: key file is accessible by group or others; run `chmod 600 {path}`")
    try:
        key = serialization.load_pem_private_key(data, password=None)
    except TypeError as exc:  # cryptography's word for a key that needs a password
        raise KeyFileError(f"{path}: the key is encrypted; a node key has no passphrase "
                           "(create one with `tessera keygen`)") from exc
    except ValueError as exc:
        raise KeyFileError(f"{path}: not a PEM private key") from exc
    if not isinstance(key, Ed25519PrivateKey):
        raise KeyFileError(f"{path}: key is not Ed25519")
    return Identity(key)


def load_or_create_identity(path: str | Path) -> Identity:
    """Load the node's key, creating it on first start."""
    path = Path(path)
    if not path.exists():
        save_identity(Identity.generate(), path)
    return load_identity(path)
