"""The ``radixkv`` console command.

Subcommands are thin: each one lazily imports the module that does the work, so ``radixkv --help``
stays fast and never imports torch or an engine.

    radixkv sim ...     offline eviction simulator (radixkv.sims.cli)
    radixkv bench NAME  a benchmark script (same as ``python -m radixkv.bench NAME``)
    radixkv demo        insert a few token sequences into a tree and print it
"""

from __future__ import annotations

import argparse
import importlib
import sys

_SUBCOMMANDS = {
    "sim": ("radixkv.sims.cli", "offline eviction simulator: replay traces through the real tree and policies"),
    "bench": ("radixkv.bench.__main__", "run a benchmark script (radixkv bench NAME)"),
    "demo": ("radixkv.demo", "insert a few token sequences into a radix tree and print it"),
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(
        prog="radixkv", description="radixkv: a hierarchical, chunk-aligned KV-cache layer for LLM serving."
    )
    parser.add_argument("--version", action="store_true", help="print the version and the optional "
                        "builds in use (compiled tree, C helpers), and exit")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_, help_text) in _SUBCOMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    if not argv or argv[0] in {"-h", "--help"}:
        parser.print_help()
        return 0 if argv else 2
    if argv[0] == "--version":
        if argv[1:]:
            parser.error(f"--version takes no arguments (got {' '.join(argv[1:])})")
        from radixkv import __version__, native
        from radixkv.bench import build_line

        print(__version__)  # alone on the first line, for scripts
        # Both builds are optional (setup.py: no compiler, no mypyc, RADIXKV_COMPILE=0): say which runs.
        print(build_line())
        used = [name for name, on in native.available().items() if on]
        print(f"C helpers: {', '.join(used)}" if used else "C helpers: none (the Python paths run)")
        return 0
    name, rest = argv[0], argv[1:]
    if name not in _SUBCOMMANDS:
        parser.error(f"unknown command {name!r}; choose one of: {', '.join(_SUBCOMMANDS)}")
    module = importlib.import_module(_SUBCOMMANDS[name][0])
    from radixkv.errors import ConfigError, InputError

    try:
        return int(module.main(rest) or 0)
    except (ConfigError, InputError) as e:  # a bad argument: say so, like argparse, no traceback
        print(f"radixkv {name}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
