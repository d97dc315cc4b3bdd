"""Replay a trace through the real :class:`~radixkv.tree.RadixTree` and a real eviction policy.

Semantics (fixed, so results are comparable and checkable):

* requests are processed in trace order; the tree's logical clock is the only time the policies see;
* a request's hit is the leading run of its block keys present in the tree (any tier) before the
  request: the insert's own match (``InsertResult.present_chunks``, what ``tree.match(ns, keys,
  touch=False)`` would report; with several tiers that match is also run first, for per-tier hits);
* then all its blocks are inserted into the top tier or touched (``tree.insert``); a partial last
  block (``input_tokens`` not a multiple of ``block_tokens``) is inserted with its real token count and
  byte size, so policies can see that it is partial;
* then each tier is brought back within capacity, top tier first, one victim at a time in exact
  policy order (``tree.evict_candidates(tier, 1)``); a victim of a tier with a tier below it is
  demoted there (``set_resident`` on the lower tier, then ``clear_resident``; counted in
  ``demotions`` only if the lower tier did not hold it already), a victim of the last tier is
  dropped;
* with several tiers the replay follows the store's order of calls (docs/simulator.md, "Simulator
  and runtime"), so that under ``lru`` both hold the same blocks in the same tiers after every
  request: ``write_policy`` is the store's (``write_through``, its default: each new block is
  also written to every lower tier, each tier making room first; ``write_back``: a block reaches
  a lower tier only as a victim); a tier makes room before each block arrives (a demotion first
  makes room below, which may cascade, with the victim pinned meanwhile; a demotion the tier below
  has no room for fails as the store's does); the hit blocks the top tier lacks (which the insert
  promotes) are pinned while the top tier makes room for them, then the new blocks get room; and
  the lower tiers' copies of the hit path hear the touch a store's ``get`` gives them
  (``tree.touch(..., tiers=...)``, which leaves the top tier's clock as a single tier has it);
* capacity is counted in blocks (a byte capacity is converted at the full-block size);
* every tier runs the replay's policy unless its :class:`TierCapacity` names one (a lower tier only
  sees demotions and written-through blocks, so a frequency policy there counts each arrival as a
  first reference).

``offline`` policies (OPT) get the future through :meth:`OPTPolicy.set_next_use` after each insert.
The replay never re-implements the tree or a policy: it only drives the public API.
"""

from __future__ import annotations

import gc
import time
from dataclasses import dataclass, field
from itertools import repeat
from typing import Sequence

import numpy as np

from radixkv import tree as _tree_module
from radixkv.config import WRITE_POLICIES
from radixkv.errors import ConfigError
from radixkv.replay_loop import replay_one_tier
from radixkv.sims import opt as _opt  # registers the "opt" policy
from radixkv.sims.traces import Trace
from radixkv.tree import RadixTree

__all__ = ["TierCapacity", "ReplayResult", "replay", "UNBOUNDED"]

UNBOUNDED = -1  # capacity_blocks of a tier that never evicts (the infinite cache)
# One tier replays in radixkv.replay_loop (compiled with the tree, so it takes the tree's exact
# class: a stand-in, as a test's recording proxy, takes the Python loop below); tests set this False
# to replay one tier through the Python loop as well, and compare.
_COMPILED_ONE_TIER = True
_NS = "sim"
_PIN_S = 1e9  # a pin the replay takes and releases within one request: never expires meanwhile


