"""Who may talk to whom when the cluster is secured (CURVE + ZAP allow-lists).

Key folder (made by `launch.py keys init`, or by `launch.py --curve` when missing):

    KEYDIR/                    0700, every file 0600
      head.key                 the head's public key: every engine and client needs it
      head.key_secret          the head's secret: the head only (never copy it)
      engines/engine.key       the cluster's engine credential (public) - the head's allow-list
      engines/engine.key_secret  its secret: every engine node needs it (copy to joining nodes)
      clients/NAME.key         allow-list of client (trainer) public keys: head and engines
      clients/NAME.key_secret  a client's secret, when the key was made here (give it to
                               that trainer; `keys add-client NAME --public FILE` imports a
                               trainer's own public key and leaves no secret here)

ZAP domains (one per kind of server socket; a key allowed in one is refused in
the others; bus/roles.py says who each admits without CURVE):

    "clients"  head frontend                       clients/*.key
    "engines"  head events + control PUB            engines/*.key
    "data"     engine data socket                   head.key
    "weights"  engine weight socket                 clients/*.key
    "peers"    engine data socket, --direct-clients head.key + clients/*.key

`Gatekeeper` is the one ZAP authenticator of a process's zmq context (libzmq
asks the handler bound at inproc://zeromq.zap.01 of the socket's context, so
one per context, bound before any secured socket accepts). It runs pyzmq's
ThreadAuthenticator: the head and the engine node run plain (non-asyncio)
poll loops, and a handshake must be answered even while the engine loop sits
inside a long backend step. The allow-lists are read at start and re-read by
`refresh()` (the owner loop's tick) whenever a key file is added, removed or
changed, so `launch.py keys add-client` takes effect on a running cluster.
Removing a key also cuts what its holder already has open: `peer_key` reads
the CURVE key ZAP vouched for off each received frame (its "User-Id"), and
the owner refuses frames, and ends requests, of a key no longer allowed.

Join token (security off, the default): `launch.py` makes one random secret per
cluster (`new_token_file`, 0600). Engines present it in `Register`, clients in
each `Control` that changes cluster state; a peer CURVE already authenticated
needs none. `find_token` is how a client on the launcher's host finds it
without being told: `token_path_for(address)` (next to an IPC socket, else in
`token_dir()` under the frontend's host and port).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import glob
import hmac
import os
import re
import secrets
import socket
import stat
import time
from collections.abc import Iterable

import structlog
import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

from bus import roles
from bus.errors import BadRequest
from bus.ratelog import RateLimitedLog
from bus.safe_files import UnsafePath, check_folder, check_own_file, create_private, make_private_folder
from bus.sockets import CurveKeys

log = structlog.get_logger("bus.auth")

CLIENTS = "clients"  # ZAP domain of the head's frontend
ENGINES = "engines"  # ZAP domain of the head's events and control sockets
PEERS = "peers"  # ZAP domain of an engine's data socket with --direct-clients
DOMAINS = (CLIENTS, ENGINES, PEERS, roles.DATA, roles.WEIGHTS)

HEAD = "head"
ENGINE = "engine"  # the cluster's engine credential: engines/engine.key(_secret)
DEFAULT_CLIENT = "default"  # made by `keys init`; the launcher's own client uses it
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


class KeyFileError(BadRequest):
    """A key folder or key file that cannot be used; `field` names the option
    that points at it and the message says what to do."""


@dataclasses.dataclass(frozen=True)
class KeyInfo:
    role: str  # head | engine | client
    name: str
    public: str  # z85
    has_secret: bool
    path: str


def _write_private(path: str, text: str) -> None:
    """Create a key file 0600 from the first byte (no chmod after a umask-wide
    create: for that moment a world-readable secret would exist)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w", encoding="utf8") as f:
        f.write(text)


