"""The offline simulator's one-tier replay loop, compiled with the tree (``setup.py``).

:func:`radixkv.sims.replay.replay` runs its per-request loop here when it replays one tier (every
point of a capacity sweep): the same calls of the tree's public methods, in the same order, as its
Python loop for several tiers makes with one, so the results are the same request by request (a test
replays both). Compiled, the calls into the tree are direct C calls, not Python-level ones: the
interpreted loop, the calls' argument parsing and the boxing of their numbers were ~10 % of a replay's
instructions. The tree and its policies know nothing of this module; it only drives them.
"""

from __future__ import annotations

from typing import Callable, Sequence

from radixkv.tree import RadixTree

__all__ = ["replay_one_tier"]

_PROGRESS_EVERY = 256  # requests between two progress calls


def replay_one_tier(
    tree: RadixTree,
    namespace: str,
    tier: str,
    keys_per_request: list[list[str]],
    input_tokens: list[int],
    block_tokens: int,
    bytes_per_token: int,
    full_bytes: int,
    capacity_blocks: int,
    hits: list[int],
    set_next_use: Callable[[Sequence[int], Sequence[int]], object] | None = None,
    next_use: list[list[int]] | None = None,
    check_every: int = 0,
    progress: Callable[[int], object] | None = None,
) -> tuple[int, int, int, int, int]:
    """Replay requests ``i`` (block keys ``keys_per_request[i]``, ``input_tokens[i]`` tokens) into
    ``tier`` of ``tree`` in order, with the semantics of :func:`radixkv.sims.replay.replay` for one
    tier: the hit is the insert's own match; a partial last block is inserted on its own with its
    real size (unless it is cached already); then the tier evicts down to ``capacity_blocks``
    (negative: never). Writes each request's hit blocks into ``hits[i]`` and returns ``(block_hits,
    token_hits, evictions, block_references, input_tokens)`` (the last two summed as it goes: a
    separate pass over the trace's lists cost ~2 ms of cache misses per replay).

    ``set_next_use``: an offline policy's oracle hook (OPT), called after each insert with the
    request's node ids and ``next_use[i]``. ``check_every`` > 0: ``tree.check_integrity()`` every
    that many requests. ``progress(n)``: called with the number of requests done every 256 requests.
    """
    bt = block_tokens
    block_hits = token_hits = evictions = block_refs = tokens_in = 0
    no_ids: tuple[int, ...] = ()
    for i in range(len(keys_per_request)):
        keys = keys_per_request[i]
        nk = len(keys)
        tokens = input_tokens[i]
        block_refs += nk
        tokens_in += tokens
        if nk:
            rem = tokens - (nk - 1) * bt
            partial = 0 < rem < bt
            if partial and nk > 1 and tree.lookup(namespace, keys[nk - 1]) is not None:
                # The partial last block is cached: a full hit when the chain is well formed (the
                # match says), and a hit block keeps the size it has.
                partial = tree.match(namespace, keys, False).hit_chunks < nk
            ids = no_ids
            if partial and nk > 1:
                # The partial last block enters with its real size, so policies can tell it apart.
                r = tree.insert(namespace, keys[: nk - 1], tier, bt, full_bytes)
                k = r.present_chunks
                if set_next_use is not None:
                    ids = r.node_ids
                r = tree.insert(namespace, keys[nk - 1 :], tier, rem, rem * bytes_per_token, keys[nk - 2])
                if k == nk - 1:
                    k += r.present_chunks
            elif partial:
                r = tree.insert(namespace, keys, tier, rem, rem * bytes_per_token)
                k = r.present_chunks
            else:
                r = tree.insert(namespace, keys, tier, bt, full_bytes)
                k = r.present_chunks
            if k:
                hits[i] = k
                block_hits += k
                kt = k * bt
                token_hits += kt if kt < tokens else tokens
            if set_next_use is not None:
                set_next_use(ids + r.node_ids, next_use[i])  # type: ignore[index]
            if capacity_blocks >= 0:
                over = tree.tier_chunks(tier) - capacity_blocks
                if over > 0:
                    evictions += len(tree.evict(tier, over).removed_node_ids)
            # (as the Python loop: only after a request with blocks)
            if check_every and i % check_every == 0:
                tree.check_integrity()
            if progress is not None and i % _PROGRESS_EVERY == 0:
                progress(i)
    return block_hits, token_hits, evictions, block_refs, tokens_in
