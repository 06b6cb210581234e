"""The head's view of the cluster's weights: which version is current, which
engines are below it (stale), and the weight-update transaction in flight —
the head is the coordinator of its two-phase commit. I/O-free (events in,
decisions out; router_node/control.py publishes them).

ONE update at a time (issue 22): a begin while another update holds the
cluster is refused with `UpdateInProgress` naming the holder (update id,
client, since when) — never "the newer begin aborts the older", which
livelocked two trainers. The holder's transaction ends only by

    its own commit or abort · its client's lease expiring (`abort_held_by`,
    called by the lease owner) · `weight_txn_timeout_s` since its begin.

`weight_txn_timeout_s` is the HEAD's bound and it bounds every phase (issue 34):
an update still undecided that long after its begin is aborted, finishing
(its prepare running) or not; a client's `timeout_s` can only shorten what
the head waits for an op of the update (`bounded`), never lengthen it, and
the commit round of a decided update waits at most `weight_txn_timeout_s`.

Transaction (one per update id, created when the head fans its begin out):

    begun ──every target voted (WeightsPrepared / ReceiveWeights ok)──► decision "commit"
      └──any target failed, silent or missing in the prepare, or an abort──► decision "abort"

Update ids are bound to the head (issue 34: nothing can be replayed): a head
with an incarnation takes a begin only under an id it minted,
"<incarnation>.<n>", with n above every n it has begun — `next_update_id` is
the next one, shown in health() (the client reads it before a begin). A
replayed or stale begin is refused however old it is (its n is not newer; a
previous head's incarnation is not this one's), with O(1) memory: no table of
ended ids decides it. Every later op names the id the begin opened, so a
replayed bucket or FinishWeightUpdate names an update that is not current.

Every op naming an update (prepare, a GPU part, commit, abort) must name the
CURRENT one; any other id is refused with `StaleUpdate` and changes nothing
(a vanished trainer's late abort cannot touch the next trainer's update).
Only a commit or abort for an id the head never saw, with no update current
(a head restarted mid-update), is relayed as is.

The decision is the head's and is recorded BEFORE the commit is published,
with the version the engines take; that version is monotonic: below the
cluster's is refused, and equal only to sync STALE engines (sync_stale). The
cluster version moves only when at least one engine acked the commit (an
engine that acks late, after the round, moves it then). An engine that misses
or fails the commit stays below the cluster version, so it is STALE
(router_node/registry.py: no traffic), never silently behind. A commit is
never published for an update that was aborted, so an engine can only ever
serve a version the head decided; a prepared engine that hears no decision
discards the update by itself (engine_node/weight_update.py, prepare_ttl_s).

The cluster weight version is the version of the last model update that
committed. Until the head has seen one (a fresh head, or a head restarted under
running engines) it adopts the HIGHEST version the engines that join within
`adopt_window_s` of the first join bring (issue 34: a behind engine that
re-registers first must not roll the cluster back), re-adopting upward when a
later one brings more — the lower ones are STALE then. While that window is
open over a version above 0 (a restarted head: the cluster had updates) no
engine is routed (`settling`), so no token of a lower version is served before
the higher engine is heard. After the window, an engine registering above the
cluster version is STALE (router_node/registry.py), never followed (a peer
with the token cannot drag a settled cluster along). A FinishWeightUpdate for an
update the head never saw begin (a head restarted mid-update) is relayed as is,
and the version follows its ok acks.

Ownership: the router loop thread.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from bus import protocol as P
from bus.errors import BadRequest, StaleUpdate, Unauthorized, UpdateInProgress
from bus.sender_secret import new_sender_secret, proves_sender_secret, what_was_wrong

_MAX_TRACKED_UPDATES = 64
DEFAULT_WEIGHT_TXN_TIMEOUT_S = 300.0
DEFAULT_ADOPT_WINDOW_S = 3.0

# Results that are a yes vote of phase one.
_VOTES = (P.WeightsPrepared, P.ReceiveWeightsResult)


@dataclasses.dataclass(eq=False)
class WeightTxn:
    update_id: str
    target: str  # "model" | "lora:NAME"
    targets: list[str]
    transport: str = "zmq"
    senders: int = 1
    prepared: set[str] = dataclasses.field(default_factory=set)
    decision: str | None = None  # None | "commit" | "abort"
    reason: str = ""
    version: int | None = None  # decided version (model updates)
    check_finite: bool = True  # its begin's: GPU sender ranks joining by id check their tensors
    holder: bytes = b""  # the client that began it (its frontend identity)
    began_at: float = 0.0  # monotonic
    began_wall: float = 0.0  # epoch seconds (for messages)
    finishing: bool = False  # the head is preparing / committing it (a FinishWeightUpdate is in)
    # Its senders' credential (bus/protocol_weights.py): in the opener's Begin
    # reply and the begin the engines get, never in a view, a log or an error.
    sender_secret: str = dataclasses.field(default="", repr=False)

    @property
    def holder_name(self) -> str:
        return client_name(self.holder)

    def view(self) -> P.WeightTxnView:
        return P.WeightTxnView(
            update_id=self.update_id,
            target=self.target,
            targets=list(self.targets),
            transport=self.transport,
            senders=self.senders,
            prepared=sorted(self.prepared),
            decision=self.decision,
            version=self.version,
            check_finite=self.check_finite,
            holder=self.holder_name,
            began_wall=self.began_wall,
        )


def check_holder(txn: WeightTxn, client: bytes, secret: str, what: str) -> None:
    """Prepare, finish and abort of `txn` belong to its senders: the client that
    began it, or one that proves the update's sender secret (a rank in another
    process; the opener after a reconnect). Another token holder can neither
    abort nor commit someone else's update."""
    if client != txn.holder or not client:
        check_sender_secret(txn, secret, what)


