"""Engine-side receivers of the weight transports (see registry.RECEIVERS)."""
