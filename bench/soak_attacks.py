"""Attack soak (issue 34, "Tests"): the fault soak of bench/soak_faults.py with
attacks mixed in, for --minutes on CPU.

The cluster is `python launch.py --backend null` (paced: one token per
--step-delay-s step, so streams last), 2 engines, TCP on free ports, a short
--lease-s; the launcher restarts a dead head. Legitimate clients
(--concurrency workers of bench.soak_faults.Soak) loop generate / stream of
100-400 tokens and check every token count and finish reason. Every
--fault-every-s one of these, in turn:

  steal     a peer with no token reads the head's incarnation from one pong
            and each engine's data address from engines(), connects a DEALER
            with ROUTING_ID b"head/" + incarnation to every engine data socket,
            pings, reads for 1 s and leaves (issue 34 row 1);
  replay    a weight update (zmq transport) is made while its frontend frames
            are captured; --replay-after (66) updates later the captured Begin /
            Finish frames are sent again from a raw peer (row 4): the cluster
            version must not move and the replayed Begin must be refused;
  flood     a raw ZMTP 3.0 peer sends --flood-frames one-byte frames, all
            flagged "more", to the frontend (row 8): the head's RSS growth
            while it is connected is recorded;
  stop      the head is SIGSTOPped for --stop-s (5 s), then continued (row 13):
            no stream may be lost;
  kill      kill -9 of the head (restarted by the launcher);
  trainer   kill -9 of a trainer inside `paused()` (the lease releases it).

Each attack has a window (its start to --attack-window-s after its end); a
legitimate request's error, short stream or hang inside an attack's window is
charged to that attack; outside every window (and not a head death's
expected HeadUnavailable) it is unexplained. The verdict names each attack and
what it broke. RSS of every process (head, each engine, the launcher) is
sampled every --sample-every-s; the RSS criterion is growth warm-up -> end.

Expected on branches that lack other helpers' fixes (issue 34): `steal`
breaks streams until handshake auth by role lands (i34-auth); `flood` grows
the head until the frame flood bound lands (i34-auth); `replay` commits a
replayed update until versions only move up (i34-state).

    python -m bench.soak_attacks --minutes 30
    python -m bench.soak_attacks --minutes 0.4 --fault-every-s 3 --attacks steal,stop

Writes bench/results/soak_attacks.json; exit code 1 when a criterion fails, 2 when one could not be judged.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from typing import Any

import psutil
import zmq

from bench.harness import criterion
from bench.harness import verdict as judge
from bench.soak_faults import ROOT, Launcher, Soak, _growth, _rss_mib
from bus import protocol as P
from bus import roles
from bus.auth import find_token
from bus.codec import Codec
from bus.proctree import terminate_tree

# In turn, by default: the stealing peer wedges a fe0cb18 cluster until its
# head restarts, so it goes just before the head kill (whose restart heals it)
# and the attacks before it are judged on a cluster that still serves.
ATTACKS = ("stop", "flood", "replay", "trainer", "steal", "kill")
GROWTH_LIMIT = 0.25
FLOOD_LIMIT_MIB = 64.0  # what a flood may make the head hold while it is connected


class NullLauncher(Launcher):
    """bench.soak_faults.Launcher with the null engine, paced."""

    def __init__(self, lease_s: float, engines: int, step_delay_s: float) -> None:
        opts = json.dumps({"tokens_per_step": 1, "step_delay_s": step_delay_s})
        argv = [
            sys.executable, os.path.join(ROOT, "launch.py"), "--backend", "null", "--backend-options", opts,
            "--engines", str(engines), "--port", "0", "--lease-s", str(lease_s), "--max-restarts", "1000",
            "--ready-timeout-s", "120",
        ]  # fmt: skip
        env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
        self.proc = subprocess.Popen(
            argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True
        )
        self.lines: list[str] = []
        self.front: str | None = None
        self._ready = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()


# ---------------------------------------------------------------- attackers (threads: blocking sockets)


def _pong(front: str, timeout_s: float = 3.0) -> P.HeadPong | None:
    codec = Codec()
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(front)
    try:
        s.send_multipart(codec.encode(P.ClientPing()))
        if s.poll(int(timeout_s * 1000)):
            msg, _ = codec.decode(s.recv_multipart())
            return msg if isinstance(msg, P.HeadPong) else None
        return None
    finally:
        s.close(linger=0)
        ctx.term()


def steal(front: str, data_addresses: list[str]) -> dict[str, Any]:
    """Row 1: a DEALER as b"head/" + incarnation on every engine data socket."""
    pong = _pong(front)
    if pong is None or not pong.incarnation:
        return {"stolen": 0, "note": "the head's pong names no incarnation: its data identity is not derivable"}
    codec = Codec()
    ctx = zmq.Context()
    socks = []
    stolen = 0
    try:
        for addr in data_addresses:
            s = ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.setsockopt(zmq.ROUTING_ID, b"head/" + pong.incarnation.encode())
            s.connect(addr)
            s.send_multipart(codec.encode(P.ClientPing()))
            socks.append(s)
        end = time.monotonic() + 1.0
        while time.monotonic() < end:
            for s in socks:
                while s.poll(0):
                    s.recv_multipart()
                    stolen += 1
            time.sleep(0.02)
    finally:
        for s in socks:
            s.close(linger=0)
        ctx.term()
    return {"stolen": stolen}


def replay(front: str, frames: list[list[bytes]]) -> dict[str, Any]:
    """Row 4: captured frontend frames of an old update, sent again by a token
    holder (the worst case: a peer without the token never passes the handshake)."""
    codec = Codec()
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    found = find_token(front)
    if found is not None:
        cred = roles.as_role(found[0], roles.CLIENT)
        if cred is not None:
            cred.apply(s, None)
    s.connect(front)
    accepted = refused = 0
    try:
        for f in frames:
            try:
                # Never a blocking send: a refused handshake ends the DEALER's pipe
                # and a blocking send then waits forever (it froze a 30-minute run).
                s.send_multipart(f, zmq.NOBLOCK)
            except zmq.Again:
                refused += 1
                continue
            if s.poll(10_000):
                msg, _ = codec.decode(s.recv_multipart())
                if isinstance(msg, P.Error):
                    refused += 1
                else:
                    accepted += 1
    finally:
        s.close(linger=0)
        ctx.term()
    return {"replayed": len(frames), "accepted": accepted, "refused": refused}


def _zmtp_frame(body: bytes, flags: int) -> bytes:
    return (
        bytes([flags, len(body)]) + body
        if len(body) < 256
        else bytes([flags | 2]) + struct.pack(">Q", len(body)) + body
    )


def flood(front: str, n_frames: int, head_pid: int | None) -> dict[str, Any]:
    """Row 8: a raw ZMTP 3.0 peer (NULL mechanism) sends one-byte frames, all
    flagged "more", never the last; the head's RSS is read while it is connected."""
    host, port = front[len("tcp://") :].rsplit(":", 1)
    before = _rss_mib([head_pid]) if head_pid else 0.0
    peak = before
    sent = 0
    err = None
    try:
        with socket.create_connection((host, int(port)), timeout=5) as sk:
            sk.sendall(b"\xff" + b"\x00" * 8 + b"\x7f" + b"\x03\x00" + b"NULL".ljust(20, b"\x00") + b"\x00" * 32)
            sk.recv(64)  # the head's greeting (a secured head answers and then drops us)
            prop = b"\x0bSocket-Type" + struct.pack(">I", 6) + b"DEALER"
            sk.sendall(_zmtp_frame(b"\x05READY" + prop, 0x04))
            chunk = _zmtp_frame(b"x", 0x01) * 65536
            while sent < n_frames:
                sk.sendall(chunk)
                sent += 65536
                if head_pid and sent % (65536 * 4) == 0:
                    peak = max(peak, _rss_mib([head_pid]))
            time.sleep(0.5)
            if head_pid:
                peak = max(peak, _rss_mib([head_pid]))
    except OSError as e:  # the head cut us off: what a bound should do
        err = f"{type(e).__name__}: {e}"
    time.sleep(1.0)
    after = _rss_mib([head_pid]) if head_pid else 0.0
    return {"frames": sent, "head_mib_before": before, "head_mib_peak": peak, "head_mib_after": after, "cut": err}