def check_sender_secret(txn: WeightTxn, secret: str, what: str) -> None:
    """A GPU part (ReceiveWeights) brings bytes out of band (cuda_ipc handles,
    an NCCL group to join): only a sender of `txn` may send one, proven by
    its secret. Refused (Unauthorized, field sender_secret): nothing changes,
    the update goes on. The message never echoes what was sent."""
    if not proves_sender_secret(secret, txn.sender_secret):  # fails closed on an unminted secret
        raise Unauthorized(
            f"{what} for weight update {txn.update_id!r}: "
            f"{what_was_wrong(secret)} sender secret (the update's opener gets it in its "
            "begin's reply: WeightUpdate.sender_secret, to pass to weight_sender(..., sender_secret=))",
            field="sender_secret",
        )


def client_name(ident: bytes) -> str:
    """A client's frontend identity, printable (zmq's are binary)."""
    try:
        text = ident.decode("ascii")
    except UnicodeDecodeError:
        return ident.hex()
    if not text:
        return "<unnamed>"
    return text if text.isprintable() else ident.hex()


class ClusterWeights:
    def __init__(
        self,
        *,
        txn_timeout_s: float = DEFAULT_WEIGHT_TXN_TIMEOUT_S,
        adopt_window_s: float = DEFAULT_ADOPT_WINDOW_S,
        incarnation: str = "",
    ) -> None:
        # The head's incarnation binds update ids ("" — the no-I/O tests of the
        # other rules — binds none; router_node/router.py always passes its own).
        self.incarnation = incarnation
        self.update_seq = 0  # the highest n of an id "<incarnation>.<n>" begun here
        self.version = 0
        self.source = "none"  # "none" | "registration" | "update"
        self.adopt_window_s = adopt_window_s
        self.first_join_at: float | None = None  # monotonic: the adoption window's start
        self.updates_committed = 0
        self.txn_timeout_s = txn_timeout_s
        self.current: WeightTxn | None = None  # the one update that holds the cluster
        self.txns: dict[str, WeightTxn] = {}  # begun updates (bounded, oldest dropped)
        self.ended: dict[str, str] = {}  # update id -> how it ended (bounded): its ops are stale
        # Versions decided by a commit round that no engine acked in time: an
        # engine that acks later (it was frozen) moves the cluster there then.
        self.unconfirmed: dict[int, str] = {}

    def on_register(self, weight_version: int, now: float = 0.0) -> bool:
        """An engine joined. A head that has committed nothing adopts the
        highest version engines bring within adopt_window_s of the first join
        (a restarted head learns where the cluster was, whichever engine comes
        back first); after that only the head's commits move it, so a later
        engine registering with more (weight_version=10**6) cannot drag the
        cluster along: the registry marks it STALE (ahead) instead. True when
        the version moved (the caller re-judges every engine)."""
        v = int(weight_version)
        if self.source == "none":
            self.version, self.source, self.first_join_at = v, "registration", now
            return True
        if self.source != "registration" or self.first_join_at is None or v <= self.version:
            return False
        if now - self.first_join_at > self.adopt_window_s:
            return False
        self.version = v  # re-adopted upward: the engines below are stale now, never served
        return True

    def settling(self, now: float) -> bool:
        """A restarted head still gathering the versions engines bring: route
        nothing yet (the version it has is above 0, and a higher one may come)."""
        if self.source != "registration" or self.first_join_at is None or self.version == 0:
            return False
        return now - self.first_join_at < self.adopt_window_s

    # ------------------------------------------------------------ fan-out hooks

    def on_control(
        self, op: P.Op, targets: list[str] | None = None, *, client: bytes = b"", now: float = 0.0, wall: float = 0.0
    ) -> None:
        """A control op the head fans out (before publishing it). Raises
        UpdateInProgress (a begin while another update holds the cluster) or
        StaleUpdate (an op naming an update that is not the current one)."""
        if isinstance(op, P.BeginWeightUpdate):
            self.begin(op, targets or [], client=client, now=now, wall=wall)
        elif isinstance(op, (P.ReceiveWeights, P.PrepareWeights)):
            txn = self.require(op, op.update_id)
            if txn is None:
                raise StaleUpdate(
                    f"{P.OP_NAMES[type(op)]} names weight update {op.update_id!r}, which never began here",
                    field="update_id",
                )
            if isinstance(op, P.ReceiveWeights):
                check_sender_secret(txn, op.sender_secret, f"receive_weights (sender {op.sender})")
            else:
                check_holder(txn, client, op.sender_secret, "prepare_weights")
        elif isinstance(op, P.AbortWeightUpdate):
            txn = self.require(op, op.update_id)
            if txn is not None:
                check_holder(txn, client, op.sender_secret, "abort_weights")
                if txn.decision == "commit":
                    raise StaleUpdate(
                        f"weight update {op.update_id!r} is committing: it cannot abort", field="update_id"
                    )
                self.decide_abort(txn, "aborted by the trainer")

    def begin(
        self, op: P.BeginWeightUpdate, targets: list[str], *, client: bytes, now: float, wall: float = 0.0
    ) -> WeightTxn:
        cur = self.current
        if cur is not None:
            raise UpdateInProgress(
                f"weight update {cur.update_id!r} of client {cur.holder_name} holds the cluster since "
                f"{_when(cur.began_wall)} ({now - cur.began_at:.1f}s ago, "
                f"{'committing' if cur.decision == 'commit' else 'finishing' if cur.finishing else 'open'}); "
                f"one update at a time: retry after it commits or aborts "
                f"(at the latest after weight_txn_timeout_s={self.txn_timeout_s})",
                field="update_id",
            )
        seq = self._fresh(op.update_id)
        if op.update_id in self.txns or op.update_id in self.ended:
            raise StaleUpdate(f"weight update {op.update_id!r} already began once", field="update_id")
        self.update_seq = max(self.update_seq, seq)
        txn = WeightTxn(
            op.update_id,
            op.target,
            list(targets),
            transport=op.transport,
            senders=op.senders,
            check_finite=op.check_finite,
            holder=client,
            began_at=now,
            began_wall=wall,
            sender_secret=new_sender_secret(),
        )
        self.txns[op.update_id] = self.current = txn
        while len(self.txns) > _MAX_TRACKED_UPDATES:
            self.txns.pop(next(iter(self.txns)))
        return txn

    @property
    def next_update_id(self) -> str:
        """The id the next begin may take ("" with no incarnation: any)."""
        return f"{self.incarnation}.{self.update_seq + 1}" if self.incarnation else ""

    def _fresh(self, update_id: str) -> int:
        """The n of `update_id` if this head minted it and it is newer than
        every update begun here; else StaleUpdate / BadRequest (field update_id)."""
        if not self.incarnation:
            return 0
        inc, _, n = update_id.rpartition(".")
        if inc != self.incarnation or not n.isdigit():
            raise StaleUpdate(
                f"weight update id {update_id!r} was not minted by this head (ids are '<incarnation>.<n>', this "
                f"head's incarnation is {self.incarnation!r}): a replay, or a begin meant for an earlier head; "
                f"take health()'s next_update_id ({self.next_update_id!r})",
                field="update_id",
            )
        if int(n) <= self.update_seq:
            raise StaleUpdate(
                f"weight update id {update_id!r} is not newer than the last update this head began "
                f"({self.incarnation}.{self.update_seq}): a replayed or stale begin is refused; "
                f"take health()'s next_update_id ({self.next_update_id!r})",
                field="update_id",
            )
        return int(n)

    def require(self, op: Any, update_id: str) -> WeightTxn | None:
        """The current update if `update_id` names it; None for another head's
        id (or any unseen id, with no incarnation) while no update is current
        (a head restarted mid-update: the caller may relay a commit / abort as
        is); else StaleUpdate."""
        cur = self.current
        if cur is not None and cur.update_id == update_id:
            return cur
        what = P.OP_NAMES.get(type(op), type(op).__name__)
        now_txt = f"the current one is {cur.update_id!r}" if cur is not None else "no update is current"
        if update_id in self.ended:
            raise StaleUpdate(
                f"{what} names weight update {update_id!r}, which ended ({self.ended[update_id]}); {now_txt}",
                field="update_id",
            )
        if cur is not None:
            raise StaleUpdate(
                f"{what} names weight update {update_id!r}, not the current one: {now_txt}", field="update_id"
            )
        if self.incarnation and update_id.rpartition(".")[0] == self.incarnation:
            # One of this head's ids, not current: it ended (however long ago: no
            # table needed) or never began. Only another head's is relayed.
            raise StaleUpdate(
                f"{what} names weight update {update_id!r}, which is not open on this head: {now_txt}",
                field="update_id",
            )
        return None

    def on_control_done(self, op: P.Op, results: Mapping[str, P.ResultBase]) -> bool:
        """Acks of a fanned-out op are in. True when the cluster version moved."""
        if isinstance(op, (P.BeginWeightUpdate, P.ReceiveWeights, P.PrepareWeights)):
            self.on_votes(op.update_id, results)
            return False
        if not isinstance(op, P.FinishWeightUpdate):
            return False
        # A finish the head did not coordinate (it never saw the begin).
        versions = [int(r.weight_version) for r in results.values() if isinstance(r, P.ConfigResult)]
        txn = self.txns.pop(op.update_id, None)
        if txn is not None:
            self._end(txn, "committed" if versions else "commit failed on every engine")
        if (txn is not None and txn.target != "model") or not versions:
            return False
        return self._moved_to(max(versions))

    def on_votes(self, update_id: str, results: Mapping[str, P.ResultBase]) -> None:
        txn = self.txns.get(update_id)
        if txn is None:
            return
        # A ReceiveWeights ack is a vote only for a one-sender update; with
        # several senders it acks one sender's PART (the prepare collects votes).
        votes = _VOTES if txn.senders == 1 else (P.WeightsPrepared,)
        txn.prepared.update(eid for eid, r in results.items() if isinstance(r, votes))

    # ------------------------------------------------------------ endings

    def expired(self, now: float) -> WeightTxn | None:
        """The current update, if it is undecided past weight_txn_timeout_s
        since its begin (the caller aborts it), finishing or not: a client's
        long timeout never holds the cluster longer (a decided commit's round
        is bounded by `bounded` instead)."""
        cur = self.current
        if cur is None or cur.decision is not None:
            return None
        if now - cur.began_at <= self.txn_timeout_s:
            return None
        return cur

    def bounded(self, txn: WeightTxn, timeout_s: float, now: float) -> float:
        """What the head waits for an op of `txn`: the client's timeout_s, cut
        to what is left of weight_txn_timeout_s (undecided) or to
        weight_txn_timeout_s itself (the commit round of a decided update)."""
        left = self.txn_timeout_s if txn.decision is not None else txn.began_at + self.txn_timeout_s - now
        return max(0.05, min(timeout_s, left))

    def held_by(self, client: bytes) -> WeightTxn | None:
        """The current update if `client` holds it and it can still abort."""
        cur = self.current
        if cur is None or cur.holder != client or cur.decision is not None:
            return None
        return cur

    # ------------------------------------------------------------ decisions

    def decide_abort(self, txn: WeightTxn, reason: str) -> None:
        if txn.decision is None:
            txn.decision, txn.reason = "abort", reason
            self._end(txn, f"aborted: {reason}")

    def check_version(self, txn: WeightTxn, version: int | None, target_versions: list[int]) -> None:
        """Versions are monotonic: a commit below the cluster's version is
        refused, and one AT it only when it syncs stale engines (every target
        below it: Client.sync_stale)."""
        if txn.target != "model" or version is None:
            return
        if version < self.version or (
            version == self.version and (not target_versions or max(target_versions) >= self.version)
        ):
            raise BadRequest(
                f"weight update {txn.update_id!r}: version {version} is not above the cluster weight version "
                f"{self.version} (versions are monotonic; only stale engines are synced at it)",
                field="version",
            )

    def decide_commit(self, txn: WeightTxn, version: int | None, engine_versions: list[int]) -> int | None:
        """Record the commit and the version it gives (model updates: the
        trainer's, else one above everything the cluster has served)."""
        assert txn.decision is None, txn.decision
        if txn.target == "model":
            if version is None:
                version = 1 + max([self.version, *engine_versions])
            txn.version = int(version)
        txn.decision = "commit"
        return txn.version

    def commit_done(self, txn: WeightTxn, committed: Mapping[str, int] | None = None, *, missing: bool = False) -> bool:
        """The commit round is over (acked or past its deadline). `committed`:
        {engine: version} of the engines that acked the commit. The decided
        version becomes the cluster's only if one did (None: assume so, for
        callers that do not know); an engine that missed it is stale then.
        With none committed but some `missing` (frozen), a late ack moves it
        (`late_commit`). True when the version moved."""
        self.txns.pop(txn.update_id, None)
        landed = committed is None or bool(committed)
        self._end(txn, "committed" if landed else "commit failed on every engine")
        if txn.target != "model" or txn.version is None:
            return False
        if not landed:
            if missing:
                self.unconfirmed[txn.version] = txn.update_id
                while len(self.unconfirmed) > _MAX_TRACKED_UPDATES:
                    self.unconfirmed.pop(next(iter(self.unconfirmed)))
            return False
        return self._moved_to(txn.version)

    def late_commit(self, weight_version: int) -> bool:
        """An engine acked a commit after its round: if no engine had, the
        decided version is the cluster's now. True when the version moved."""
        if self.unconfirmed.pop(weight_version, None) is None or weight_version <= self.version:
            return False
        return self._moved_to(weight_version)

    def _end(self, txn: WeightTxn, how: str) -> None:
        if self.current is txn:
            self.current = None
        self.ended[txn.update_id] = how
        while len(self.ended) > _MAX_TRACKED_UPDATES:
            self.ended.pop(next(iter(self.ended)))

    def _moved_to(self, version: int) -> bool:
        self.updates_committed += 1
        self.source = "update"
        moved = version != self.version
        self.version = version
        return moved

    # ------------------------------------------------------------ queries

    def is_stale(self, weight_version: int) -> bool:
        return weight_version < self.version

    def decisions(self) -> P.DecisionsView:
        """Every tracked update's decision (None: open; "commit": its commit round
        is still running; "abort"). A committed update leaves the table when its
        commit round is over: cuda_ipc senders free their buckets then."""
        return P.DecisionsView(decisions={uid: t.decision for uid, t in self.txns.items()})

    def open_updates(self) -> P.WeightUpdatesView:
        return P.WeightUpdatesView(updates={uid: t.view() for uid, t in self.txns.items() if t.decision is None})

    def current_view(self) -> P.WeightTxnView | None:
        """The update holding the cluster (one at a time), or None."""
        return self.current.view() if self.current is not None else None


def _when(wall: float) -> str:
    if not wall:
        return "an unknown time"
    import datetime

    return datetime.datetime.fromtimestamp(wall, datetime.timezone.utc).strftime("%H:%M:%S UTC")
