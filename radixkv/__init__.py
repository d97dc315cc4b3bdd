"""radixkv: a hierarchical, chunk-aligned KV-cache layer for LLM serving.

Core modules (none of them imports an engine):

* :mod:`radixkv.keys`      chunk keys (SGLang-compatible SHA-256 chain) and namespaces
* :mod:`radixkv.tree`      the host radix tree of chunks and their tier residency
* :mod:`radixkv.policies`  eviction policies behind one protocol, chosen by name
* :mod:`radixkv.tiers`     storage tiers (CPU memory, local/shared disk, Redis)
* :mod:`radixkv.kernels`   Triton gather/scatter kernels with torch references
* :mod:`radixkv.sims`      the offline eviction simulator
* :mod:`radixkv.adapters`  SGLang and vLLM adapters (engine imports stay inside them)
"""

from __future__ import annotations

from radixkv import compiled as _compiled

_compiled.install()  # before anything imports the tree: compiled build, or its Python source

__version__ = "0.1.0"

from radixkv.errors import CapacityError, ConfigError, InputError, PinError, RadixKVError
from radixkv.keys import Namespace, chunk_keys, sglang_page_keys

__all__ = [
    "__version__",
    "Namespace",
    "chunk_keys",
    "sglang_page_keys",
    "RadixKVError",
    "InputError",
    "ConfigError",
    "PinError",
    "CapacityError",
]
