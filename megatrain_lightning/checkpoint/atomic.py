"""Moving a finished checkpoint directory into place atomically, and cleaning up after killed saves
(docs/internals/checkpoints.md, "Atomic save"). ``renameat2(RENAME_EXCHANGE)`` needs Linux >= 3.15, glibc >= 2.28
and a filesystem that has it (ext4, xfs, btrfs, tmpfs); elsewhere (NFS, another OS) the old entry is renamed aside.
"""

from __future__ import annotations

import ctypes
import errno
import hashlib
import os
import re
import shutil
from pathlib import Path


_AT_FDCWD = -100
_RENAME_EXCHANGE = 2
NAME_MAX = 255  # bytes per name on Linux filesystems; used where the filesystem does not say
_HEAD_BYTES = 64  # bytes of the final name kept at the start of a hidden entry's name
_HASH_HEX = 16  # hex digits of the final name's sha256 in a hidden entry's name


def name_max(directory: Path) -> int:
    """The longest name, in bytes, the filesystem of ``directory`` (or of its nearest existing parent) accepts:
    ``pathconf(PC_NAME_MAX)``, or :data:`NAME_MAX` where the system does not say."""
    d = Path(os.path.abspath(directory))
    while not os.path.exists(d) and d != d.parent:
        d = d.parent
    try:
        limit = os.pathconf(d, "PC_NAME_MAX")
    except (OSError, ValueError):
        return NAME_MAX
    return limit if limit and limit > 0 else NAME_MAX


def check_name_length(path: Path, what: str = "checkpoint", shorter: str | None = None) -> None:
    """Raise before anything is written when a name in ``path`` (its last entry or a missing folder above it) is
    longer, in UTF-8 bytes, than its filesystem accepts.

    Args:
        path: the entry about to be written.
        what: what is written there, for the message.
        shorter: how to choose a shorter name, for the message (default: ``ModelCheckpoint(filename=...)`` or
            the path given to ``trainer.save_checkpoint``).

    Raises:
        OSError: ``errno.ENAMETOOLONG``, naming the entry, its length, the limit and what to do.
    """
    path = Path(path)
    limit = name_max(path.parent)
    for entry in [path] + [p for p in path.parents if not os.path.exists(p)]:
        size = len(os.fsencode(entry.name))
        if size <= limit:
            continue
        kind = "its name" if entry == path else f"the folder name {entry.name!r} in its path"
        hint = shorter or ("pass a shorter `filename=` (or `dirpath=`) to ModelCheckpoint (the name it saves is the "
                           "filename with its metric values filled in, plus '.ckpt'), or a shorter path to "
                           "trainer.save_checkpoint")
        raise OSError(errno.ENAMETOOLONG, (
            f"megatrain: cannot write the {what} {path}: {kind} is {size} bytes long (UTF-8) and the filesystem "
            f"accepts names of at most {limit} bytes (NAME_MAX). Nothing was written; {hint}."))


def _hidden_stem(final: Path) -> str:
    """``.<head>~<hash>``, the start of every hidden entry made for ``final``: ``<head>`` is the name's first 64
    bytes at most (ending on a whole UTF-8 character), ``<hash>`` 16 hex digits of its sha256."""
    raw = os.fsencode(final.name)
    cut = min(len(raw), _HEAD_BYTES)
    while 0 < cut < len(raw) and (raw[cut] & 0xC0) == 0x80:  # not inside a multi-byte character
        cut -= 1
    return f".{os.fsdecode(raw[:cut])}~{hashlib.sha256(raw).hexdigest()[:_HASH_HEX]}"


def temporary_path(final: Path, token: str | None = None) -> Path:
    """The hidden sibling a save of ``final`` writes into: ``.<head>~<hash>~tmp-<token>``, at most 103 bytes
    with a token of up to 16 characters.

    Args:
        token: the writing process's id, optionally followed by ``-`` and hex digits (default: the process id);
            :func:`clean_stale` reads the process id from it.
    """
    final = Path(final)
    return final.parent / f"{_hidden_stem(final)}~tmp-{token if token is not None else os.getpid()}"


def aside_path(final: Path, pid: int | None = None) -> Path:
    """Where :func:`put_in_place` moves the old entry of ``final`` without ``RENAME_EXCHANGE``:
    ``.<head>~<hash>~old-<pid>`` (default ``pid``: this process's)."""
    final = Path(final)
    return final.parent / f"{_hidden_stem(final)}~old-{pid if pid is not None else os.getpid()}"


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
    """Swap the existing entries ``a`` and ``b`` (files, directories or symlinks) atomically. Returns ``False``,
    changing nothing, where the system or the filesystem cannot.

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
    """Make the finished directory ``tmp`` the entry ``final``, replacing whatever is there: ``rename(2)`` when the
    name is free, else the exchange (the old entry then removed), else the old entry renamed aside first (a window
    of two renames with nothing under ``final``, which :func:`clean_stale` repairs); then fsync the parent.

    Raises:
        OSError: a rename failed (``final`` still holds the old entry).
    """
    if not os.path.lexists(final):
        os.rename(tmp, final)
    elif exchange(tmp, final):  # tmp now holds the old entry
        remove(tmp)
    else:
        old = aside_path(final)
        remove(old)  # an earlier save with this process id may have left one
        os.rename(final, old)
        os.rename(tmp, final)
        remove(old)
    fsync_path(final.parent)


def fsync_path(path: Path) -> None:
    """``fsync`` the file or directory ``path``."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def pid_alive(pid: int) -> bool:
    """Whether a process with this id runs on this machine (one we may not signal counts as running)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def clean_stale(final: Path) -> list[Path]:
    """Deal with what killed saves of ``final`` left next to it: a half-written :func:`temporary_path` is removed;
    a complete checkpoint at :func:`aside_path` is renamed back to ``final`` when ``final`` is missing, else
    removed. Entries named ``.<name>.tmp-<pid>...`` and ``.<name>.old-<pid>`` are treated the same way; those of a
    process still running (a save in progress) are left alone. Returns the entries removed or restored.

    Raises:
        OSError: an entry could not be removed or renamed.
    """
    final = Path(final)
    token = r"(\d+)(?:-[0-9a-f]+)?"
    patterns = (re.compile(re.escape(_hidden_stem(final)) + r"~(tmp|old)-" + token),
                re.compile(re.escape(f".{final.name}") + r"\.(tmp|old)-" + token))
    done = []
    try:
        siblings = sorted(final.parent.iterdir())
    except FileNotFoundError:
        return done
    for p in siblings:
        m = next((m for m in (pat.fullmatch(p.name) for pat in patterns) if m is not None), None)
        if m is None or int(m.group(2)) == os.getpid() or pid_alive(int(m.group(2))):
            continue
        if m.group(1) == "old" and not os.path.lexists(final):
            os.rename(p, final)
        else:
            remove(p)
        done.append(p)
    return done
