"""What the launcher prints once the cluster serves: the readiness table, the
line a trainer writes to connect, and the --demo session."""

from __future__ import annotations

import random
import time
from typing import Any


def client_line(front: str, curve_dir: str | None = None, client_key: str | None = None) -> str:
    """The exact line a trainer writes to reach this cluster (CURVE keys included)."""
    if not curve_dir:
        return f"trainer_bridge.Client({front!r})"
    key = f", client_key={client_key!r}" if client_key else ""  # default: the key folder's "default" client
    return f"trainer_bridge.Client({front!r}, curve_dir={curve_dir!r}{key})"


def print_table(
    engines: list[dict[str, Any]],
    front: str,
    backend: str,
    *,
    curve_dir: str | None = None,
    client_key: str | None = None,
) -> None:
    rows = [("engine", "address", "backend", "model", "state")]
    for e in sorted(engines, key=lambda e: e["engine_id"]):
        model = e["model"] if len(e["model"]) <= 48 else "…" + e["model"][-47:]
        rows.append((e["engine_id"], e["data_address"], e["backend"], model, e["state"]))
    widths = [max(len(str(r[i])) for r in rows) for i in range(5)]
    line = lambda r: "  ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=True))
    print(line(rows[0]), flush=False)
    print("  ".join("-" * w for w in widths))
    for r in rows[1:]:
        print(line(r))
    print(f"\ntrainer connects to: {front}   ({client_line(front, curve_dir, client_key)})", flush=True)


def run_demo(client: Any) -> None:
    rng = random.Random(0)
    vocab = min(e["vocab_size"] for e in client.engines())
    before = {e["engine_id"]: e["tokens_out"] for e in client.health()["engines"].values()}
    prompts = [[rng.randrange(4, vocab) for _ in range(rng.randint(4, 16))] for _ in range(32)]
    t0 = time.perf_counter()
    results = client.generate(prompts, {"max_tokens": 16, "temperature": 0.8, "seed": 1})
    dt = time.perf_counter() - t0
    ntok = sum(len(r.token_ids) for r in results)
    print(f"\ndemo: {len(prompts)} requests, {ntok} tokens in {dt:.2f}s = {ntok / dt:.0f} tokens/s")
    chunks = list(client.stream(prompts[0], {"max_tokens": 8, "temperature": 0}))
    print(f"demo: streamed {len(chunks)} chunks: {[c.token_ids[0] for c in chunks if c.token_ids]}")
    s = client.sample(prompts[1], 4, {"max_tokens": 8, "temperature": 1.0, "seed": 7})
    print(f"demo: sample(num_samples=4) stop reasons {[q.stop_reason for q in s.sequences]}")
    paused = client.pause("abort")
    client.resume()
    print(f"demo: pause(abort)/resume on {sorted(paused)}")
    time.sleep(1.2)  # one heartbeat brings the token counters
    after = {e["engine_id"]: e["tokens_out"] for e in client.health()["engines"].values()}
    spread = {k: after[k] - before.get(k, 0) for k in sorted(after)}
    print(f"demo: tokens per engine {spread}", flush=True)