def _key_text(public: bytes, secret: bytes | None) -> str:
    # pyzmq's certificate format, so zmq.auth.load_certificate(s) reads it.
    when = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    lines = [f"#   ****  Generated on {when} by rollout-bus  ****", ""]
    lines += ["metadata", "curve", f'    public-key = "{public.decode("ascii")}"']
    if secret is not None:
        lines.insert(1, "#   ZeroMQ CURVE **Secret** Certificate: give it to no one else")
        lines.append(f'    secret-key = "{secret.decode("ascii")}"')
    return "\n".join(lines) + "\n"


def write_keypair(folder: str, name: str) -> tuple[str, str]:
    """A new CURVE keypair as folder/name.key + folder/name.key_secret (both 0600)."""
    check_name(name)
    os.makedirs(folder, mode=0o700, exist_ok=True)
    public, secret = zmq.curve_keypair()
    pub_path, sec_path = os.path.join(folder, f"{name}.key"), os.path.join(folder, f"{name}.key_secret")
    for p in (pub_path, sec_path):
        if os.path.exists(p):
            raise KeyFileError(f"{p} exists: a key is never overwritten (remove it first to replace it)", field="name")
    _write_private(sec_path, _key_text(public, secret))
    _write_private(pub_path, _key_text(public, None))
    return pub_path, sec_path


def check_name(name: str) -> str:
    if not _NAME.match(name):
        raise KeyFileError(
            f"key name {name!r}: letters, digits, '_', '.', '-' (1-64, starting with a letter or digit)", field="name"
        )
    return name


def check_private(path: str, field: str) -> None:
    """Refuse a secret readable by group or others, as ssh does: whoever could
    read it can be this peer (the file's fix is in the message)."""
    try:
        mode = stat.S_IMODE(os.stat(path).st_mode)
    except OSError as e:
        raise KeyFileError(f"cannot read {path}: {e.strerror}", field=field) from None
    if mode & 0o077:
        raise KeyFileError(
            f"{path} is accessible by group/others (mode {mode:04o}): a secret must be private to its owner "
            f"(chmod 600 {path})",
            field=field,
        )


def _load(path: str, *, secret: bool, field: str = "curve_dir") -> tuple[bytes, bytes | None]:
    if secret:
        check_private(path, field)
    try:
        pub, sec = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as e:
        raise KeyFileError(f"cannot read CURVE key {path}: {e}", field=field) from None
    if secret and sec is None:
        raise KeyFileError(f"{path} holds no secret key", field=field)
    return pub, sec