@dataclass(slots=True)
class TierCapacity:
    """One simulated tier: a name, a capacity in blocks (:data:`UNBOUNDED` = never evicts), and
    optionally its own eviction policy (a registered name and its constructor options).

    ``policy=None`` (the default) means the replay's ``policy`` with its ``policy_options``, so a
    tier list without policies replays exactly as before per-tier policies existed."""

    name: str
    capacity_blocks: int
    policy: str | None = None
    policy_options: dict | None = None

    def __post_init__(self) -> None:
        if not self.name:
            raise ConfigError("a tier needs a non-empty name")
        if self.policy is not None and (not isinstance(self.policy, str) or not self.policy):
            raise ConfigError(f"tier {self.name!r}: policy={self.policy!r} must be a registered policy name or None")
        if self.policy is None and self.policy_options:
            raise ConfigError(f"tier {self.name!r}: policy_options={self.policy_options!r} need a policy; give "
                              "policy=NAME too (without one the tier uses the replay's policy and its options)")
        if not isinstance(self.capacity_blocks, int) or (
            self.capacity_blocks < 1 and self.capacity_blocks != UNBOUNDED
        ):
            raise ConfigError(
                f"tier {self.name!r}: capacity_blocks={self.capacity_blocks!r} must be >= 1 block "
                "(or UNBOUNDED); raise the capacity or the block size"
            )


@dataclass(slots=True)
class ReplayResult:
    """Counts of one replay. Per-request arrays (numpy) feed the TTFT model and the plots."""

    policy: str
    tiers: list[TierCapacity]
    requests: int
    block_references: int
    block_hits: int
    input_tokens: int
    token_hits: int
    hit_blocks: np.ndarray  # per request: leading hit blocks (any tier)
    tier_hit_blocks: np.ndarray  # [request, tier]: hit blocks served from each tier (fastest holder)
    evictions: int
    demotions: int  # victims copied one tier down (not those the lower tier already held)
    elapsed_s: float
    tree_stats: dict[str, int] = field(default_factory=dict)

    @property
    def block_hit_rate(self) -> float:
        return self.block_hits / self.block_references if self.block_references else 0.0

    @property
    def token_hit_rate(self) -> float:
        return self.token_hits / self.input_tokens if self.input_tokens else 0.0

    @property
    def accesses_per_s(self) -> float:
        return self.block_references / self.elapsed_s if self.elapsed_s > 0 else float("inf")


