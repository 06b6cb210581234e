"""The form of a peer's address, checked where a user types one (the client's
constructor, launch.py --join) so that a malformed one is refused at once,
naming the field, instead of failing inside zmq on first use."""

from __future__ import annotations

import re

from bus.errors import BadRequest

# tcp://HOST:PORT with HOST a name, an IPv4 address or a [bracketed] IPv6 one.
_TCP = re.compile(r"tcp://(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]+):(\d{1,5})")
IPC_PATH_MAX = 107  # sun_path is 108 bytes with its terminating NUL (Linux)
EXPECTED = "tcp://HOST:PORT (e.g. tcp://127.0.0.1:5555) or ipc:///path/to/socket"


def address_problem(address: object) -> str | None:
    """Why `address` is not a connectable head address, naming the expected
    form (None: it is one)."""
    problem = _problem(address)
    if problem is None or EXPECTED in problem:
        return problem
    return f"{problem}; expected {EXPECTED}"


def _problem(address: object) -> str | None:
    if not isinstance(address, str):
        return f"{address!r} is not a string"
    if address.startswith(("ipc://", "inproc://")):
        path = address.split("://", 1)[1]
        if not path:
            return f"{address!r} names no path"
        if address.startswith("ipc://") and len(path.encode()) > IPC_PATH_MAX:
            return f"the ipc path is {len(path.encode())} bytes long; a Unix socket path holds {IPC_PATH_MAX}"
        return None
    m = _TCP.fullmatch(address)
    if m is None:
        return f"{address!r} is not of the form {EXPECTED}"
    if not 1 <= int(m.group(2)) <= 65535:
        return f"{address!r}: port {int(m.group(2))} is out of range (1-65535)"
    return None


def check_address(address: object, field: str = "address") -> str:
    """`address` if it is well formed, else BadRequest naming `field`."""
    problem = address_problem(address)
    if problem is not None:
        raise BadRequest(f"{field}: {problem}", field=field)
    assert isinstance(address, str)
    return address
