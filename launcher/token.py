"""The cluster's join token as the launcher handles it (bus/auth.py makes and reads tokens)."""

from __future__ import annotations

import argparse
import atexit
import os

import structlog

from bus.auth import KeyFileError, find_token, new_token, read_token, token_path_for, write_token

log = structlog.get_logger("launch")


class JoinToken:
    """The cluster's join token (bus/auth.py), kept apart from the supervisor.

    Head: a new random token in a 0600 file of the run folder (or --token-file),
    given to the head and the local engines as --token-file; once the head
    serves, a copy is published where clients on this host look for it
    (bus.auth.token_path_for(frontend)), so `Client(address)` finds it, and
    removed when the launcher exits. --join: the head's token, read from
    --token-file / $ROLLOUT_BUS_TOKEN_FILE / the published file."""

    def __init__(self, a: argparse.Namespace, run_dir: str) -> None:
        self.published: str | None = None
        self._front = ""
        self._token = ""
        try:
            if a.join:
                found = find_token(a.join, a.token_file)
                self.path = found[1] if found else None
                if found is None and not a.curve:
                    log.warning(
                        "join_without_token",
                        hint="no --token-file, no $ROLLOUT_BUS_TOKEN_FILE and no token published for "
                        f"{a.join} on this host: a head that requires its join token refuses these engines",
                    )
            elif a.token_file:
                self._token = read_token(a.token_file)
                self.path = a.token_file
            else:
                self._token = new_token()
                self.path = write_token(os.path.join(run_dir, "cluster.token"), self._token, "run folder")
        except KeyFileError as e:
            raise SystemExit(f"launch.py: {e}") from None

    def argv(self) -> list[str]:
        return ["--token-file", self.path] if self.path else []

    def publish(self, front: str) -> None:
        """Head: the copy clients on this host find by address (`note` says where)."""
        path = token_path_for(front)
        if not self._token or path is None:
            return
        try:
            self.published = write_token(path, self._token)
        except KeyFileError as e:  # a folder another user can write, a planted name: not published there
            log.warning(
                "token_not_published", path=path, field=e.field, error=e.message,
                hint="clients on this host need --token-file / $ROLLOUT_BUS_TOKEN_FILE (or a safe ROLLOUT_BUS_TOKEN_DIR)",
            )  # fmt: skip
            return
        self._front = front
        atexit.register(self.unpublish)

    def note(self) -> str | None:
        """The line that says where the published token is (None: none published).
        Printed after the engine table: the table and the address come first (issue 23)."""
        if not self.published:
            return None
        return (
            f"join token: {self.path} (published for {self._front} at {self.published}: clients on this host "
            f"find it; engines on other nodes: launch.py --join {self._front} --token-file <a copy>)"
        )

    def unpublish(self) -> None:
        path, self.published = self.published, None
        try:
            if path and read_token(path) == self._token:  # not a newer launcher's
                os.remove(path)
        except Exception as e:  # exiting anyway: a leftover copy is only a stale file
            log.warning("token_unpublish_failed", path=path, error=repr(e))
