"""The offline eviction simulator (installed as radixkv.sims)."""
