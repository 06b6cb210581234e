"""Issue 34 rows 11 and 12: key folders and token files another local user
cannot swap or plant (bus/safe_files.py, bus/auth.py, launcher/token.py).

The rows are about a second local user: where this test runs as root and the
machine has `nobody`, the folders are handed to that uid (chown) and the
planted link is made by a process running as it; elsewhere those tests skip
and say why. No processes of the cluster: these are file-system rules.
"""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import tempfile
import time

import pytest
import zmq

from bus import auth
from bus.auth import KeyDir, KeyFileError, write_token
from bus.safe_files import UnsafePath, check_folder, create_private
from launcher.keys import keys_main

pytestmark = pytest.mark.timeout(60)


def _nobody() -> int:
    if os.geteuid() != 0:
        pytest.skip("needs root to act as a second local user (chown / setuid to nobody)")
    try:
        return pwd.getpwnam("nobody").pw_uid
    except KeyError:
        pytest.skip("this machine has no 'nobody' user to act as a second local user")


def _shared(tmp_path, name: str, mode: int) -> str:
    d = tmp_path / name
    d.mkdir()
    os.chmod(d, mode)  # mkdir's mode passes through the umask
    return str(d)


def test_key_folder_through_a_symlink_to_a_0777_folder_is_refused(tmp_path, capsys):
    shared = _shared(tmp_path, "shared", 0o777)
    link = tmp_path / "keys"
    os.symlink(shared, link)
    assert keys_main(["init", "--curve-dir", str(link)]) == 2
    err = capsys.readouterr().err
    assert "curve_dir" in err and "another user" in err, err
    assert os.listdir(shared) == []  # nothing was made in it
    with pytest.raises(KeyFileError) as e:
        KeyDir(str(link)).head()
    assert e.value.field == "curve_dir"


def test_key_folder_under_a_folder_others_can_write_is_refused(tmp_path):
    parent = _shared(tmp_path, "open", 0o777)
    with pytest.raises(KeyFileError) as e:
        KeyDir(os.path.join(parent, "keys")).init()
    assert e.value.field == "curve_dir" and parent in e.value.message
    # A sticky folder (as /tmp) is fine above a private key folder: no one
    # else can rename what is in it.
    sticky = _shared(tmp_path, "sticky", 0o1777)
    KeyDir(os.path.join(sticky, "keys")).init().head()


def test_clients_folder_made_writable_is_refused_and_a_running_gatekeeper_keeps_its_lists(tmp_path):
    keys = KeyDir(str(tmp_path / "keys")).init()
    before = keys.allowed(auth.CLIENTS)
    assert len(before) == 1
    ctx = zmq.Context()
    gate = auth.Gatekeeper(ctx, keys, (auth.CLIENTS,)).start()
    try:
        os.chmod(keys.clients_dir, 0o777)
        with pytest.raises(KeyFileError):
            keys.allowed(auth.CLIENTS)
        with pytest.raises(KeyFileError):
            keys.head()
        # A key another user could have put there: the running head does not
        # take it (it keeps the lists it read from the safe folder).
        KeyDir(str(tmp_path / "other")).init()
        shutil.copy(tmp_path / "other" / "clients" / "default.key", os.path.join(keys.clients_dir, "mallory.key"))
        assert gate.refresh(now=time.monotonic() + 10) is False
        assert gate._allowed[auth.CLIENTS] == before
    finally:
        gate.stop()
        ctx.term()


def test_key_folder_owned_by_another_user_is_refused(tmp_path):
    uid = _nobody()
    keys = KeyDir(str(tmp_path / "keys")).init()
    keys.head()
    os.chown(keys.clients_dir, uid, uid)  # mode stays 0700: only the owner is wrong
    with pytest.raises(KeyFileError) as e:
        keys.allowed(auth.CLIENTS)
    assert f"owner uid {uid}" in e.value.message
    os.chown(keys.clients_dir, 0, 0)
    os.chown(keys.root, uid, uid)
    with pytest.raises(KeyFileError):
        keys.head()


def test_token_folder_others_can_write_is_refused(tmp_path, monkeypatch):
    shared = _shared(tmp_path, "tokens", 0o777)
    monkeypatch.setenv(auth.TOKEN_DIR_ENV, shared)
    path = auth.token_path_for("tcp://127.0.0.1:5555")
    assert path is not None
    with pytest.raises(KeyFileError) as e:
        write_token(path, auth.new_token())
    assert e.value.field == auth.TOKEN_DIR_ENV
    assert os.listdir(shared) == []


def test_planted_symlink_is_never_followed(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    folder = _shared(tmp_path, "pub", 0o700)
    path = os.path.join(folder, "h_1.token")
    # The name a launcher would have written through on fe0cb18 (its pid) and
    # the published name itself: both planted.
    os.symlink(victim, f"{path}.{os.getpid()}.tmp")
    os.symlink(victim, path)
    token = auth.new_token()
    write_token(path, token)
    assert victim.read_text() == "precious\n"
    assert not os.path.islink(path) and auth.read_token(path) == token
    with pytest.raises(UnsafePath):
        create_private(f"{path}.{os.getpid()}.tmp", b"x", "token")
    assert victim.read_text() == "precious\n"


def test_a_second_user_plants_a_link_in_a_sticky_token_folder():
    """The other user is a real process (`ln -s`) running as `nobody`."""
    uid = _nobody()
    # Under /tmp itself: pytest's own folders are 0700, which nobody cannot cross.
    with tempfile.TemporaryDirectory(prefix="rbt-sticky-") as top:
        os.chmod(top, 0o755)
        sticky = os.path.join(top, "shared")
        os.mkdir(sticky)
        os.chmod(sticky, 0o1777)
        victim = os.path.join(top, "victim")
        with open(victim, "w") as f:
            f.write("root's file\n")
        path = os.path.join(sticky, "h_1.token")
        subprocess.run(["ln", "-s", victim, path], check=True, user=uid, timeout=30)
        assert os.lstat(path).st_uid == uid
        write_token(path, auth.new_token())
        with open(victim) as f:
            assert f.read() == "root's file\n"
        assert not os.path.islink(path) and os.stat(path).st_uid == os.geteuid()


def test_folder_rules_are_those_of_ssh(tmp_path):
    ok = _shared(tmp_path, "ok", 0o700)
    assert check_folder(ok, "f") == os.path.realpath(ok)
    group = _shared(tmp_path, "group", 0o770)
    with pytest.raises(UnsafePath):
        check_folder(group, "f")
    sticky = _shared(tmp_path, "sticky", 0o1777)
    with pytest.raises(UnsafePath):
        check_folder(sticky, "f")  # the folder itself: private unless shared_ok
    assert check_folder(sticky, "f", shared_ok=True)
    # A folder not made yet is judged by the first parent that exists.
    assert check_folder(os.path.join(ok, "a", "b"), "f")
    with pytest.raises(UnsafePath):
        check_folder(os.path.join(group, "a"), "f")
