"""Node identity: an Ed25519 key that signs every message and (in node/) gives the libp2p peer id.

A node id is the hex of the raw 32-byte public key, so any receiver can verify a signature from
the sender field alone. Key files are PKCS#8 PEM, written atomically with mode 0600; a key file
that group or others can read is refused. This module knows nothing about messages.
"""

from __future__ import annotations

import stat
from dataclasses import dataclass
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from protocol.files import write_file


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


# The points of order 1, 2, 4 and 8 by their y coordinate (libsodium's list; p, p + 1 and p - 1 are y's
# non-canonical spellings of 0, 1 and -1). The x sign bit (the top bit) does not change a point's order.
_SMALL_ORDER_Y = frozenset(bytes.fromhex(h) for h in (
    "00" * 32,
    "01" + "00" * 31,
    "26e8958fc2b227b045c3f489f2ef98f0d5dfac05d3c63339b13802886d53fc05",
    "c7176a703d4dd84fba3c0b760d10670f2a2053fa2c39ccc64ec7fd7792ac037a",
    "ec" + "ff" * 30 + "7f",
    "ed" + "ff" * 30 + "7f",
    "ee" + "ff" * 30 + "7f",
))
_P = 2**255 - 19


def is_weak_key(raw: bytes) -> bool:
    """True when 32-byte `raw` is a small-order point or a non-canonical encoding (y >= p).

    OpenSSL verifies Ed25519 without the cofactor and accepts such keys: with the identity point as the
    key and as R, and S = 0, one signature verifies for every message, so anyone could sign as that id.
    A generated key is never weak.
    """
    y = bytes([*raw[:31], raw[31] & 0x7F])
    return y in _SMALL_ORDER_Y or int.from_bytes(y, "little") >= _P


def verify(node_id: str, data: bytes, signature: bytes) -> bool:
    """True when `signature` is `node_id`'s Ed25519 signature of `data`; never raises.

    A weak key (`is_weak_key`) or a signature whose R is one verifies nothing: such signatures bind no
    message to a signer.
    """
    try:
        raw = bytes.fromhex(node_id)
        if len(raw) != 32 or len(signature) != 64 or is_weak_key(raw) or is_weak_key(signature[:32]):
            return False
        key = Ed25519PublicKey.from_public_bytes(raw)
        key.verify(signature, data)
    except (ValueError, InvalidSignature):
        return False
    return True


def save_identity(identity: Identity, path: str | Path) -> None:
    """Write the key as PKCS#8 PEM with mode 0600, atomically; refuses to overwrite, also a key another
    process wrote while this one ran (the file is linked into place, never renamed over it).

    `protocol.files.write_file` writes it: on a filesystem without hard links too, never over another key
    and never half-written.
    """
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
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_file(path, pem, replace=False, mode=0o600)
    except FileExistsError:
        raise KeyFileError(f"{path}: a key file appeared there while this ran; refusing to overwrite it") from None
    except OSError as exc:
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
        try:
            save_identity(Identity.generate(), path)
        except KeyFileError:
            if not path.is_file():
                raise  # else another process created it meanwhile: this node uses that key
    return load_identity(path)
