"""Trainer-side senders of the weight transports (see registry.SENDERS)."""
