"""The head process: registry, health, routing, forwarding, control fan-out."""
