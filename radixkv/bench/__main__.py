"""``python -m radixkv.bench NAME [options]``: run one benchmark script.

Each benchmark lives in ``radixkv/bench/NAME.py`` and exposes ``main(argv) -> int``. Every benchmark
runs its baseline in the same run and prints ratios, because shared machines are noisy.
"""

from __future__ import annotations

import importlib
import pkgutil
import sys

import radixkv.bench as _pkg


def available() -> list[str]:
    return sorted(m.name for m in pkgutil.iter_modules(_pkg.__path__) if not m.name.startswith("_"))


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    names = available()
    if not argv or argv[0] in {"-h", "--help"}:
        print("usage: python -m radixkv.bench NAME [options]\n\nbenchmarks: " + ", ".join(names))
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in names:
        print(f"unknown benchmark {name!r}; choose one of: {', '.join(names)}", file=sys.stderr)
        return 2
    module = importlib.import_module(f"radixkv.bench.{name}")
    from radixkv.errors import ConfigError, InputError

    try:
        return int(module.main(rest) or 0)
    except (ConfigError, InputError) as e:  # a bad argument (radixkv bench NAME says the same): no traceback
        print(f"python -m radixkv.bench {name}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
