"""GPU benchmarks (vLLM on the device machine; each has a CPU dry run, --cpu).

One module per benchmark, ``python -m bench.gpu.<name>``, writing
``gpu_<name>.json`` and ``.png``; ``bench.gpu.common`` is what they share
(command line, phases in child processes, budget, a launch.py cluster);
``run_on_device.sh`` runs them on the device machine (bench/README.md).
"""
