"""The launcher: what `python launch.py` (the entry, at the root) runs, one concern per file.

- config.py: the command line: its flags, backend auto-selection, per-backend options, GPU masks.
- keys.py: `launch.py keys ...`: the CURVE key folder of a secured cluster (--curve).
- token.py: the cluster's join token as the launcher handles it (bus/auth.py makes and reads tokens).
- local.py: the local launch: head and engines as child processes, from argv to readiness and serving.
- supervisor.py: supervision of those children, and the run folders the launcher owns.
- output.py: what it prints once the cluster serves: the readiness table, the trainer's line, --demo.
- ray.py: `launch.py --ray`: head and engines as Ray actors (trainer_bridge/ray/cluster.py).

Hazard: `token.py` and `ray.py` share names with the stdlib `token` and the `ray` package. Every import
here is absolute (`import ray` is Ray, `launcher.ray` is this file); never put launcher/ itself on
sys.path or run a file of it as a script, or `import token` (tokenize, inspect) would find this one.
"""
