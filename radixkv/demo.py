"""``radixkv demo``: insert a few token sequences into a two-tier tree, print it, evict, print again."""

from __future__ import annotations

import argparse

from radixkv.keys import Namespace, sglang_page_keys
from radixkv.tree import RadixTree


def render(tree: RadixTree, namespace: str) -> str:
    """ASCII picture of one namespace: one line per chunk, indented by depth, with its tiers."""
    ids = [n for _, n in tree.items(namespace)]
    children: dict[int | None, list[int]] = {}
    for n in ids:
        children.setdefault(tree.node_parent(n), []).append(n)
    lines: list[str] = []

    def walk(parent: int | None, indent: str) -> None:
        kids = sorted(children.get(parent, []), key=tree.node_key)
        for i, n in enumerate(kids):
            last = i == len(kids) - 1
            tiers = "+".join(tree.node_tiers(n))
            lines.append(f"{indent}{'`-' if last else '|-'} {tree.node_key(n)[:12]}  [{tiers}]")
            walk(n, indent + ("   " if last else "|  "))

    walk(None, "")
    return "\n".join(lines) or "(empty)"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="radixkv demo", description=__doc__)
    ap.add_argument("--page-size", type=int, default=4)
    args = ap.parse_args(argv)
    page = args.page_size
    ns = Namespace(model="demo-model", dtype="bfloat16", layout="page_first", chunk_tokens=page).digest
    tree = RadixTree(("mem", "disk"), policy="lru")
    system = list(range(100, 100 + 2 * page))
    convs = {
        "alice": system + list(range(200, 200 + 2 * page)),
        "bob": system + list(range(300, 300 + 3 * page)),
        "carol": system + list(range(400, 400 + page)),
    }
    for name, tokens in convs.items():
        keys = sglang_page_keys(tokens, page)
        hit = tree.match(ns, keys).hit_chunks
        tree.insert(ns, keys, "mem", chunk_tokens=page, size_bytes=page * 1024)
        print(f"{name:>6}: {len(tokens)} tokens, {len(keys)} chunks, prefix hit {hit} chunks")
    print("\nafter inserts (every chunk in mem):")
    print(render(tree, ns))
    # Write the shared system prompt through to disk, then evict the two coldest chunks from mem.
    system_ids = tree.match(ns, sglang_page_keys(system, page), touch=False).node_ids
    tree.set_resident(system_ids, "disk")
    victims = tree.evict_candidates("mem", 2, drop=True)
    tree.clear_resident(victims, "mem")
    print(f"\nafter evicting {len(victims)} least recently used leaves from mem (system prompt also on disk):")
    print(render(tree, ns))
    tree.check_integrity()
    return 0