class KeyDir:
    """The key folder of one cluster (layout in the module docstring)."""

    def __init__(self, root: str) -> None:
        self.root = os.path.abspath(os.path.expanduser(root))
        self.engines_dir = os.path.join(self.root, "engines")
        self.clients_dir = os.path.join(self.root, "clients")

    def path(self, *parts: str) -> str:
        return os.path.join(self.root, *parts)

    # ------------------------------------------------------------ making keys

    def exists(self) -> bool:
        return os.path.exists(self.path(f"{HEAD}.key"))

    def init(self) -> KeyDir:
        """Make the head's keys, the engine credential and the default client
        key where missing (never overwrites a key). A folder it cannot write
        (read-only, another owner's) is a KeyFileError naming the folder."""
        try:
            if not os.path.isdir(self.root):
                self.safe()  # the parents, before anything is made under them
                os.makedirs(self.root, mode=0o700)
                os.chmod(self.root, 0o700)  # makedirs' mode passes through the umask
            self.safe()
            if not self.exists():
                write_keypair(self.root, HEAD)
            if not glob.glob(os.path.join(self.engines_dir, "*.key_secret")):
                write_keypair(self.engines_dir, ENGINE)
            if not os.path.exists(os.path.join(self.clients_dir, f"{DEFAULT_CLIENT}.key")):
                write_keypair(self.clients_dir, DEFAULT_CLIENT)
            self.safe(self.engines_dir, self.clients_dir)
        except OSError as e:
            where = e.filename or self.root
            raise KeyFileError(
                f"cannot make the CURVE keys in the key folder {self.root} ({where}: {e.strerror}): make it "
                "writable, or point --curve-dir at a folder holding the keys (`launch.py keys init --curve-dir DIR`)",
                field="curve_dir",
            ) from None
        return self

    def add_client(self, name: str, public_file: str | None = None) -> str:
        """Allow a client: make its keypair here (returns the secret's path, for
        that trainer) or import its public key from `public_file` (returns the
        allow-list entry's path)."""
        check_name(name)
        target = os.path.join(self.clients_dir, f"{name}.key")
        if os.path.exists(target):
            raise KeyFileError(
                f"client {name!r} already exists ({target}); remove that file first to replace it", field="name"
            )
        os.makedirs(self.clients_dir, mode=0o700, exist_ok=True)
        if public_file is None:
            return write_keypair(self.clients_dir, name)[1]
        pub, _ = _load(public_file, secret=False)
        _write_private(target, _key_text(pub, None))
        return target

    def remove_client(self, name: str) -> list[str]:
        gone = []
        for suffix in (".key", ".key_secret"):
            p = os.path.join(self.clients_dir, name + suffix)
            if os.path.exists(p):
                os.remove(p)
                gone.append(p)
        if not gone:
            raise KeyFileError(f"no client {name!r} in {self.clients_dir}", field="name")
        return gone

    def listing(self) -> list[KeyInfo]:
        rows = []
        for role, pattern in ((HEAD, self.path(f"{HEAD}.key")), (ENGINE, os.path.join(self.engines_dir, "*.key"))):
            rows += [self._info(role, p) for p in sorted(glob.glob(pattern))]
        rows += [self._info("client", p) for p in sorted(glob.glob(os.path.join(self.clients_dir, "*.key")))]
        return rows

    def _info(self, role: str, path: str) -> KeyInfo:
        pub, _ = _load(path, secret=False)
        name = os.path.basename(path)[: -len(".key")]
        return KeyInfo(role, name, pub.decode("ascii"), os.path.exists(path + "_secret"), path)

    # ------------------------------------------------------------ per-process keys

    def _require(self, path: str, what: str, field: str = "curve_dir") -> str:
        if not os.path.exists(path):
            raise KeyFileError(
                f"{what}: {path} is missing (make the folder with `python launch.py keys init --curve-dir {self.root}`"
                " on the head node and copy it to the others, without head.key_secret)",
                field=field,
            )
        return path

    def safe(self, *subfolders: str) -> None:
        """The folder (and `subfolders` of it that exist) can be written by no
        other user, nor can a folder above it (bus/safe_files.py: as ssh checks
        ~/.ssh): else a KeyFileError naming curve_dir."""
        try:
            check_folder(self.root, "curve_dir")
            for sub in subfolders:
                if os.path.lexists(sub):
                    check_folder(sub, "curve_dir")
        except UnsafePath as e:
            raise KeyFileError(e.message, field=e.field) from None

    def head_public(self) -> bytes:
        self.safe()
        return _load(self._require(self.path(f"{HEAD}.key"), "the head's public key"), secret=False)[0]

    def head(self) -> CurveKeys:
        """The head's own keys (server of frontend, events and control)."""
        self.safe(self.engines_dir, self.clients_dir)
        pub, sec = _load(self._require(self.path(f"{HEAD}.key_secret"), "the head's secret key"), secret=True)
        assert sec is not None
        return CurveKeys(public=pub, secret=sec)

    def engine(self) -> CurveKeys:
        """The engine credential (server of its data/weight sockets, client of the head)."""
        self.safe(self.engines_dir, self.clients_dir)
        found = sorted(glob.glob(os.path.join(self.engines_dir, "*.key_secret")))
        if not found:
            self._require(os.path.join(self.engines_dir, f"{ENGINE}.key_secret"), "the engine credential")
        pub, sec = _load(found[0], secret=True)
        assert sec is not None
        return CurveKeys(public=pub, secret=sec, server_public=self.head_public())

    def client(self, key: str | None = None) -> CurveKeys:
        """A client's keys: `key` is a name in clients/ (default "default") or
        the path of a .key_secret file (a trainer's own key)."""
        key = key or DEFAULT_CLIENT
        if os.sep in key or key.endswith(".key_secret"):
            path = os.path.expanduser(key)
        else:
            self.safe(self.clients_dir)
            path = os.path.join(self.clients_dir, f"{key}.key_secret")
        pub, sec = _load(self._require(path, f"client key {key!r}", "client_key"), secret=True, field="client_key")
        assert sec is not None
        return CurveKeys(public=pub, secret=sec, server_public=self.head_public())

    # ------------------------------------------------------------ allow-lists

    def allowed(self, domain: str) -> frozenset[bytes]:
        """The z85 public keys a server socket of `domain` accepts (a folder
        another user can write: KeyFileError, nothing read from it)."""
        self.safe(self.engines_dir, self.clients_dir)
        files = {
            CLIENTS: self._publics(self.clients_dir),
            ENGINES: self._publics(self.engines_dir),
            PEERS: [self.path(f"{HEAD}.key"), *self._publics(self.clients_dir)],
            roles.DATA: [self.path(f"{HEAD}.key")],
            roles.WEIGHTS: self._publics(self.clients_dir),
        }[domain]
        keys = set()
        for p in files:
            try:
                keys.add(_load(p, secret=False)[0])  # pyzmq's key files hold z85 already
            except KeyFileError as e:  # one unreadable file must not lock everyone out
                log.warning("key_file_skipped", path=p, error=str(e))
        return frozenset(keys)

    @staticmethod
    def _publics(folder: str) -> list[str]:
        return sorted(glob.glob(os.path.join(folder, "*.key")))

    def signature(self) -> tuple[tuple[str, int], ...]:
        """Changes when an allow-list file is added, removed or rewritten."""
        out = []
        for p in [self.path(f"{HEAD}.key"), *self._publics(self.engines_dir), *self._publics(self.clients_dir)]:
            try:
                out.append((p, os.stat(p).st_mtime_ns))
            except FileNotFoundError:
                pass
        return tuple(out)


