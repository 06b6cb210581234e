"""Security: who may register an engine id, and who may talk to the head and
to engine sockets (bus/auth.py, router_node/registry.py admit_register).

Unit tests (no sockets) for the key folder, the allow-lists and the
registration rule; in-process sockets for the ZAP domains; real processes for
the issue's scenarios: an impostor engine cannot take a live id (with and
without CURVE), a client without an allowed key is refused while an allowed
one is served, and `launch.py keys add-client` lets a client in on a running
cluster."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
import threading
import time

import pytest
import zmq

from bus import auth
from bus import protocol as P
from bus.auth import Gatekeeper, KeyDir, KeyFileError, write_keypair
from bus.endpoint import open_socket
from router_node.registry import Admission, EngineEntry, EngineState, admit_register
from tests.cluster import ROOT, child_env, free_port, wait_until
from trainer_bridge import AsyncClient, AuthRefused, Client, Unauthorized

pytestmark = pytest.mark.timeout(60)

NULL = {"backend": "null", "model": "null"}


# ---------------------------------------------------------------- key folder (no sockets)


def test_key_folder_is_private_and_never_overwritten(tmp_path):
    keys = KeyDir(str(tmp_path / "k")).init()
    files = [os.path.join(d, f) for d, _, fs in os.walk(keys.root) for f in fs]
    assert {os.path.relpath(f, keys.root) for f in files} == {
        "head.key", "head.key_secret", "engines/engine.key", "engines/engine.key_secret",
        "clients/default.key", "clients/default.key_secret",
    }  # fmt: skip
    assert all(stat.S_IMODE(os.stat(f).st_mode) == 0o600 for f in files)
    for d in (keys.root, keys.engines_dir, keys.clients_dir):
        assert stat.S_IMODE(os.stat(d).st_mode) == 0o700
    before = {f: _read(f) for f in files}
    KeyDir(keys.root).init()  # again: nothing replaced
    assert {f: _read(f) for f in files} == before

    secret = keys.add_client("trainer-1")
    assert secret.endswith("clients/trainer-1.key_secret") and stat.S_IMODE(os.stat(secret).st_mode) == 0o600
    own_pub, _ = write_keypair(str(tmp_path / "elsewhere"), "bob")  # a trainer's own key, made on its machine
    imported = keys.add_client("bob", own_pub)
    assert not os.path.exists(imported + "_secret")
    rows = {(k.role, k.name): k for k in keys.listing()}
    assert set(rows) == {
        ("head", "head"),
        ("engine", "engine"),
        ("client", "default"),
        ("client", "trainer-1"),
        ("client", "bob"),
    }
    assert rows["client", "bob"].public == keys.client(str(tmp_path / "elsewhere" / "bob.key_secret")).public.decode()
    assert not rows["client", "bob"].has_secret and rows["client", "trainer-1"].has_secret
    for bad in ("trainer-1", "../x", ""):
        with pytest.raises(KeyFileError) as ei:
            keys.add_client(bad)
        assert ei.value.field == "name"
    with pytest.raises(KeyFileError) as ei:
        keys.client("nobody")
    assert ei.value.field == "client_key" and "launch.py keys" in str(ei.value)


def _read(path: str) -> str:
    with open(path) as f:
        return f.read()


def test_allow_lists_are_separate_per_domain(tmp_path):
    keys = KeyDir(str(tmp_path / "k")).init()
    head, engine, client = keys.head().public, keys.engine().public, keys.client().public
    assert keys.allowed(auth.CLIENTS) == {client}
    assert keys.allowed(auth.ENGINES) == {engine}
    assert keys.allowed(auth.PEERS) == {head, client}  # engine sockets: the head and trainers, not engines
    assert keys.engine().server_public == head and keys.client().server_public == head


def _entry(incarnation: str, *, last_seen: float, state: EngineState = EngineState.HEALTHY) -> EngineEntry:
    reg = P.Register("e0", "ipc:///x", "", "null", "m", P.PROTOCOL_VERSION, incarnation)
    return EngineEntry(reg=reg, sock=None, registered_at=0.0, state=state, last_seen=last_seen)  # type: ignore[arg-type]


def test_a_live_engine_id_cannot_be_taken():
    reg = P.Register("e0", "ipc:///y", "", "null", "m", P.PROTOCOL_VERSION, "new")
    assert admit_register(None, reg, 10.0, deadline_s=1.5)[0] is Admission.NEW
    assert admit_register(_entry("new", last_seen=9.9), reg, 10.0, deadline_s=1.5)[0] is Admission.REPEAT
    verdict, why = admit_register(_entry("old", last_seen=9.9), reg, 10.0, deadline_s=1.5)
    assert verdict is Admission.TAKEN and "held by a live engine" in why and "missed_heartbeats" in why
    joining = _entry("old", last_seen=9.9, state=EngineState.JOINING)
    assert admit_register(joining, reg, 10.0, deadline_s=1.5)[0] is Admission.TAKEN
    # dead (past the heartbeat deadline, silent or not yet marked): a restart takes the id
    assert admit_register(_entry("old", last_seen=8.0), reg, 10.0, deadline_s=1.5)[0] is Admission.REPLACE
    silent = _entry("old", last_seen=9.9, state=EngineState.SILENT)
    assert admit_register(silent, reg, 10.0, deadline_s=1.5)[0] is Admission.REPLACE


# ---------------------------------------------------------------- ZAP domains (in-process sockets)


def test_zap_domains_check_each_socket_against_its_own_list(tmp_path):
    keys = KeyDir(str(tmp_path / "k")).init()
    ctx = zmq.Context()
    gate = Gatekeeper(ctx, keys, (auth.CLIENTS, auth.ENGINES)).start()
    socks = []
    try:
        servers = {}
        for domain in (auth.CLIENTS, auth.ENGINES):
            s = open_socket(ctx, zmq.ROUTER, bind="tcp://127.0.0.1:*", curve=keys.head(), zap_domain=domain)
            servers[domain] = s.getsockopt_string(zmq.LAST_ENDPOINT)
            socks.append(s)

        def connect(domain: str, curve) -> zmq.Socket:
            c = open_socket(ctx, zmq.DEALER, connect=servers[domain], curve=curve)
            socks.append(c)
            c.send(b"hi")
            return socks[(auth.CLIENTS, auth.ENGINES).index(domain)]

        def served(domain: str, curve) -> bool:
            server = connect(domain, curve)
            return bool(server.poll(10_000)) and server.recv_multipart()[-1] == b"hi"

        def refused(domain: str, curve, n: int) -> bool:
            server = connect(domain, curve)
            wait_until(lambda: gate.refused == n, 10, f"refusal {n}")
            return not server.poll(200)  # a refused handshake delivers nothing

        assert served(auth.CLIENTS, keys.client()) and served(auth.ENGINES, keys.engine())
        assert refused(auth.CLIENTS, keys.engine(), 1)  # an engine credential is no client key
        assert refused(auth.ENGINES, keys.client(), 2)  # and a client key cannot register engines
        # a key added to the folder is allowed after the next refresh (no restart)
        late = keys.client(keys.add_client("late"))
        assert gate.refresh(time.monotonic() + Gatekeeper.REFRESH_S)
        assert served(auth.CLIENTS, late)
    finally:
        for s in socks:
            s.close(linger=0)
        gate.stop()
        ctx.term()


# ---------------------------------------------------------------- real processes


def test_impostor_cannot_take_a_live_engine_id_and_a_restart_can(cluster_factory):
    """Without CURVE too: a second process registering e0 while e0 heartbeats
    is refused (and logged); the real e0 serves every request. Once e0 is dead,
    its restart gets the id."""
    cl = cluster_factory(1, **NULL)
    c = cl.client()
    cl.wait_ready(1, 30)  # the harness's wait: the head may still be starting
    (real,) = c.engines()
    imp = cl.start_engine("impostor", engine_id="e0", extra=["--register-timeout-s", "2"])
    assert imp.wait(timeout=30) == 2
    assert "held by a live engine" in cl.log("impostor")
    wait_until(lambda: "register_refused_id_taken" in cl.log("head"), 5, "the head's log of the refusal")
    rs = c.generate([[4, 5, 6]] * 20, {"max_tokens": 3})
    assert all(r.engine_id == "e0" and r.token_ids == [7, 8, 9] for r in rs)
    (now,) = c.engines()
    assert (now["incarnation"], now["pid"], now["data_address"]) == (
        real["incarnation"],
        real["pid"],
        real["data_address"],
    )

    cl.kill("e0")
    cl.start_engine("e0")  # the crashed engine's restart: waits out the old one's heartbeats, then joins
    wait_until(
        lambda: (e := c.health()["engines"].get("e0")) and e["healthy"] and e["incarnation"] != real["incarnation"],
        20,
        "the restarted e0 to take its id",
    )
    assert c.generate([4, 5, 6], {"max_tokens": 2}).token_ids == [7, 8]


def _keys(*args: str) -> str:
    out = subprocess.run(
        [sys.executable, "launch.py", "keys", *args],
        cwd=ROOT,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_secured_cluster_serves_allowed_clients_only(cluster_factory, tmp_path):
    key_dir = str(tmp_path / "keys")
    assert "head" in _keys("--curve-dir", key_dir, "init")
    curve = ["--curve-dir", key_dir]
    cl = cluster_factory(1, tcp=True, router_args=curve, engine_args=curve, **NULL)
    # A head that never answered fails a wait within connect_timeout_s (issue 35): it may still be starting.
    c = cl.client(curve_dir=key_dir, connect_timeout_s=30)  # the default client key of `keys init`
    c.wait_ready(1, 30)
    (engine,) = c.engines()
    assert (
        engine["data_address"].startswith("tcp://") and engine["curve_key"] == KeyDir(key_dir).engine().public.decode()
    )
    assert c.generate([4, 5, 6], {"max_tokens": 3}).token_ids == [7, 8, 9]

    # a client with its own keypair, knowing the head's public key, is refused at once
    stranger_pub, stranger = write_keypair(str(tmp_path / "trainer-host"), "stranger")
    t0 = time.monotonic()
    with pytest.raises(AuthRefused) as ei:
        cl.client(curve_dir=key_dir, client_key=stranger).generate([4, 5, 6], {"max_tokens": 3})
    assert ei.value.field == "client_key" and time.monotonic() - t0 < 5
    # a client without keys is refused at once too, told that the cluster is secured (issue 23)
    t0 = time.monotonic()
    with pytest.raises(AuthRefused) as ei:
        cl.client().generate([4, 5, 6], {"max_tokens": 3})
    assert ei.value.field == "curve_dir" and "has no keys" in str(ei.value) and time.monotonic() - t0 < 5
    # ... and so is it on the engine's data socket, which admits the head alone (issue 34 row 2:
    # an allowed client key opens the frontend only)
    with pytest.raises(AuthRefused):
        _direct(engine, KeyDir(key_dir).client(stranger))
    with pytest.raises(AuthRefused):
        _direct(engine, KeyDir(key_dir).client())

    # an impostor engine with a client key as its credential cannot reach the events socket
    fake = tmp_path / "fake"  # the real head key, and the default client's keypair posing as an engine credential
    os.makedirs(fake / "engines")
    shutil.copy(os.path.join(key_dir, "head.key"), fake / "head.key")
    for suffix in (".key", ".key_secret"):
        shutil.copy(os.path.join(key_dir, "clients", "default" + suffix), fake / "engines" / ("engine" + suffix))
    imp = cl.start_engine("impostor", engine_id="e0", extra=["--curve-dir", str(fake), "--register-timeout-s", "2"])
    assert imp.wait(timeout=30) == 2
    assert "refused this engine's CURVE key" in cl.log("impostor")
    wait_until(lambda: "zap_refused" in cl.log("head") and '"engines"' in cl.log("head"), 5, "the head's ZAP log")
    assert [e["pid"] for e in c.engines()] == [engine["pid"]]

    # the operator allows the stranger's public key: served without a restart
    assert "allowed" in _keys("--curve-dir", key_dir, "add-client", "stranger", "--public", stranger_pub)
    deadline = time.monotonic() + 10
    while True:  # the head re-reads its allow-list within Gatekeeper.REFRESH_S
        try:
            assert cl.client(curve_dir=key_dir, client_key=stranger).generate([4, 5], {"max_tokens": 2}).token_ids
            break
        except AuthRefused:
            assert time.monotonic() < deadline, "the head never re-read its allow-list"
            time.sleep(0.5)
    assert "stranger" in _keys("--curve-dir", key_dir, "list")


def _direct(engine: dict, curve) -> list[int]:
    """A Generate sent straight to the engine's data socket (not through the head)."""
    import asyncio

    async def go() -> list[int]:
        ac = AsyncClient(engine["data_address"], timeout_s=5, control_timeout_s=5)
        ac._curve = curve.connecting_to(engine["curve_key"].encode())
        try:
            return (await ac.generate([4, 5, 6], {"max_tokens": 3})).token_ids
        finally:
            await ac.close()

    return asyncio.run(go())