# ---------------------------------------------------------------- the soak


class AttackSoak(Soak):
    def __init__(self, a: argparse.Namespace, launcher: Launcher, front: str) -> None:
        super().__init__(a, launcher, front)
        self.attacks: list[dict[str, Any]] = []
        self.captured: list[list[bytes]] = []  # the frontend frames of one update (replay)
        self.updates = 0

    async def _update(self, client: Any, capture: bool) -> None:
        """One weight update (zmq transport); `capture`: keep its frontend frames."""
        import torch  # lazy: only the replay attack makes updates

        codec = Codec()
        orig = client._send
        frames: list[list[bytes]] = []

        def recording(msg: Any, buffers: Any = ()) -> None:
            if isinstance(msg, P.Control) and isinstance(msg.op, (P.BeginWeightUpdate, P.FinishWeightUpdate)):
                frames.append([bytes(f) for f in codec.encode(msg, buffers)])
            orig(msg, buffers)

        if capture:
            client._send = recording
        try:
            await client.update_weights([("w", torch.full((8,), float(self.updates)))], timeout_s=30)
            self.updates += 1
        finally:
            client._send = orig
        if capture:
            self.captured = frames

    async def _attack(self, client: Any, kind: str) -> dict[str, Any]:
        rec: dict[str, Any] = {"attack": kind, "start": time.monotonic()}
        try:
            if kind == "steal":
                data = [e["data_address"] for e in await client.engines()]
                rec |= await asyncio.to_thread(steal, self.front, data)
            elif kind == "replay":
                rec |= await self._replay(client)
            elif kind == "flood":
                heads = self.launcher.role_pids()["head"]
                rec |= await asyncio.to_thread(flood, self.front, self.a.flood_frames, heads[0] if heads else None)
            elif kind == "stop":
                heads = self.launcher.role_pids()["head"]
                os.kill(heads[0], signal.SIGSTOP)
                await asyncio.sleep(self.a.stop_s)
                os.kill(heads[0], signal.SIGCONT)
            elif kind == "kill":
                await self._head_fault(client)
                rec |= self.head_faults[-1]
            elif kind == "trainer":
                await self._trainer_fault(client)
                rec |= self.trainer_faults[-1]
        except Exception as e:  # the attack itself failed: recorded, the soak goes on
            rec["attack_error"] = f"{type(e).__name__}: {e}"[:300]
        rec["end"] = time.monotonic()
        self.attacks.append(rec)
        return rec

    async def _replay(self, client: Any) -> dict[str, Any]:
        await self._update(client, capture=True)
        for _ in range(self.a.replay_after):  # past the head's memory of ended update ids (64)
            await self._update(client, capture=False)
        before = (await client.health())["weight_version"]
        out = await asyncio.to_thread(replay, self.front, self.captured)
        await asyncio.sleep(1.0)
        out["version_before"] = before
        out["version_after"] = (await client.health())["weight_version"]
        return out

    async def _faults(self, client: Any, end: float) -> None:
        kinds = [k for k in self.a.attacks.split(",") if k]
        i = 0
        while True:
            await asyncio.sleep(max(0.0, min(self.a.fault_every_s, end - time.monotonic())))
            if time.monotonic() >= end - 2:
                return
            await self._attack(client, kinds[i % len(kinds)])
            i += 1

    async def run(self) -> None:
        """Soak.run with a request deadline of --request-timeout-s: a stream an
        attack broke ends within it (RequestTimeout), charged to that attack."""
        from trainer_bridge import AsyncClient

        client = AsyncClient(self.front, timeout_s=self.a.request_timeout_s)
        try:
            await client.wait_ready(timeout_s=60)
            if "replay" in self.a.attacks:
                # The first update loads what the transport needs (torch) in
                # every engine: before the clock and the RSS warm-up start.
                await self._update(client, capture=False)
            end = time.monotonic() + self.a.minutes * 60
            self.t0 = time.monotonic()
            tasks = [self._worker(client, end, i, 200) for i in range(self.a.concurrency)]
            await asyncio.gather(*tasks, self._faults(client, end), self._sampler(end))
        finally:
            await client.close()

    async def _sampler(self, end: float) -> None:
        while time.monotonic() < end:
            roles = self.launcher.role_pids()
            row = {"t": time.monotonic() - self.t0, "head_mib": _rss_mib(roles["head"])}
            row["engines_mib"] = _rss_mib(roles["engine"])
            for i, pid in enumerate(sorted(roles["engine"])):
                row[f"engine{i}_mib"] = _rss_mib([pid])
            row["launcher_mib"] = psutil.Process(self.launcher.proc.pid).memory_info().rss / 2**20
            self.rss.append(row)
            await asyncio.sleep(self.a.sample_every_s)