class _Zap(ThreadAuthenticator):
    """pyzmq's ZAP thread with PLAIN passwords compared in constant time
    (its own compares with ==). `plain`: domain -> {username: password},
    replaced whole by the owner (one attribute store), read here once."""

    plain: dict[str, dict[str, str]] = {}
    refused = 0  # PLAIN handshakes refused (this thread's count; read by the owner for stats)
    # Set by the Gatekeeper: the authenticator thread's own rate-limited log (one line per interval per domain).
    refusals: RateLimitedLog | None = None

    def _authenticate_plain(self, domain: str, username: str, password: str) -> tuple[bool, bytes]:
        expected = self.plain.get(domain, {}).get(username)
        if expected is not None and hmac.compare_digest(expected.encode(), password.encode()):
            return True, b"OK"
        self.refused += 1
        if self.refusals is not None:
            self.refusals.refused(
                "zap_refused", kind=f"zap_refused.{domain}", domain=domain, mechanism="PLAIN", username=username[:64]
            )
        return False, b"wrong credential for this socket's role"


class Gatekeeper:
    """The ZAP authenticator of one zmq context: CURVE keys checked against the
    allow-list of the connecting socket's ZAP domain, PLAIN credentials against
    the role secrets of `plain` (domain -> {username: password}, bus/roles.py).
    `keys` None: no CURVE (PLAIN only).

    Threads: `callback` runs on pyzmq's authenticator thread; `refresh` on the
    owner's loop. They share only `_allowed`, which `refresh` replaces whole
    (one attribute store, atomic under the GIL) and `callback` reads once.
    """

    # Allow-list re-read period: a removed key's open connections are cut at
    # the next re-read (the owner's `revoked`), within 2 s of the removal.
    REFRESH_S = 1.0

    def __init__(
        self,
        ctx: zmq.Context,
        keys: KeyDir | None,
        domains: Iterable[str],
        plain: dict[str, dict[str, str]] | None = None,
    ) -> None:
        self.keys = keys
        self.domains = tuple(domains) if keys is not None else ()
        self._allowed: dict[str, frozenset[bytes]] = {}
        self._signature: tuple[tuple[str, int], ...] = ()
        self._checked_at = 0.0
        self.refused = 0  # handshakes refused (for stats and tests)
        self._auth = _Zap(ctx)
        self._auth.plain = dict(plain or {})
        self._started = False
        self._refusals = RateLimitedLog(log)  # the authenticator thread's own: one line per interval
        self._auth.refusals = self._refusals
        self._unsafe_log = RateLimitedLog(log)  # refresh's (the owner loop's): re-tried every REFRESH_S

    def start(self) -> Gatekeeper:
        self.refresh(force=True)
        self._auth.start()
        self._started = True
        for d in self.domains:
            self._auth.configure_curve_callback(d, credentials_provider=self)
        return self

    def refresh(self, now: float | None = None, *, force: bool = False) -> bool:
        """Re-read the allow-lists if a key file changed (at most every REFRESH_S)."""
        if self.keys is None:
            return False
        now = time.monotonic() if now is None else now
        if not force and now - self._checked_at < self.REFRESH_S:
            return False
        self._checked_at = now
        sig = self.keys.signature()
        if sig == self._signature and not force:
            return False
        try:
            allowed = {d: self.keys.allowed(d) for d in self.domains}
        except KeyFileError as e:  # the folder became writable by others: keep what was read before
            if force:
                raise
            self._unsafe_log.refused("key_folder_unsafe", "error", error=e.message, kept="the allow-lists read before")
            return False
        self._signature = sig
        self._allowed = allowed
        log.info("allow_lists_loaded", **{d: len(k) for d, k in self._allowed.items()})
        return True

    def allows(self, domain: str, key: bytes) -> bool:
        """Is this z85 key on `domain`'s allow-list (as last loaded)?"""
        return key in self._allowed.get(domain, frozenset())

    def callback(self, domain: str, key: bytes) -> bool:
        ok = self.allows(domain, key)
        if not ok:
            self.refused += 1
            self._refusals.refused(
                "zap_refused", kind=f"zap_refused.{domain}", domain=domain, key=key.decode("ascii", "replace")
            )
        return ok

    def refused_total(self) -> int:
        """Handshakes refused so far, CURVE and PLAIN (ints written by the
        authenticator thread, read whole here: a stats figure, not a lock)."""
        return self.refused + self._auth.refused

    def stop(self) -> None:
        """Before the context is terminated (the ZAP socket belongs to it)."""
        if self._started:
            self._started = False
            self._auth.stop()


