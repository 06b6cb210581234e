"""`launch.py keys …`: the CURVE key folder of a secured cluster (--curve).

init | list | add-client NAME [--public FILE] | remove-client NAME | keypair NAME:
thin commands over bus.auth.KeyDir; what they print is what an operator copies
(docs/security.md).
"""

from __future__ import annotations

import argparse
import sys

from bus.auth import KeyDir, KeyFileError, write_keypair
from launcher.config import DEFAULT_KEY_DIR


def keys_main(argv: list[str]) -> int:
    """`launch.py keys …`: make and list the key folder of --curve (bus/auth.py)."""
    a = _keys_parser().parse_args(argv)
    keys = KeyDir(a.curve_dir)
    try:
        if a.cmd == "init":
            keys.init()
            print(f"key folder: {keys.root}")
        elif a.cmd == "add-client":
            path = keys.add_client(a.name, a.public)
            if a.public:
                print(f"client {a.name!r} allowed: {path}")
            else:
                print(f"client {a.name!r} allowed; give its secret to that trainer: {path}")
                print(f"  Client(address, curve_dir=<folder holding head.key>, client_key={path!r})")
        elif a.cmd == "keypair":
            pub, sec = write_keypair(a.out, a.name)
            print(f"keep {sec} here (Client(..., client_key={sec!r}));")
            print(f"send {pub} to the head's operator: launch.py keys add-client {a.name} --public {a.name}.key")
            return 0
        elif a.cmd == "remove-client":
            for p in keys.remove_client(a.name):
                print(f"removed {p}")
        if a.cmd in ("init", "list"):
            rows = [("role", "name", "public key (z85)", "secret here", "file")]
            rows += [(k.role, k.name, k.public, "yes" if k.has_secret else "no", k.path) for k in keys.listing()]
            widths = [max(len(r[i]) for r in rows) for i in range(5)]
            for r in rows:
                print("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip())
    except KeyFileError as e:
        print(f"launch.py keys {a.cmd}: {e}", file=sys.stderr)
        return 2
    if a.cmd.endswith("-client"):
        print("a running head (and engines sharing this folder) re-read the allow-lists within 2 s", flush=True)
    return 0


def _keys_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser("launch.py keys", description="The CURVE key folder of a secured cluster.")
    ap.add_argument("--curve-dir", default=DEFAULT_KEY_DIR, help=f"the key folder (default {DEFAULT_KEY_DIR})")
    # --curve-dir before or after the command (`keys init --curve-dir X`, as
    # KeyFileError suggests): SUPPRESS keeps the main parser's value when absent.
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--curve-dir", default=argparse.SUPPRESS, help="the key folder")
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser(
        "init", parents=[common], help="make the head's keys, the engine credential and the default client key"
    )
    sub.add_parser("list", parents=[common], help="every key in the folder: role, name, public key, secret here?")
    add = sub.add_parser(
        "add-client", parents=[common], help="allow a client (trainer): make its keypair, or import --public FILE"
    )
    add.add_argument("name")
    add.add_argument("--public", default=None, help="a public key file the trainer made (then no secret is made)")
    rm = sub.add_parser("remove-client", parents=[common], help="take a client off the allow-list")
    rm.add_argument("name")
    kp = sub.add_parser(
        "keypair", parents=[common], help="on a trainer's machine: make its own keypair (NAME.key to send to the head)"
    )
    kp.add_argument("name")
    kp.add_argument("--out", default=".", help="folder for NAME.key and NAME.key_secret (0600)")
    return ap