def _charge(s: AttackSoak, window_s: float) -> tuple[dict[str, list[str]], list[dict[str, Any]]]:
    """Each bad legitimate outcome charged to the attack whose window holds it."""
    c = s.classify()  # head kills' expected HeadUnavailable / recovery errors are not charged
    explained = {id(r) for r in s.requests if r.get("outcome") not in (None, "finished")} - {
        id(r) for r in c["unexplained"]
    }
    broke: dict[str, list[str]] = {}
    unexplained = []
    for r in s.requests:
        out = r.get("outcome")
        if out in (None, "finished") or id(r) in explained:
            continue
        t0, t1 = r["start"], r.get("end", time.monotonic())
        # The latest attack that started before the request ended and whose
        # window it overlaps: a later attack is the likelier cause.
        hits = [a for a in s.attacks if t0 <= a["end"] + window_s and t1 >= a["start"]]
        hit = max(hits, key=lambda a: a["start"]) if hits else None
        if hit is None:
            unexplained.append(r)
        else:
            broke.setdefault(hit["attack"], []).append(str(out))
    return broke, unexplained


def verdict(s: AttackSoak, a: argparse.Namespace) -> dict[str, Any]:
    broke, unexplained = _charge(s, a.attack_window_s)
    findings: dict[str, str] = {}
    for rec in s.attacks:
        k = rec["attack"]
        bad = []
        if k in broke:
            counts: dict[str, int] = {}
            for o in broke[k]:
                counts[o] = counts.get(o, 0) + 1
            bad.append(f"legitimate requests broken: {counts}")
        if k == "steal" and rec.get("stolen"):
            bad.append(f"{rec['stolen']} messages meant for the head reached the stealing peer")
        if k == "replay" and (rec.get("accepted") or rec.get("version_after") != rec.get("version_before")):
            bad.append(
                f"replayed update frames accepted {rec.get('accepted')}/{rec.get('replayed')}, cluster version "
                f"{rec.get('version_before')} -> {rec.get('version_after')}"
            )
        if k == "flood" and rec.get("head_mib_peak", 0) - rec.get("head_mib_before", 0) > FLOOD_LIMIT_MIB:
            grew = rec["head_mib_peak"] - rec["head_mib_before"]
            bad.append(f"head RSS +{grew:.0f} MiB while the flood was connected (limit {FLOOD_LIMIT_MIB:.0f})")
        if k == "trainer" and not rec.get("ok"):
            bad.append("the dead trainer's pause was not released within lease_s + 3 s")
        if k == "kill" and rec.get("serves_again_s") is None:
            bad.append("the restarted head did not serve again")
        if rec.get("attack_error"):
            bad.append(f"attack could not run: {rec['attack_error']}")
        if bad:
            findings[f"{k}@{rec['start'] - s.t0:.0f}s"] = "; ".join(bad)
    outcomes: dict[str, int] = {}
    for r in s.requests:
        outcomes[r.get("outcome", "unended")] = outcomes.get(r.get("outcome", "unended"), 0) + 1
    growth = {k: _growth(s.rss, k) for k in (s.rss[0] if s.rss else {}) if k.endswith("_mib")}
    criteria = {
        "no_unexplained_errors": not unexplained,
        "no_hangs": outcomes.get("hang", 0) + outcomes.get("unended", 0) == 0,
        "every_attack_held": not findings,
        # None (not judged) when a run was too short for _growth to judge memory: never a pass
        "rss_growth_below_25pct": (
            None
            if not growth or any(g is None for g in growth.values())
            else all(g is not None and g < GROWTH_LIMIT for g in growth.values())
        ),
    }
    word, _code = judge(criteria)
    return {
        "minutes": a.minutes,
        "attacks_run": [r["attack"] for r in s.attacks],
        "requests": len(s.requests),
        "outcomes": outcomes,
        "findings": findings,
        "unexplained_errors": [{k: r.get(k) for k in ("kind", "outcome", "error")} for r in unexplained[:20]],
        "attacks": [{k: v for k, v in r.items() if k not in ("start", "end")} for r in s.attacks],
        "rss_growth": growth,
        "rss_max_mib": {k: max(x.get(k, 0.0) for x in s.rss) for k in growth},
        "rss": s.rss,
        "criteria": criteria,
        "verdict": word,
        "passed": word == "PASS",
    }