# ---------------------------------------------------------------- who sent a frame


def peer_key(frame: object) -> str | None:
    """The z85 CURVE public key ZAP authenticated for the connection a frame
    came over (its "User-Id" property); None on an unsecured socket."""
    get = getattr(frame, "get", None)
    if get is None:
        return None
    try:
        uid = get("User-Id")
    except (zmq.ZMQError, KeyError, TypeError):
        return None
    return uid if isinstance(uid, str) and len(uid) == 40 else None


# ---------------------------------------------------------------- join token

TOKEN_FILE_ENV = "ROLLOUT_BUS_TOKEN_FILE"  # a token file's path (engines, clients, launch.py --join)
TOKEN_DIR_ENV = "ROLLOUT_BUS_TOKEN_DIR"  # where launchers publish tokens by address (default token_dir())


def token_dir() -> str:
    return os.environ.get(TOKEN_DIR_ENV) or os.path.join(os.path.expanduser("~"), ".cache", "rollout-bus", "tokens")


def token_path_for(address: str) -> str | None:
    """Where the launcher on this host publishes the token of the head at
    `address`: next to its IPC socket file, else token_dir()/HOST_PORT.token."""
    if address.startswith("ipc://"):
        return address[len("ipc://") :] + ".token"
    if address.startswith("tcp://") and ":" in address[6:]:
        host, port = address[6:].rsplit(":", 1)
        name = re.sub(r"[^A-Za-z0-9_.-]", "_", f"{host.strip('[]')}_{port}")
        return os.path.join(token_dir(), f"{name}.token")
    return None


