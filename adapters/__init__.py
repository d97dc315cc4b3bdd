"""Engine adapters (installed as radixkv.adapters). Engine imports happen only inside the adapter modules."""