def test_client_key_option_names_the_field(tmp_path):
    keys = KeyDir(str(tmp_path / "k")).init()
    with pytest.raises(KeyFileError) as ei:
        Client("tcp://127.0.0.1:1", curve_dir=keys.root, client_key="nobody")
    assert ei.value.field == "client_key"


# ---------------------------------------------------------------- issue 22: revocation, private secrets


def test_removing_a_client_key_cuts_its_open_connection(cluster_factory, tmp_path):
    """Issue 22: a client key removed with `keys remove-client` kept its open
    connection served (generate, pause): revocation only stopped new
    handshakes. Now the head re-reads the allow-list within Gatekeeper.REFRESH_S
    and ends what that key has open (typed Unauthorized, field client_key),
    then refuses its frames; other clients are served on."""
    key_dir = str(tmp_path / "keys")
    _keys("--curve-dir", key_dir, "init")
    _keys("--curve-dir", key_dir, "add-client", "trainer")
    curve = ["--curve-dir", key_dir]
    slow = {**NULL, "backend_options": {"tokens_per_step": 1, "step_delay_s": 0.02}}  # 5000 tokens: 100 s
    # --direct-clients: the engine's data socket admits allowed client keys too (else the head alone)
    cl = cluster_factory(1, tcp=True, router_args=curve, engine_args=[*curve, "--direct-clients"], **slow)
    ops = cl.client(curve_dir=key_dir, connect_timeout_s=30)  # the default client key: stays allowed
    ops.wait_ready(1, 30)  # (connect_timeout_s: the head may still be starting)
    trainer = cl.client(curve_dir=key_dir, client_key="trainer")
    assert trainer.generate([4, 5, 6], {"max_tokens": 3}).token_ids == [7, 8, 9]
    (engine,) = ops.engines()
    direct = _DirectConnection(engine, KeyDir(key_dir).client("trainer"))  # straight to the engine's data socket
    assert direct.generate() == [7, 8, 9]
    chunks: list = []
    ended: dict = {}

    def consume() -> None:
        try:
            for ch in trainer.stream([4, 5, 6], {"max_tokens": 5000}):
                chunks.append(ch)
            ended["finished"] = True
        except Exception as e:
            ended["error"], ended["at"] = e, time.monotonic()

    t = threading.Thread(target=consume, daemon=True)
    t.start()
    wait_until(lambda: chunks, 20, "the stream's first chunk")
    removed_at = time.monotonic()
    _keys("--curve-dir", key_dir, "remove-client", "trainer")
    t.join(30)
    err = ended.get("error")
    assert isinstance(err, Unauthorized) and err.field == "client_key", ended
    # the target is 2 s after the removal (Gatekeeper.REFRESH_S = 1 s); generous here for a loaded CI machine
    assert ended["at"] - removed_at < 6, ended["at"] - removed_at
    with pytest.raises(Unauthorized):
        trainer.generate([4, 5, 6], {"max_tokens": 3})
    with pytest.raises(Unauthorized):
        trainer.pause("keep")
    assert not ops.is_paused()
    # the engine re-reads its copy of the allow-list too: the open direct connection is refused
    wait_until(lambda: isinstance(direct.generate(), Unauthorized), 10, "the engine to refuse the removed key")
    direct.close()
    assert ops.generate([4, 5, 6], {"max_tokens": 3}).token_ids == [7, 8, 9]
    counters = ops.stats()["counters"]
    assert counters["clients_revoked"] == 1 and counters["unauthorized"] >= 2
    assert "client_key_revoked" in cl.log("head")


