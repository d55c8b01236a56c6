"""Moving a finished checkpoint directory into place atomically, and cleaning up after killed saves.

A checkpoint is written into a hidden sibling ``.<name>.tmp-<token>`` (``<token>`` starts with the writing
process's id) and then put under its final name. When nothing is there yet, ``rename(2)`` does it atomically.
When a checkpoint (or a file, or a symlink: ``ModelCheckpoint(save_last="link")``) already has that name,
``rename(2)`` cannot replace a non-empty directory, so the two entries are swapped with Linux's
``renameat2(RENAME_EXCHANGE)`` (ext4, xfs, btrfs, tmpfs; Linux >= 3.15, glibc >= 2.28) and the old one, now
under the hidden name, is removed: at every moment the final name holds the old or the new checkpoint,
complete. Where the exchange is not supported (e.g. NFS, another OS), the old entry is renamed aside to
``.<name>.old-<pid>`` first, which leaves a window of two renames with no checkpoint under the final name;
:func:`clean_stale` puts such an entry back on the next save into that directory.
"""

from __future__ import annotations

import ctypes
import errno
import os
import re
import shutil
from pathlib import Path

_AT_FDCWD = -100
_RENAME_EXCHANGE = 2


def _renameat2() -> object | None:
    """glibc's ``renameat2``, or ``None`` where the C library has none."""
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_RENAMEAT2 = _renameat2()


def exchange(a: Path, b: Path) -> bool:
    """Swap the directory entries ``a`` and ``b`` atomically (both must exist; either may be a file, a
    directory or a symlink). Returns ``False`` where the system or the filesystem cannot (nothing changed).

    Raises:
        OSError: the exchange failed for another reason (permissions, different filesystems...).
    """
    if _RENAMEAT2 is None:
        return False
    if _RENAMEAT2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EOPNOTSUPP):
        return False
    raise OSError(err, f"renameat2(RENAME_EXCHANGE) of {a} and {b}: {os.strerror(err)}")


def remove(path: Path) -> None:
    """Remove ``path`` whatever it is: a symlink (not its target), a file or a directory tree."""
    if path.is_symlink() or path.is_file():
        path.unlink()
    elif path.is_dir():
        shutil.rmtree(path)


def put_in_place(tmp: Path, final: Path) -> None:
    """Make the finished directory ``tmp`` the entry ``final`` (replacing whatever is there: a checkpoint
    directory, a file, a symlink) so that a crash at any moment leaves the old or the new one under
    ``final`` (see the module docstring for filesystems without ``RENAME_EXCHANGE``), then fsync the parent.

    Raises:
        OSError: a rename failed (``final`` still holds the old entry).
    """
    if not os.path.lexists(final):
        os.rename(tmp, final)
    elif exchange(tmp, final):  # tmp now holds the old entry
        remove(tmp)
    else:
        old = final.parent / f".{final.name}.old-{os.getpid()}"
        if os.path.lexists(old):
            remove(old)
        os.rename(final, old)
        os.rename(tmp, final)
        remove(old)
    fd = os.open(final.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _alive(pid: int) -> bool:
    """Whether a process with this id runs on this machine (one we may not signal counts as running)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def clean_stale(final: Path) -> list[Path]:
    """Deal with what killed saves of ``final`` left next to it: a ``.<name>.tmp-<pid>...`` directory (half
    written) is removed; a ``.<name>.old-<pid>`` (a complete checkpoint moved aside by the two-rename fallback)
    is renamed back to ``final`` when ``final`` is missing, else removed. Entries of a process that still
    runs are left alone (another save in progress). Returns the entries removed or restored.

    Raises:
        OSError: an entry could not be removed or renamed.
    """
    pattern = re.compile(r"^\." + re.escape(final.name) + r"\.(tmp|old)-(\d+)")
    done = []
    try:
        siblings = sorted(final.parent.iterdir())
    except FileNotFoundError:
        return done
    for p in siblings:
        m = pattern.match(p.name)
        if m is None or int(m.group(2)) == os.getpid() or _alive(int(m.group(2))):
            continue
        if m.group(1) == "old" and not os.path.lexists(final):
            os.rename(p, final)
        else:
            remove(p)
        done.append(p)
    return done
