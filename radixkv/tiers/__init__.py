"""Storage tiers: one protocol, batched and thread-safe."""
