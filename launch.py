"""One command that launches rollout-bus: a head and engine nodes (`python launch.py --help`).

The entry point only: the flags (launcher/config.py), the `keys` subcommand
(launcher/keys.py), the local launch under a supervisor (launcher/local.py,
launcher/supervisor.py), what it prints (launcher/output.py) and --ray
(launcher/ray.py) live in their own modules beside it.
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
import tempfile

import structlog

from bus.runtime import configure_logging, set_title
from launcher.config import parse_args, refusal
from launcher.keys import keys_main

log = structlog.get_logger("launch")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["keys"]:
        return keys_main(argv[1:])
    a = parse_args(argv)
    if (why := refusal(a)) is not None:  # before any process starts
        print(f"launch.py: error: {why}", file=sys.stderr)
        return 2
    # One level for every process: children read ROLLOUT_BUS_LOG_LEVEL (bus.runtime).
    a.log_level = a.log_level or os.environ.get("ROLLOUT_BUS_LOG_LEVEL", "WARNING").upper()
    os.environ["ROLLOUT_BUS_LOG_LEVEL"] = a.log_level
    configure_logging(a.log_level)
    set_title("rollout-bus launch")
    # The launch itself (the client, the supervisor, Ray) is imported once the
    # flags are accepted: a refused flag answers at once.
    from launcher.local import run_local  # lazy: a refused flag does not wait for the client's imports
    from launcher.ray import run_on_ray  # lazy: as above
    from launcher.supervisor import Supervisor, mark_run_dir, remove_stale_run_dirs  # lazy: as above

    if a.ray:
        return run_on_ray(a)
    sup = Supervisor(a.max_restarts, a.grace_s)
    signal.signal(signal.SIGINT, sup.request_stop)
    signal.signal(signal.SIGTERM, sup.request_stop)
    remove_stale_run_dirs()
    run_dir = tempfile.mkdtemp(prefix="rbus-")
    mark_run_dir(run_dir)
    try:
        return run_local(a, sup, run_dir)
    finally:
        sup.shutdown()
        shutil.rmtree(run_dir, ignore_errors=True)
        log.info("launch_stopped", leftover=len(sup.alive()))
        if sup.fatal:  # the one line that says why the launch ended
            print(f"launch.py: {sup.fatal}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main())
