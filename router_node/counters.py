"""The head's counters: what `stats()` and /metrics report, one dict owned by
the head's loop (router_node/router.py); the forwarding core and the control
plane count into the same dict."""

from __future__ import annotations


def new_counters() -> dict[str, int]:
    """The head's counters (stats query, /metrics), all at zero."""
    return {
        "requests": 0,
        "errors": 0,
        "failovers": 0,
        "engine_dead": 0,
        "engine_unreachable": 0,  # engines the head's data connection could not hand a request (forwarding.py)
        "data_links_dropped": 0,  # the head's data connection to an engine dropped: its legs moved (data_links.py)
        "no_healthy_engine": 0,
        "spoofed_events": 0,  # heartbeats / acks whose connection is not the engine's own
        "poison_requests": 0,  # ended after cfg.max_engine_deaths engines died under them
        "limit_exceeded": 0,  # requests refused by a per-client cap
        "client_over_hwm": 0,  # clients whose requests were cancelled: they did not read (client_hwm)
        "register_refused_token": 0,  # Registers without the cluster's join token
        "register_refused": 0,  # Registers refused for another reason (vocab_size, identity, fields)
        "unauthorized": 0,  # client control ops without the token, frames of a revoked CURVE key
        "bad_messages": 0,  # events-socket messages refused (undecodable, not served there): logged at a bounded rate
        "request_errors": 0,  # frontend messages answered with an Error (bad request, refused, ...)
        "clients_revoked": 0,  # frontend peers cut because their CURVE key left the allow-list
        "leases_expired": 0,  # pauses / sleeps / updates released because their client vanished
        "head_stalls": 0,  # the head's own loop was away longer than a heartbeat interval
        "handshakes_refused": 0,  # peers refused at the handshake (ZAP: CURVE key or PLAIN role secret)
    }
