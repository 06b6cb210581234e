"""Placement on a Ray cluster (the optional `ray` extra; `launch.py --ray` uses it).

- cluster.py: RayCluster, the head and N engine nodes as Ray actors (`from trainer_bridge.ray.cluster
  import RayCluster`).
- actors.py: inside the actors: each owns one node process (HeadActor, EngineActor).
- placement.py: bundles and resources per engine, and the GPU ids of tp bundles.
- keys.py: the CURVE key folder placed onto each Ray node.

Ray pickles the actor classes by their module path (trainer_bridge.ray.actors). Hazard: this package
shares its last name with Ray; every import is absolute (`import ray` is Ray). Nothing is imported
here, so `import trainer_bridge.ray.placement` works without Ray installed.
"""