def print_table(r: dict[str, Any]) -> None:
    print(f"requests {r['requests']}  outcomes {json.dumps(r['outcomes'])}")
    print(f"attacks  {', '.join(r['attacks_run'])}")
    for k, v in r["rss_max_mib"].items():
        g = r["rss_growth"][k]
        print(f"  {k:<16} max {v:8.1f} MiB  growth " + (f"{g * 100:6.1f}%" if g is not None else "not judged"))
    for name, what in r["findings"].items():
        print(f"BROKEN {name}: {what}")
    for k, v in r["criteria"].items():
        print(f"criterion {k}: {criterion(v)}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        "soak_attacks", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--minutes", type=float, default=30.0)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--fault-every-s", type=float, default=60.0)
    ap.add_argument("--attacks", default=",".join(ATTACKS), help=f"comma list, in turn: {','.join(ATTACKS)}")
    ap.add_argument("--attack-window-s", type=float, default=10.0, help="an error this long after an attack is its")
    ap.add_argument("--flood-frames", type=int, default=4_000_000)
    ap.add_argument("--stop-s", type=float, default=5.0, help="how long the stop attack holds the head (SIGSTOP)")
    ap.add_argument("--replay-after", type=int, default=66, help="updates between the capture and the replay")
    ap.add_argument("--step-delay-s", type=float, default=0.005, help="the null engine's pace (a token per step)")
    ap.add_argument("--lease-s", type=float, default=3.0)
    ap.add_argument("--hang-s", type=float, default=120.0)
    ap.add_argument("--request-timeout-s", type=float, default=20.0, help="the legitimate clients' timeout_s")
    ap.add_argument("--recover-s", type=float, default=60.0)
    ap.add_argument("--sample-every-s", type=float, default=5.0)
    ap.add_argument("--engines", type=int, default=2)
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "soak_attacks.json"))
    a = ap.parse_args(argv)
    bad = set(a.attacks.split(",")) - set(ATTACKS)
    if bad:
        ap.error(f"--attacks: unknown {sorted(bad)} (known: {', '.join(ATTACKS)})")

    launcher = NullLauncher(a.lease_s, a.engines, a.step_delay_s)
    seen: list[psutil.Process] = []

    def stop(*_: Any) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)
    try:
        front = launcher.wait_ready(180)
        seen = launcher.children()
        soak = AttackSoak(a, launcher, front)
        asyncio.run(soak.run())
        result = verdict(soak, a)
    finally:
        for pid in launcher.role_pids()["head"]:  # never leave a stopped head behind
            try:
                os.kill(pid, signal.SIGCONT)
            except OSError:
                pass
        terminate_tree(launcher.proc, grace_s=5, extra=[*seen, *launcher.children()])
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out, "w") as fh:
        json.dump(result, fh, indent=1, default=str)
    print_table(result)
    print(f"\nwrote {a.out}")
    return 0 if result["passed"] else 2 if result["verdict"] != "FAIL" else 1


if __name__ == "__main__":
    sys.exit(main())