class _DirectConnection:
    """One AsyncClient connection to an engine's data socket, kept open across
    calls (its own loop thread), as a trainer sending to an engine directly."""

    def __init__(self, engine: dict, curve) -> None:
        import asyncio

        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        self._ac = AsyncClient(engine["data_address"], timeout_s=5, control_timeout_s=5)
        self._ac._curve = curve.connecting_to(engine["curve_key"].encode())

    def generate(self):
        import asyncio

        async def go():
            try:
                return (await self._ac.generate([4, 5, 6], {"max_tokens": 3})).token_ids
            except Unauthorized as e:
                return e

        return asyncio.run_coroutine_threadsafe(go(), self._loop).result(30)

    def close(self) -> None:
        import asyncio

        asyncio.run_coroutine_threadsafe(self._ac.close(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()


def test_group_readable_secret_keys_are_refused(tmp_path):
    """Issue 22: secret key files with mode 0644 in 0755 folders were loaded
    without a word. Like ssh, a secret readable by group or others is refused
    with an error naming the file; public keys may be readable."""
    keys = KeyDir(str(tmp_path / "k")).init()
    os.chmod(keys.root, 0o755)
    client_secret = os.path.join(keys.clients_dir, "default.key_secret")
    os.chmod(client_secret, 0o644)
    with pytest.raises(KeyFileError) as ei:
        keys.client()
    assert client_secret in str(ei.value) and "0644" in str(ei.value) and ei.value.field == "client_key"
    with pytest.raises(KeyFileError):
        Client("tcp://127.0.0.1:1", curve_dir=keys.root)
    os.chmod(client_secret, 0o600)
    os.chmod(keys.path("head.key"), 0o644)  # a public key: fine
    assert keys.client().server_public == keys.head_public()

    head_secret = keys.path("head.key_secret")
    os.chmod(head_secret, 0o640)
    with pytest.raises(KeyFileError, match="group/others"):
        keys.head()
    ports = [f"tcp://127.0.0.1:{free_port()}" for _ in range(3)]
    out = subprocess.run(
        [sys.executable, "-m", "router_node", "--frontend", ports[0], "--events", ports[1], "--control", ports[2],
         "--curve-dir", keys.root],
        cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 2, out.stdout + out.stderr
    assert head_secret in out.stdout + out.stderr and "Traceback" not in out.stdout + out.stderr


def test_curve_with_a_read_only_key_folder_names_the_folder(tmp_path):
    """Issue 22: `--curve` with a read-only key folder printed a raw OSError
    traceback instead of an error naming the folder."""
    ro = tmp_path / "ro-keys"
    ro.mkdir()
    os.chmod(ro, 0o500)
    cmd = [sys.executable, "launch.py", "--curve", "--curve-dir", str(ro), "--port", "0", "--engines", "0", "--once"]
    if os.geteuid() == 0:  # root writes anywhere: drop the capabilities that let it
        if shutil.which("setpriv") is None:
            pytest.skip("running as root without setpriv: permission bits do not bind root")
        cmd = ["setpriv", "--bounding-set", "-dac_override,-dac_read_search,-fowner", "--inh-caps=-all", "--", *cmd]
    out = subprocess.run(cmd, cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=120)
    text = out.stdout + out.stderr
    assert out.returncode != 0, text
    assert f"key folder {ro}" in text and "Traceback" not in text, text
    assert os.listdir(ro) == []  # nothing made, the folder's mode left as the operator set it
    assert stat.S_IMODE(os.stat(ro).st_mode) == 0o500
