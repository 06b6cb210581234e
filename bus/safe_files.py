"""Folders and files another local user cannot swap under us (as ssh checks
~/.ssh before it trusts a key in it).

A key folder (bus.auth.KeyDir) decides who may connect; a token folder holds
the cluster's join secret. Either is only as safe as the folders above it: a
folder another user can write lets that user rename our `clients/` away and
put theirs in its place, or plant a symlink where we are about to write.

Rules (`check_folder`), applied to the real path (a symlink is resolved first,
so a link to a 0777 folder is judged by that folder):
- the folder itself is owned by us (the effective uid) or root and writable by
  no one else (group/other write bits clear; `shared_ok`: a sticky folder such
  as /tmp passes, since there no one can rename or remove what we create);
- every parent up to our home folder (or up to "/" when the folder is not
  under it) is owned by us or root and is either not writable by others or
  sticky (in a sticky folder no one but its owner renames our entries).

`create_private` writes a new file with O_EXCL | O_NOFOLLOW: a name already
there (a planted symlink included) is refused, never followed.
"""

from __future__ import annotations

import os
import stat

from bus.errors import BadRequest


class UnsafePath(BadRequest):
    """A folder or file another local user can write or swap; `field` names
    the option or variable that points at it, the message the fix."""


def _owner_ok(st: os.stat_result) -> bool:
    return st.st_uid in (os.geteuid(), 0)


def _stop_at() -> str:
    home = os.path.expanduser("~")
    return os.path.realpath(home) if home and home != "~" else "/"


def _describe(path: str, st: os.stat_result) -> str:
    return f"{path} (owner uid {st.st_uid}, mode {stat.S_IMODE(st.st_mode):04o})"


def check_folder(path: str, field: str, *, shared_ok: bool = False) -> str:
    """The real path of folder `path` once it and its parents pass the rules
    above; UnsafePath naming `field` otherwise. A missing folder is checked
    from its first existing parent (what creates it makes it 0700)."""
    real = os.path.realpath(os.path.expanduser(path))
    probe = real
    while not os.path.exists(probe):
        up = os.path.dirname(probe)
        if up == probe:
            break
        probe = up
    try:
        st = os.stat(probe)
    except OSError as e:
        raise UnsafePath(f"cannot check {probe}: {e.strerror}", field=field) from None
    if probe == real:
        sticky = bool(st.st_mode & stat.S_ISVTX)
        if not _owner_ok(st) or (st.st_mode & 0o022 and not (shared_ok and sticky)):
            raise UnsafePath(
                f"{field}: {_describe(real, st)} can be written by another user (uid {os.geteuid()} or root must "
                f"own it, mode without group/other write: chmod 700 {real})",
                field=field,
            )
        probe = os.path.dirname(probe)
    _check_parents(real, probe, field)
    return real


def _check_parents(real: str, start: str, field: str) -> None:
    stop = _stop_at()
    under_home = stop != "/" and (real + os.sep).startswith(stop.rstrip(os.sep) + os.sep)
    cur = start
    while True:
        try:
            st = os.stat(cur)
        except OSError as e:
            raise UnsafePath(f"cannot check {cur}: {e.strerror}", field=field) from None
        if not _owner_ok(st) or (st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX):
            raise UnsafePath(
                f"{field}: {real} lies in {_describe(cur, st)}, a folder another user can write: they could "
                "swap what is in it (move it under a folder only you and root can write)",
                field=field,
            )
        if (under_home and cur == stop) or cur == os.path.dirname(cur):
            return
        cur = os.path.dirname(cur)


def make_private_folder(path: str, field: str, *, shared_ok: bool = False) -> str:
    """`path` created 0700 where missing, then checked (`check_folder`)."""
    check_folder(path, field, shared_ok=shared_ok)
    os.makedirs(path, mode=0o700, exist_ok=True)
    return check_folder(path, field, shared_ok=shared_ok)


def create_private(path: str, data: bytes, field: str) -> None:
    """A new 0600 file at `path` holding `data`: a name already there (a file
    or a planted symlink) is refused (UnsafePath), never followed."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags, 0o600)
    except FileExistsError:
        raise UnsafePath(
            f"{field}: {path} already exists (a planted name?): refused, not followed", field=field
        ) from None
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def check_own_file(path: str, field: str) -> os.stat_result:
    """`path` is a regular file (not a symlink) owned by us or root."""
    try:
        st = os.lstat(path)
    except OSError as e:
        raise UnsafePath(f"cannot check {path}: {e.strerror}", field=field) from None
    if not stat.S_ISREG(st.st_mode) or not _owner_ok(st):
        kind = "a symlink" if stat.S_ISLNK(st.st_mode) else "not a regular file of yours"
        raise UnsafePath(f"{field}: {_describe(path, st)} is {kind}: refused", field=field)
    return st
