"""The CURVE key folder (bus/auth.py) placed onto the Ray nodes of a RayCluster.

`launch.py --ray --curve` (and `RayCluster.start(curve_dir=..., ship_keys=True)`)
makes or reads the key folder on the driver's machine; each node process
needs part of it on ITS machine. `key_files` reads what one role needs
(never a client's secret; the head's secret only for the head), and the actor
writes it with `place_keys` into a private folder of its own (0700, files
0600) on its node before it starts its node process with --curve-dir there.

Hazards: the files travel as actor constructor arguments, so Ray's GCS holds
them while the actors live: a Ray cluster can run any code on every node
anyway, so it is inside the trust boundary; a cluster that is not is the
case for copying the folder yourself (`ship_keys=False`, --curve-dir on every
node). A placed copy is a snapshot: `launch.py keys add-client` on the driver
reaches the head and engines only after a restart of their actors. The
placed folder is removed when the actor stops its node process.
"""

from __future__ import annotations

import glob
import os
import shutil

from bus.auth import ENGINE, HEAD, KeyDir


def key_files(curve_dir: str, role: str) -> dict[str, str]:
    """{path relative to the key folder: text} of what a `role` ("head" |
    "engine") node needs: the head's public key and the clients' allow-list,
    plus the head's secret and the engines' allow-list (head) or the engine
    credential (engine). KeyFileError (field curve_dir) when one is missing."""
    keys = KeyDir(curve_dir)
    rel = [f"{HEAD}.key", *_publics(keys, "clients")]
    if role == HEAD:
        rel += [f"{HEAD}.key_secret", *_publics(keys, "engines")]
    else:
        secrets = sorted(glob.glob(os.path.join(keys.engines_dir, "*.key_secret")))
        name = os.path.basename(secrets[0])[: -len(".key_secret")] if secrets else ENGINE
        rel += [f"engines/{name}.key", f"engines/{name}.key_secret"]
    out = {}
    for r in rel:
        with open(keys._require(keys.path(r), f"{r} (for the {role})")) as f:
            out[r] = f.read()
    return out


def _publics(keys: KeyDir, sub: str) -> list[str]:
    return [f"{sub}/{os.path.basename(p)}" for p in sorted(glob.glob(keys.path(sub, "*.key")))]


def place_keys(files: dict[str, str], folder: str) -> str:
    """Write `files` into `folder` (made fresh: 0700, every file 0600 from its
    first byte); returns the folder, for --curve-dir."""
    shutil.rmtree(folder, ignore_errors=True)  # a restarted actor's last copy
    old = os.umask(0o077)
    try:
        for rel, text in files.items():
            if os.path.isabs(rel) or ".." in rel.split("/"):
                raise ValueError(f"key file {rel!r} is not inside the key folder")
            path = os.path.join(folder, rel)
            os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w", encoding="utf8") as f:
                f.write(text)
    finally:
        os.umask(old)
    os.chmod(folder, 0o700)
    return folder


def with_curve_dir(args: list[str], folder: str) -> list[str]:
    """A node's argv tail with --curve-dir pointing at `folder` (replaced or added)."""
    out = list(args)
    if "--curve-dir" in out:
        out[out.index("--curve-dir") + 1] = folder
    else:
        out += ["--curve-dir", folder]
    return out
