"""radixkv subpackage."""
