"""Where prefix-store files live: one small interface, a POSIX implementation, and plugin backends.

`StoreBackend` is what `PrefixStore` needs of a storage system: whole named objects written
atomically (`put`), read (`get`), tested (`contains`), removed (`delete`), plus `touch` (refresh the
age the garbage collector reads) and `scan` (list everything, for the collector). `PosixBackend`
keeps one file per object under a directory on any POSIX filesystem (a 3FS FUSE mount in
production): a write goes to a temporary file beside its target and is renamed over it, so a reader
never sees a half-written object under the final name, and several processes on several machines can
share the directory (a rename is atomic; the last of two writers of one name wins, and both wrote the
same content). A `scheme://...` location is opened by the backend a plugin registered for that scheme
(`register_prefix_stores`), e.g. 3FS's native USRBIO client or Mooncake Store.
"""

from __future__ import annotations

import os
import secrets
import shutil
import stat
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Protocol, runtime_checkable

TEMP_SUFFIX = ".tmp"
"""Files being written end in `.<pid>.<random>.tmp`; the collector removes old ones (a writer died)."""


@runtime_checkable
class StoreBackend(Protocol):
    """Named byte objects, written atomically; names are relative paths of `/`-separated parts."""

    def put(self, name: str, data: bytes | memoryview) -> None:
        """Store `data` under `name`, replacing any object of that name all at once (never partially)."""

    def get(self, name: str, max_bytes: int) -> bytes | None:
        """The object's bytes, or None if there is none; at most `max_bytes` of them are read (a longer
        object gives its first `max_bytes`, which the reader refuses as too long)."""

    def contains(self, name: str) -> bool:
        """Whether an object of that name exists (its content is not checked)."""

    def delete(self, name: str) -> None:
        """Remove the object; no error if it is already gone."""

    def touch(self, name: str) -> bool:
        """Mark the object used now (the age `scan` reports); False if it does not exist."""

    def scan(self) -> Iterator[tuple[str, int, float]]:
        """Every object as `(name, size in bytes, last write or touch as a Unix time)`."""


class PosixBackend:
    """One file per object under `root` (created if missing); see the module docstring."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise ValueError(f"prefix store directory {self.root} cannot be created: {err}") from err
        if not os.access(self.root, os.W_OK | os.X_OK):
            raise ValueError(f"prefix store directory {self.root} is not writable; give a directory this "
                             "process may write")

    def _path(self, name: str) -> Path:
        return self.root / name

    def put(self, name: str, data: bytes | memoryview) -> None:
        path = self._path(name)
        path.parent.mkdir(parents=True, exist_ok=True)
        temp = path.with_name(f"{path.name}.{os.getpid()}.{secrets.token_hex(4)}{TEMP_SUFFIX}")
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
        except BaseException:
            os.close(fd)
            temp.unlink(missing_ok=True)
            raise
        os.close(fd)
        os.replace(temp, path)

    def get(self, name: str, max_bytes: int) -> bytes | None:
        try:  # never follow a link out of the store, never block on a FIFO someone left there
            fd = os.open(self._path(name), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except (FileNotFoundError, NotADirectoryError):
            return None
        except OSError:  # a link (ELOOP) or a directory: not a block, and the reader refuses b""
            return b""
        with os.fdopen(fd, "rb") as f:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                return b""
            return f.read(max_bytes)

    def contains(self, name: str) -> bool:
        return self._path(name).is_file()

    def delete(self, name: str) -> None:
        path = self._path(name)
        try:
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)  # a directory where a block file belongs
            else:
                path.unlink()
        except (FileNotFoundError, NotADirectoryError):
            pass

    def touch(self, name: str) -> bool:
        try:
            now = time.time()
            os.utime(self._path(name), (now, now))
            return True
        except (FileNotFoundError, NotADirectoryError):
            return False

    def scan(self) -> Iterator[tuple[str, int, float]]:
        for directory, _, files in os.walk(self.root):
            for file in files:
                path = Path(directory) / file
                try:
                    stat = path.stat()
                except FileNotFoundError:
                    continue  # removed by another process meanwhile
                yield path.relative_to(self.root).as_posix(), stat.st_size, stat.st_mtime


def open_backend(location: str, plugin_backends: dict[str, Callable[[str], StoreBackend]] | None = None) -> StoreBackend:
    """The backend for `location`: a directory path (POSIX files), or `scheme://...` served by the
    backend a plugin registered for `scheme`.

    :raises ValueError: an unknown scheme (the message lists the registered ones).
    """
    scheme, sep, _ = location.partition("://")
    if not sep or scheme == "file":
        return PosixBackend(location.removeprefix("file://"))
    if plugin_backends is None:
        from deepinfer_core import plugins

        plugin_backends = plugins.prefix_store_backends()
    factory = plugin_backends.get(scheme)
    if factory is None:
        raise ValueError(f"no prefix store backend for {scheme!r}:// (registered: {sorted(plugin_backends) or 'none'});"
                         " give a directory path, or install the plugin that registers this scheme")
    backend = factory(location)
    if not isinstance(backend, StoreBackend):
        raise TypeError(f"the {scheme!r} prefix store backend {type(backend).__name__} lacks put/get/contains/"
                        "delete/touch/scan")
    return backend
