"""A row's files, handled as files a learner controls: created private from the start, read without
following links or blocking, removed whatever the learner left.

A submission's processes own their folders (:mod:`dtlib.grading.children`) and may put anything
there while the grader, often root, still reads and removes them: a symlink renamed over
``report.json`` (to ``/proc/kmsg``: a blocking read; to a root-only file), a FIFO, a 10 GiB file,
1,500 nested folders (``shutil.rmtree`` recurses once per level: ``RecursionError``).
"""
from __future__ import annotations

import os
import stat
from typing import BinaryIO

__all__ = ["open_private", "create_private", "copy_private", "read_limited", "read_tail", "remove_tree"]


def open_private(path: str | os.PathLike) -> BinaryIO:
    """A new file ``path`` for writing, mode 0600 from the start (``O_EXCL``: never an existing
    file or a link planted there; no window in which another user could open it)."""
    return os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600), "wb")


def create_private(path: str | os.PathLike, data: bytes = b"") -> None:
    """Create ``path`` holding ``data`` with :func:`open_private`."""
    with open_private(path) as f:
        f.write(data)


def copy_private(source: str | os.PathLike, target: str | os.PathLike) -> None:
    """Copy a (trusted) file into a row's folder with :func:`create_private`."""
    with open(source, "rb") as f:
        create_private(target, f.read())


def read_limited(path: str | os.PathLike, limit: int, owner: int | None = None) -> bytes:
    """The bytes of ``path`` if it is a regular file of at most ``limit`` bytes (owned by ``owner``
    when given: not a hard link to someone else's file); ``OSError`` otherwise. Opened with
    ``O_NOFOLLOW`` (a symlink in its place is refused) and ``O_NONBLOCK`` (a FIFO or a device
    never blocks the open)."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    with os.fdopen(fd, "rb") as f:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise OSError(f"{os.fspath(path)} is not a regular file")
        if info.st_size > limit:
            raise OSError(f"{os.fspath(path)} is larger than {limit} bytes")
        if owner is not None and info.st_uid != owner:
            raise OSError(f"{os.fspath(path)} is not owned by user {owner}")
        return f.read(limit)


def read_tail(path: str | os.PathLike, size: int) -> str:
    """The last ``size`` bytes of the regular file ``path`` as text (a log), ``""`` if it is not one."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return ""
    with os.fdopen(fd, "rb") as f:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            return ""
        f.seek(max(0, info.st_size - size))
        return f.read(size).decode(errors="replace")


def remove_tree(path: str | os.PathLike) -> list[str]:
    """Remove the folder ``path`` and everything in it, however deep, without following links;
    returns what could not be removed (``[]`` normally), never raises.

    Iterative, one open folder at a time (a stack of names, not of descriptors: 10,000 levels need
    neither recursion nor 10,000 descriptors); each folder is entered with ``O_NOFOLLOW`` relative
    to its parent, and left through ``..`` only after checking it is the parent it came from."""
    problems: list[str] = []
    top = os.fspath(path)
    try:
        fd = os.open(top, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return problems
    except OSError as exc:
        return [f"{top}: {exc}"]
    names: list[str] = []         # the path below top, one name per level
    parents: list[tuple[int, int]] = []  # (st_dev, st_ino) of each level's parent
    stuck: set[tuple[int, int]] = set()  # folders that could not be emptied: not entered again
    try:
        while True:
            child = _next_folder(fd, stuck, problems)
            if child is not None:
                try:
                    sub = os.open(child, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
                except OSError as exc:
                    stuck.add(_id(os.stat(child, dir_fd=fd, follow_symlinks=False)))
                    problems.append(f"{child}: {exc}")
                    continue
                info = os.fstat(fd)
                parents.append((info.st_dev, info.st_ino))
                names.append(child)
                os.close(fd)
                fd = sub
                continue
            if not names:
                break
            up = os.open("..", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=fd)
            os.close(fd)
            fd = up
            if _id(os.fstat(fd)) != parents.pop():
                problems.append(f"{top}: a folder was moved while it was removed")
                return problems
            name = names.pop()
            try:
                os.rmdir(name, dir_fd=fd)
            except OSError as exc:
                stuck.add(_id(os.stat(name, dir_fd=fd, follow_symlinks=False)))
                problems.append(f"{name}: {exc}")
    except OSError as exc:
        problems.append(f"{top}: {exc}")
    finally:
        os.close(fd)
    try:
        os.rmdir(top)
    except OSError as exc:
        problems.append(f"{top}: {exc}")
    return problems


def _id(info: os.stat_result) -> tuple[int, int]:
    return info.st_dev, info.st_ino


def _next_folder(fd: int, stuck: set[tuple[int, int]], problems: list[str]) -> str | None:
    """Unlink every non-folder in the open folder ``fd``; the name of a sub-folder still to empty
    (one not in ``stuck``), or ``None`` when none is left."""
    with os.scandir(fd) as entries:
        found = list(entries)
    for entry in found:
        try:
            info = entry.stat(follow_symlinks=False)
            if stat.S_ISDIR(info.st_mode):
                if _id(info) not in stuck:
                    return entry.name
                continue
            os.unlink(entry.name, dir_fd=fd)
        except FileNotFoundError:
            continue
        except OSError as exc:
            problems.append(f"{entry.name}: {exc}")
    return None