def replay(
    trace: Trace,
    policy: str,
    tiers: Sequence[TierCapacity],
    block_bytes: int | None = None,
    policy_options: dict | None = None,
    check_every: int = 0,
    progress: bool = False,
    next_use: list[list[int]] | None = None,
    write_policy: str = "write_through",
) -> ReplayResult:
    """Replay ``trace`` through a fresh tree; return the counts.

    Every tier uses ``policy`` (with ``policy_options``) unless its :class:`TierCapacity` names its
    own ``policy``. ``block_bytes``: bytes of a full block (default: one byte per token, so
    capacities are in blocks either way). ``check_every`` > 0 runs ``tree.check_integrity()`` every that many requests (tests).
    ``next_use``: the trace's :func:`~radixkv.sims.opt.next_use_table`, if the caller already has it
    (a sweep computes it once for all its OPT points); computed here otherwise. ``write_policy``: the
    store's (``write_through``, its default, or ``write_back``); it decides how blocks reach the
    lower tiers, so it matters only with several tiers.
    """
    if not tiers:
        raise ConfigError("replay needs at least one tier")
    if write_policy not in WRITE_POLICIES:
        raise ConfigError(f"write_policy={write_policy!r} must be one of {list(WRITE_POLICIES)}: the store's "
                          "write_policy the replay models (it matters only with several tiers)")
    names = [t.name for t in tiers]
    if any(t.policy is not None for t in tiers):
        # Per-tier mappings for both, so one tier's options never reach another tier's policy.
        tree = RadixTree(
            tiers=names,
            policy={t.name: t.policy or policy for t in tiers},
            policy_options={
                t.name: dict((t.policy_options if t.policy is not None else policy_options) or {}) for t in tiers
            },
        )
    else:
        tree = RadixTree(tiers=names, policy=policy, policy_options=policy_options)
    oracle = getattr(tree.policy(names[0]), "offline", False)
    if len(tiers) > 1 and any(getattr(tree.policy(n), "offline", False) for n in names):
        raise ConfigError("the opt policy models one tier; pass a single tier for --policy opt (and no tier "
                          "policy opt)")
    opt_policy = tree.policy(names[0]) if oracle else None
    if oracle and next_use is None:
        next_use = _opt.next_use_table(trace)
    if oracle and len(next_use) != len(trace.requests):  # type: ignore[arg-type]
        raise ConfigError(f"next_use has {len(next_use)} rows for {len(trace.requests)} requests; "  # type: ignore[arg-type]
                          "pass next_use_table(trace) of this trace")
    bt = trace.block_tokens
    bpt = (block_bytes // bt) if block_bytes else 1
    full_bytes = block_bytes if block_bytes else bt
    n_req = len(trace.requests)
    n_tiers = len(tiers)
    # Per-request hits go to a plain list (one list store per request, not a numpy scalar store; the
    # one-tier case fills its tier column from it after the loop).
    hits = [0] * n_req
    tier_hits = np.zeros((n_req, n_tiers), dtype=np.int32)
    top = names[0]
    caps = [t.capacity_blocks for t in tiers]
    bounded = [c != UNBOUNDED for c in caps]
    bounded0, cap0 = bounded[0], caps[0]
    match, insert, tier_chunks, lookup = tree.match, tree.insert, tree.tier_chunks, tree.lookup
    evict_candidates, clear_resident, set_resident = tree.evict_candidates, tree.clear_resident, tree.set_resident
    node_tier_mask, node_children_alive = tree.node_tier_mask, tree.node_children_alive
    lower_bits = [1 << (t + 1) for t in range(n_tiers)]  # residency bit of the tier below each tier
    tree_evict = tree.evict
    block_refs = block_hits = token_hits = input_tokens = evictions = demotions = 0
    through = write_policy == "write_through"
    touch, lower_names = tree.touch, names[1:]
    pin, unpin = tree.pin, tree.unpin
    last = n_tiers - 1

    def room(t: int, n: int) -> None:
        """Evict ``n`` chunks from tier ``t`` in exact policy order, as the store's room-making does:
        a victim the tier below lacks is copied there once that tier made room for it (each tier
        evicts before it is written, never after), a victim the tier below holds is released, a
        victim of the last tier is dropped."""
        nonlocal evictions, demotions
        name = names[t]
        if t == last:
            # One victim at a time through evict_candidates, as the store drops them (the tree's
            # own loop, tree.evict, puts a pinned candidate it skipped back in front of a parent
            # that an eviction made a leaf; evict_candidates puts it behind).
            for _ in range(n):
                victims = evict_candidates(name, 1, drop=True)
                if not victims:
                    break
                evictions += len(clear_resident(victims, name).removed_node_ids)
            return
        lower, bit, own = names[t + 1], lower_bits[t], 1 << t
        kept: list[int] = []  # victims whose demotion failed and that must stay (pinned meanwhile)
        progress = False  # a chunk left the tier since the chunks in `kept` were kept
        left = 0
        try:
            while left < n:
                victims = evict_candidates(name, 1)
                if not victims:
                    if kept and progress:
                        # As the store's room-making: what kept them may be gone (a child the
                        # cascade below dropped), so they are offered again.
                        unpin(kept, "keep")
                        kept, progress = [], False
                        continue
                    break  # only pinned or interior chunks left
                # A victim the lower tier already holds (a hit promoted from it keeps its copy there,
                # and with write_through every block written since it left) is released, not copied:
                # no demotion, as the store counts it ("release", not "demote").
                mask = node_tier_mask(victims[0])
                if not mask & bit:
                    if bounded[t + 1]:
                        over = tier_chunks(lower) + 1 - caps[t + 1]
                        if over > 0:
                            # The victim is pinned while the tiers below make room for it, as the
                            # store pins a chunk it demotes: the cascade cannot drop its copy in a
                            # tier further down (before, a victim memory held and Redis held too
                            # could lose its Redis copy to the room its own demotion to disk made).
                            pin(victims, "demote", _PIN_S)
                            room(t + 1, over)
                            unpin(victims, "demote")
                    if bounded[t + 1] and tier_chunks(lower) >= caps[t + 1]:
                        # The tier below could not make room (all it holds is pinned: hit blocks
                        # being promoted). The demotion fails, as the store's copy does: a victim
                        # no other tier holds that chunks hang from stays (the next candidate is
                        # tried), any other victim is dropped from this tier. Before, it was copied
                        # down anyway and the tier below held more than its capacity.
                        if mask == own and node_children_alive(victims[0]):
                            pin(victims, "keep", _PIN_S)
                            kept.extend(victims)
                            continue
                    else:
                        demotions += 1
                        set_resident(victims, lower)
                clear_resident(victims, name)
                evictions += 1
                left += 1
                progress = progress or bool(kept)
        finally:
            if kept:
                unpin(kept, "keep")
    set_next_use = (
        opt_policy.set_next_use if opt_policy is not None else None  # type: ignore[union-attr,attr-defined]
    )
    bar = _progress(n_req) if progress else None
    # The replay allocates no reference cycles; the cyclic collector would only rescan the trace's
    # ~10^5 containers over and over (16 ms pauses), so it is paused for the loop.
    gc_was_enabled = gc.isenabled()
    gc.disable()
    t0 = time.perf_counter()
    try:
        one_tier_loop = n_tiers == 1 and _COMPILED_ONE_TIER and type(tree) is _tree_module.RadixTree
        if one_tier_loop:
            reqs = trace.requests
            # Lists of str keys and ints, as the compiled loop is typed (a Trace built by hand may
            # hold tuples of keys, or numpy integers).
            keys_per_request = [k if type(k) is list else list(k) for k in (r.block_keys for r in reqs)]
            tokens = [int(r.input_tokens) for r in reqs]
            block_hits, token_hits, evictions, block_refs, input_tokens = replay_one_tier(
                tree, _NS, top, keys_per_request, tokens, bt, bpt, full_bytes, cap0 if bounded0 else -1,
                hits, set_next_use, next_use, check_every,
                None if bar is None else (lambda i: bar.update(min(256, n_req - bar.n))),
            )
        for i, req in enumerate(() if one_tier_loop else trace.requests):
            keys = req.block_keys
            nk = len(keys)
            block_refs += nk
            input_tokens += req.input_tokens
            if not nk:
                continue
            if n_tiers > 1:
                # Per-tier hits need the residency before the insert adds the top tier.
                m = match(_NS, keys, touch=False)
                for mask in m.tier_masks:
                    tier_hits[i, (mask & -mask).bit_length() - 1] += 1
                # Hit blocks the top tier lacks: the insert promotes them (the store's get does).
                promoted = [n for n, mask in zip(m.node_ids, m.tier_masks) if not mask & 1]
                before_top = tier_chunks(top)
                last_hit = m.last_node_id
                if last_hit is not None and m.tier_masks[-1] != 1:
                    # A store's get touches the path of its hit (match(touch=True)): the deepest hit
                    # block in every tier holding it, and where the top tier lacks that block, each
                    # faster tier's deepest block on the path. The insert below touches the top
                    # tier's copy of the path, and on a full hit also every tier holding the last
                    # block (as the get does); the lower tiers' remaining copies hear it here, so
                    # they rank the path as the store's tiers do (without this the disk evicted the
                    # hit's deepest block first, and write-through then wrote the new blocks beneath
                    # nothing there).
                    mask = m.tier_masks[-1]
                    if m.hit_chunks < nk:
                        touch((last_hit,), lower_names)
                    elif not mask & 1 and mask & -mask > 2:
                        touch((last_hit,), names[1:(mask & -mask).bit_length() - 1])
            rem = req.input_tokens - (nk - 1) * bt
            partial = 0 < rem < bt
            if partial and nk > 1 and lookup(_NS, keys[-1]) is not None:
                # The partial last block is cached: a full hit when the chain is well formed (the
                # match says), and a hit block keeps the size it has.
                partial = match(_NS, keys, touch=False).hit_chunks < nk
            # The hit is the insert's own match (present_chunks): one match per request, not two.
            # Node ids are looked up only for OPT, which needs them to hear the future.
            if partial and nk > 1:
                # The partial last block enters with its real size, so policies can tell it apart.
                r = insert(_NS, keys[:-1], top, bt, full_bytes)
                k = r.present_chunks
                ids = r.node_ids if set_next_use is not None else ()
                r = insert(_NS, keys[-1:], top, rem, rem * bpt, keys[-2])
                if k == nk - 1:
                    k += r.present_chunks
            else:
                ids = ()
                r = insert(_NS, keys, top, rem if partial else bt, rem * bpt if partial else full_bytes)
                k = r.present_chunks
            if k:
                hits[i] = k
                block_hits += k
                kt = k * bt
                token_hits += kt if kt < req.input_tokens else req.input_tokens  # min(), no call
            if set_next_use is not None:
                set_next_use(ids + r.node_ids, next_use[i])  # type: ignore[index]
            if n_tiers == 1:
                # The tier loop below for one tier (the sweep's case), without its loop and lookups.
                if bounded0:
                    over = tier_chunks(top) - cap0
                    if over > 0:
                        evictions += len(tree_evict(top, over).removed_node_ids)
            else:
                # The store's order: the top tier makes room for what the request added (victims
                # copied down after the tier below made room for each, so no tier ever holds more
                # than its capacity), first for the promoted hit blocks, which are pinned while
                # that room is made (the store's promotion holds them in every tier: room-making
                # below cannot drop their copies), then for the new blocks; then with
                # write_through each lower tier makes room for the new blocks and receives them.
                if bounded0:
                    if promoted:
                        over = before_top + len(promoted) - cap0
                        if over > 0:
                            pin(promoted, "promote", _PIN_S)
                            room(0, over)
                            unpin(promoted, "promote")
                    over = tier_chunks(top) - cap0
                    if over > 0:
                        room(0, over)
                if through and k < nk:
                    for t in range(1, n_tiers):
                        bit = 1 << t
                        todo = [key for key, n in zip(keys[k:], map(lookup, repeat(_NS), keys[k:]))
                                if n is not None and not node_tier_mask(n) & bit]
                        if bounded[t] and todo:
                            over = tier_chunks(names[t]) + len(todo) - caps[t]
                            if over > 0:
                                room(t, over)
                            # A write stores the leading run that fits, as a put does.
                            del todo[max(0, caps[t] - tier_chunks(names[t])):]
                        # Blocks the room-making dropped (only a request longer than a tier loses
                        # its own blocks) are not written.
                        written = [n for n in map(lookup, repeat(_NS), todo) if n is not None]
                        if written:
                            set_resident(written, names[t])
            if check_every and i % check_every == 0:
                tree.check_integrity()
            if bar is not None and i % 256 == 0:
                bar.update(min(256, n_req - bar.n))
    finally:
        if gc_was_enabled:
            gc.enable()
    hit_blocks = np.array(hits, dtype=np.int32)
    if n_tiers == 1:
        tier_hits[:, 0] = hit_blocks
    elapsed = time.perf_counter() - t0
    if bar is not None:
        bar.update(n_req - bar.n)
        bar.close()
    if check_every:
        tree.check_integrity()
    return ReplayResult(
        policy=policy,
        tiers=list(tiers),
        requests=n_req,
        block_references=block_refs,
        block_hits=block_hits,
        input_tokens=input_tokens,
        token_hits=token_hits,
        hit_blocks=hit_blocks,
        tier_hit_blocks=tier_hits,
        evictions=evictions,
        demotions=demotions,
        elapsed_s=elapsed,
        tree_stats={"orphan_drops": tree.stats.orphan_drops, "inserted_chunks": tree.stats.inserted_chunks},
    )


def _progress(total: int):  # pragma: no cover - cosmetic
    from tqdm import tqdm

    return tqdm(total=total, unit="req", leave=False, mininterval=0.5)
