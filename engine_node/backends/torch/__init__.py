"""The `torch` backend: a reference engine on transformers + torch (CPU or one GPU; CI's default).

- backend.py: TorchBackend, the class `--backend torch` loads (engine_node/backend.py's BACKENDS); its
  docstring holds the worker thread, the model lock and the sleep levels the mixins follow.
- ops.py: long control ops on the backend's worker thread (TorchOps, the mixins' base), memory held.
- sleep.py: sleep, wake-up, prefix cache and LoRA.
- weights.py: weight updates over the zmq transport (begin -> stage_bucket -> commit).

Hazard: this package is `engine_node.backends.torch`, not PyTorch. Every import is absolute (`import
torch` is PyTorch in Python 3); never put engine_node/backends/ on sys.path or run a file here as a
script, or `import torch` anywhere in that process would find this package.
"""