def new_token() -> str:
    return secrets.token_hex(32)


def write_token(path: str, token: str, field: str = TOKEN_DIR_ENV) -> str:
    """Write `token` to `path` 0600, atomically (a reader never sees half a
    token; an older file under that name is replaced). The folder must be ours
    and writable by no other user (a sticky one such as /tmp passes: no one
    renames our entries there); the file is made under a random name with
    O_EXCL | O_NOFOLLOW (a name planted there is refused, never followed), then
    renamed over `path` (which replaces a planted link, never writes through
    it). KeyFileError naming `field` when any of it fails."""
    folder = os.path.dirname(os.path.abspath(path))
    tmp = f"{path}.{secrets.token_hex(8)}.tmp"
    try:
        make_private_folder(folder, field, shared_ok=True)
        create_private(tmp, (token + "\n").encode("ascii"), field)
        try:
            os.replace(tmp, path)
            check_own_file(path, field)
        except BaseException:
            with contextlib.suppress(OSError):
                os.remove(tmp)
            raise
    except UnsafePath as e:
        raise KeyFileError(e.message, field=e.field) from None
    except OSError as e:
        raise KeyFileError(f"{field}: cannot write the join token {path}: {e.strerror}", field=field) from None
    return path


def read_token(path: str, field: str = "token_file") -> str:
    """The token in `path`: a file readable by group or others is refused
    (KeyFileError naming it), like a CURVE secret."""
    check_private(path, field)
    try:
        with open(path, encoding="ascii") as f:
            token = f.read().strip()
    except (OSError, UnicodeDecodeError) as e:
        raise KeyFileError(f"cannot read the join token {path}: {e}", field=field) from None
    if not 32 <= len(token) <= 256:
        raise KeyFileError(f"{path} holds no join token (32-256 characters expected)", field=field)
    return token


def find_token(address: str, token_file: str | None = None) -> tuple[str, str] | None:
    """(token, the file it came from) for a peer of the head at `address`:
    `token_file` if given ("" = none), else $ROLLOUT_BUS_TOKEN_FILE, else the
    file a launcher on this host published for `address`; None when none exists."""
    if token_file is not None:
        return (read_token(token_file), token_file) if token_file else None
    env = os.environ.get(TOKEN_FILE_ENV)
    if env:
        return read_token(env, TOKEN_FILE_ENV), env
    for path in token_paths_for(address):
        if os.path.exists(path):
            return read_token(path), path
    return None


def token_paths_for(address: str) -> list[str]:
    """Where a token for `address` may be published on this host, the exact
    name first: a head on this host is the same head whether it is reached as
    localhost, 127.0.0.1 or the host's name (the launcher publishes under the
    name it bound)."""
    path = token_path_for(address)
    if path is None:
        return []
    if not address.startswith("tcp://"):
        return [path]
    host, port = address[6:].rsplit(":", 1)
    local = ("127.0.0.1", "localhost", "0.0.0.0", "::1", socket.gethostname())
    if host.strip("[]") not in local:
        return [path]
    others = (token_path_for(f"tcp://{name}:{port}") for name in local)
    return list(dict.fromkeys([path, *(p for p in others if p is not None)]))


def token_matches(expected: str, given: str) -> bool:
    """Constant time: the comparison leaks nothing of the token."""
    return hmac.compare_digest(expected.encode(), given.encode())
