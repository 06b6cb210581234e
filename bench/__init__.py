"""rollout-bus benchmarks (not tests).

Each benchmark runs as ``python -m bench.<name>``, prints a table, and writes
``bench/results/<name>.json`` and ``bench/results/<name>.png``. Shared pieces:

- ``bench.harness`` (imported as ``H`` by every benchmark) re-exports the
  shared pieces: ``bench.stats`` (percentiles, medians and spread, paired
  ratios), ``bench.measure`` (load runs, interleaved repetitions, CPU use),
  ``bench.report`` (tables, JSON), ``bench.plots`` (PNG) and ``bench.procs``
  (process supervision through ``bus.proctree``: every tree started is ended
  on exit; loopback ports; deadlines; the ``run_main`` entry point).
- ``bench.http_peer``: a minimal OpenAI-compatible HTTP server that returns
  ``max_tokens`` tokens at once (the HTTP twin of the ``null`` backend).
- ``bench.peer_side``: the HTTP side of the comparisons: http_peer servers,
  ``vllm-router`` in front of them, and an aiohttp load driver.

The engines run the product's model-less ``null`` backend (``--backend
null``); the GPU benchmarks live in ``bench.gpu`` (bench/README.md).
"""
