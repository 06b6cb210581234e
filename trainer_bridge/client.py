"""The trainer's client, by concept:

- `trainer_bridge/connection.py`: the head link (socket, pings, head loss and restarts);
- `trainer_bridge/streams.py`: per-request stream state and chunk assembly;
- `trainer_bridge/control_port.py`: queries and control ops;
- `trainer_bridge/async_client.py`: `AsyncClient` (generation, text, weights);
- `trainer_bridge/sync_client.py`: `Client`, generated from it (`trainer_bridge/blocking.py`).

This module keeps `from trainer_bridge.client import Client, AsyncClient` working.
"""

from trainer_bridge.async_client import AsyncClient
from trainer_bridge.sync_client import Client, SyncWeightSender, SyncWeightUpdate

__all__ = ["AsyncClient", "Client", "SyncWeightSender", "SyncWeightUpdate"]
