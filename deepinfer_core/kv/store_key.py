"""The prefix store's key: what authenticates its blocks between the engines of one deployment.

Every block file carries an HMAC-SHA256 under this key (`prefix_store.encode_block`), so an engine
serves only blocks written by a holder of the key. The key is `DEEPINFER_PREFIX_STORE_KEY` (at least 16
bytes of secret text) when set, which every engine sharing a store must be given alike. Otherwise a POSIX
store keeps one in its directory, `.deepinfer-store-key`: the first engine creates it with 32 random
bytes, readable by its user alone (0600), and every engine of that user reads it. A key file owned by
another user, or readable or writable by others, is refused: whoever can replace the key can forge blocks.
A store behind a plugin backend (`scheme://`) has no file of its own for the key: it needs the variable.
"""

from __future__ import annotations

import os
import secrets
import stat
import time
from pathlib import Path

from deepinfer_core.kv.store_backends import PosixBackend

KEY_ENV = "DEEPINFER_PREFIX_STORE_KEY"
KEY_FILE = ".deepinfer-store-key"
MIN_KEY_BYTES = 16
_KEY_BYTES = 32
_READ_RETRIES = 50  # another engine created the file an instant ago and is writing its key


def store_key(backend) -> bytes:
    """The store key for `backend` (a `StoreBackend`; see the module docstring).

    :raises ValueError: the variable is too short, the key file is unsafe or unreadable, or a plugin
        backend has no key given.
    """
    given = os.environ.get(KEY_ENV)
    if given:
        if len(given.encode()) < MIN_KEY_BYTES:
            raise ValueError(f"{KEY_ENV} must hold at least {MIN_KEY_BYTES} bytes of secret text")
        return given.encode()
    if isinstance(backend, PosixBackend):
        return key_file(backend.root / KEY_FILE)
    raise ValueError(f"a prefix store behind {type(backend).__name__} needs its key in {KEY_ENV} (the same "
                     "secret for every engine that shares the store)")


def key_file(path: Path) -> bytes:
    """The key kept in `path`, created (0600, 32 random bytes) if there is none."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    except FileExistsError:
        return _read_key(path)
    except OSError as err:
        raise ValueError(f"the prefix store key file {path} cannot be created ({err}); set {KEY_ENV}") from err
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(_KEY_BYTES) + "\n")
        f.flush()
        os.fsync(f.fileno())
    return _read_key(path)


def _read_key(path: Path) -> bytes:
    for _ in range(_READ_RETRIES):
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError as err:
            raise ValueError(f"the prefix store key file {path} cannot be read ({err}); set {KEY_ENV}") from err
        with os.fdopen(fd, "r") as f:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o077:
                raise ValueError(f"the prefix store key file {path} must be a file of this user readable by it "
                                 f"alone (chmod 600): whoever can replace it can forge blocks; or set {KEY_ENV}")
            text = f.read(4 * _KEY_BYTES).strip()
        if text:
            try:
                key = bytes.fromhex(text)
            except ValueError:
                key = b""
            if len(key) < MIN_KEY_BYTES:
                raise ValueError(f"the prefix store key file {path} does not hold a hex key of at least "
                                 f"{MIN_KEY_BYTES} bytes; delete it to make a new one, or set {KEY_ENV}")
            return key
        time.sleep(0.01)
    raise ValueError(f"the prefix store key file {path} stayed empty; delete it to make a new one, or set {KEY_ENV}")
