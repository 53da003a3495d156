"""Key files: Ed25519 private keys in PKCS#8 PEM, readable by their owner only.

Reading one, for a service that signs its answers or a command that signs an act; where the
terminal finds an operator's key (`IMPROVED_KEYS`, else ~/.config/improved/keys) and making one
(`improved keys new`); and the daemon's checkpoint key, made on first use. The signing itself
is pure (improved.core.signing).
"""

from __future__ import annotations

import os
from pathlib import Path

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from improved.core.signing import raw_public


def load_key(path: Path) -> Ed25519PrivateKey:
    key = serialization.load_pem_private_key(Path(path).read_bytes(), password=None)
    if not isinstance(key, Ed25519PrivateKey):
        raise ValueError(f"{path} is not an Ed25519 private key")
    return key


def key_dir() -> Path:
    return Path(os.environ.get("IMPROVED_KEYS", Path.home() / ".config" / "improved" / "keys"))


def key_path(principal: str, directory: Path | None = None) -> Path:
    return (directory or key_dir()) / (principal.replace(":", "_") + ".pem")


def new_key(principal: str, directory: Path | None = None) -> tuple[Path, bytes]:
    """Write a new Ed25519 private key (0600, PKCS#8 PEM); return its path and public key."""
    path = key_path(principal, directory)
    return path, raw_public(write_key(path).public_key())


def write_key(path: Path) -> Ed25519PrivateKey:
    """Generate a key into a new file readable by its owner only; never overwrite one."""
    if path.exists():
        raise FileExistsError(f"{path} exists; refusing to overwrite a key")
    path.parent.mkdir(parents=True, exist_ok=True)
    key = Ed25519PrivateKey.generate()
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                            serialization.NoEncryption())
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as fh:
        fh.write(pem)
    return key


def load_or_create_key(path: Path) -> Ed25519PrivateKey:
    """The daemon's checkpoint key: created (0600) on first use."""
    try:
        return write_key(path)
    except FileExistsError:
        return load_key(path)
