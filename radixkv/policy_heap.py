"""Priority-ordered eviction policies (lfu, cost, agedref) on an indexed heap.

Imported by :mod:`radixkv.policies`, which registers them; see its docstring for the protocol."""

from __future__ import annotations

import math
from typing import ClassVar, Final, Generator, Sequence

from librt.vecs import extend, vec
from mypy_extensions import i64

from radixkv.compiler_hints import mypyc_attr
from radixkv.errors import ConfigError
from radixkv.ghosts import GhostHistory
from radixkv.policy_base import TierPolicy, column_slots
from radixkv.prio_heap import PrioHeap


# ---------------------------------------------------------------------------------------------------
# Priority-ordered policies. Each keeps a static priority per node in an indexed heap (smallest
# first; ties deepest first), parks interior nodes until on_leaf, and folds a removed node's
# statistics into its parent, which is how lazy path touches reach ancestors.

# ``AgedRefPolicy._last`` of a node never touched directly (clock values are >= 0). Final: a C
# constant when compiled (a plain module global is a dict lookup at every use, and _prio is hot).
_NEVER: Final = -(1 << 60)

# A ghost entry's integer (GhostHistory's aux) packs the chunk's last touch (a clock value, below
# 2**40 requests) with a subclass's tag plus one above it (0: no tag; see AgedRefPolicy._tag): one
# history, and one index probe per eviction, serves both.
_WHEN_BITS: Final = 40
_WHEN: Final = (1 << 40) - 1

# The long-gap guard's step per observed gap (AgedRefPolicy, long_gap_share): slow, so that the
# count weight, and with it the priorities pushed into the heap, drifts rather than jumps.
_LONG_GAP_RATE: Final = 0.003

# Namespaces whose largest chunk agedref remembers (see AgedRefPolicy._note_ns_full).
_NS_FULL_MAX: Final = 4096

# math.log2 bound once (Final: a C static when compiled, not a lookup in the math module per call;
# mypyc has no native log2). Same function, same results.
_log2: Final = math.log2

# A node's state in ``_HeapPolicy._st``: not resident in the tier; resident interior node (ordered
# only once it becomes a leaf); ordered (in the heap, or taken out of it by a candidates() run that
# has not ended).
_OUT: Final = 0
_PARKED: Final = 1
_ORDERED: Final = 2


@mypyc_attr(allow_interpreted_subclasses=True)  # users may subclass a built-in policy
class _HeapPolicy(TierPolicy):
    """Base of the priority policies: subclasses define ``_prio(n)`` and the ``_admit`` / ``_touch`` /
    ``_fold`` / ``_forget`` hooks on their own per-node statistics."""

    name: ClassVar[str] = "_heap"
    live_candidates: ClassVar[bool] = True

    def __init__(self) -> None:
        super().__init__()
        # Per-node state lives in columns indexed by node id, like the tree's own: ``_st[n]`` is
        # _OUT, _PARKED or _ORDERED, and the ordered nodes are in ``_order`` keyed by (priority,
        # -depth, node), each with the priority it was last pushed with. Subclasses keep their
        # columns in step (_grow). (_resident, TierPolicy's: nodes whose _st is not _OUT.)
        self._order = PrioHeap()
        self._st: vec[i64] = vec[i64]()
        self._aside: list[int] = []  # yielded by a candidates() run and not evicted: back at its end

    def _grow(self, n_slots: int) -> None:
        """Extend the per-node columns to ``n_slots`` (at least the tree's column length, see
        :func:`~radixkv.policy_base.column_slots`; new slots are empty). Subclasses with columns of
        their own extend them too."""
        self._st = extend(self._st, vec[i64]([_OUT] * (n_slots - len(self._st))))
        self._order.grow(n_slots)

    # subclass hooks --------------------------------------------------------------------------
    def _prio(self, n: i64) -> float:
        raise NotImplementedError

    def _admit(self, node_ids: list[int], now: int) -> None:
        pass

    def _touch(self, n: i64, now: int) -> None:
        pass

    def _fold(self, child: i64, parent: i64) -> None:
        pass

    def _forget(self, n: i64, ordered: bool) -> None:
        """``n`` left the tier; ``ordered``: it was a leaf in the order (its last priority is
        ``self._order.prio_of(n)``), else an interior node."""

    # protocol ---------------------------------------------------------------------------------
    def _push(self, n: i64) -> None:
        self._st[n] = _ORDERED
        self._order.push(n, self._prio(n), self._cols.depth[n])

    def on_insert(self, node_ids: Sequence[int], now: int) -> None:
        if len(self._st) < len(self._cols.depth):
            self._grow(column_slots(len(self._st), len(self._cols.depth)))
        ids: list[int] = node_ids if isinstance(node_ids, list) else list(node_ids)  # see LRUPolicy.on_insert
        self._admit(ids, now)
        tchild, st = self._tchild, self._st
        for n in ids:
            s = st[n]
            if s == _OUT:
                self._resident += 1
            if tchild[n]:
                if s == _ORDERED:
                    self._order.remove(n)
                st[n] = _PARKED  # interior: ordered when it becomes a leaf
            else:
                self._push(n)

    def on_access(self, node_id: int, now: int) -> None:
        self._touch(node_id, now)
        self._push(node_id)

    def on_leaf(self, node_id: int) -> None:
        if self._st[node_id] != _OUT:
            self._push(node_id)

    def _drop(self, n: i64) -> None:
        # n leaves the tier (it is resident): out of the order, its statistics folded into its parent.
        st = self._st
        ordered = st[n] == _ORDERED
        st[n] = _OUT
        if ordered:
            self._order.remove(n)
        self._resident -= 1
        p = self._cols.parent[n]
        if p >= 0 and st[p] != _OUT:
            self._fold(n, p)
        self._forget(n, ordered)

    def on_remove(self, node_ids: Sequence[int]) -> None:
        st = self._st
        n_slots = len(st)
        for n in node_ids:
            if 0 <= n < n_slots and st[n] != _OUT:
                self._drop(n)

    def _evict(self, node_id: i64, leaf_parent: i64) -> None:
        """on_remove((node_id,)) then on_leaf(leaf_parent) (-1: none), in one call: RadixTree.evict
        calls it once per evicted chunk of the exact built-in classes. Not an on_evict hook: that
        would replace on_remove and on_leaf for a Python subclass too, which may override them."""
        if self._st[node_id] != _OUT:
            self._drop(node_id)
        if leaf_parent >= 0 and self._st[leaf_parent] != _OUT:
            self._push(leaf_parent)

    def on_graft(self, node_ids: Sequence[int]) -> None:
        """The nodes' depths grew: their run was grafted under a chain (``RadixTree._graft``, optional
        hook). Re-key their places in the order, whose tie-break is -depth; a priority is kept as
        pushed. The columns grow to the tree's: the new parent may be newer than this tier's last
        insert (on_remove folds into it)."""
        if len(self._st) < len(self._cols.depth):
            self._grow(column_slots(len(self._st), len(self._cols.depth)))
        st, depth, order = self._st, self._cols.depth, self._order
        for n in node_ids:
            if st[n] == _ORDERED:  # a parked node is pushed with its depth when it becomes a leaf
                order.push(n, order.prio_of(n), depth[n])

    def candidates(self) -> Generator[int, None, None]:
        # Always take the current smallest node, so the tree may evict what we yield (and on_leaf
        # may order a parent) between steps. The node is taken out before it is yielded: a yielded
        # node the tree did not evict (still ordered and out of the heap: pinned, or the caller
        # stopped before evicting it) is set aside and put back when iteration ends. RadixTree.evict
        # runs these same steps (_take, _end) itself, without a generator.
        n = -1
        try:
            while True:
                n = self._take(n)
                if n < 0:
                    break
                yield n
        finally:
            self._end(n)  # also when closed at the yield: n is set aside unless it was evicted

    def _take(self, prev: i64) -> i64:
        """One step of :meth:`candidates`: set ``prev`` (the node it yielded last, -1: none) aside if
        it is still ordered and out of the heap, then take the smallest ordered tier leaf out of the
        heap and return it (-1: none left). Nodes passed over (they gained a child in the tier since
        they were ordered) are parked."""
        st, order, tchild = self._st, self._order, self._cols.tchild[self._t]
        if prev >= 0 and st[prev] == _ORDERED and not order.contains(prev):
            self._aside.append(prev)
        while True:
            n = order.pop()
            if n < 0:
                return -1
            if not tchild[n]:
                return n
            st[n] = _PARKED  # interior in the tier: ordered when it becomes a leaf

    def _end(self, last: i64) -> None:
        """End a :meth:`candidates` run whose last yielded node is ``last`` (-1: none): put it and
        every node set aside back in the heap, with their priorities, if they are still ordered."""
        st, order, aside = self._st, self._order, self._aside
        if last >= 0 and st[last] == _ORDERED:
            order.restore(last)  # no-op if pushed again meanwhile
        while aside:
            n = aside.pop()
            if st[n] == _ORDERED:
                order.restore(n)

    def check_integrity(self) -> None:
        st, order = self._st, self._order
        order.check_integrity()
        assert not self._aside, f"{self.name}: {len(self._aside)} candidates left aside"
        assert order.capacity == len(st), (
            f"{self.name}: {len(st)} slots and a heap of {order.capacity}"
        )
        in_heap = set(order.nodes())
        ordered = {n for n in range(len(st)) if st[n] == _ORDERED}
        assert in_heap == ordered, (
            f"{self.name}: ordered nodes missing from the heap {sorted(ordered - in_heap)[:5]}, "
            f"nodes in the heap not ordered {sorted(in_heap - ordered)[:5]}"
        )
        assert all(0 <= st[n] <= _ORDERED for n in range(len(st))), f"{self.name}: a node state out of range"
        resident = sum(1 for n in range(len(st)) if st[n] != _OUT)
        assert resident == self._resident, f"{self.name}: {resident} resident slots, counted {self._resident}"
        depth = self._cols.depth
        stale = [n for n in ordered if order.depth_of(n) != depth[n]]
        assert not stale, f"{self.name}: {len(stale)} nodes ordered with an old depth, e.g. {stale[:5]}"
        # The slots held are exactly the tier's nodes (a count alone misses a dead node's slot kept
        # in place of a live one's), and a parked node has a child in the tier: on_leaf orders it
        # when the last one leaves, so a parked leaf would never be a candidate again.
        mask, bit, tchild = self._cols.mask, self._bit, self._tchild
        held = {n for n in range(len(st)) if st[n] != _OUT}
        tier = {n for n, m in enumerate(mask) if m & bit}
        assert held == tier, (
            f"{self.name}: slots of nodes not in the tier {sorted(held - tier)[:5]}, tier nodes without "
            f"a slot {sorted(tier - held)[:5]}"
        )
        lost = [n for n in range(len(st)) if st[n] == _PARKED and not tchild[n]]
        assert not lost, f"{self.name}: {len(lost)} tier leaves parked (never candidates), e.g. {lost[:5]}"


@mypyc_attr(allow_interpreted_subclasses=True)  # users may subclass a built-in policy
class LFUPolicy(_HeapPolicy):
    """Least frequently used leaf first, with dynamic aging (LFU-DA): priority = L + count, where L is
    the priority of the last evicted chunk, so counts earned long ago lose their weight. A chunk's
    count includes every access below it (folded in as its children leave)."""

    name: ClassVar[str] = "lfu"

    def __init__(self) -> None:
        super().__init__()
        self._count: vec[i64] = vec[i64]()  # by node id; meaningful while the node is resident
        self._age = 0.0

    def _grow(self, n_slots: int) -> None:
        self._count = extend(self._count, vec[i64]([0] * (n_slots - len(self._count))))
        super()._grow(n_slots)

    def _prio(self, n: i64) -> float:
        return self._age + float(self._count[n])

    def _admit(self, node_ids: list[int], now: int) -> None:
        count, st = self._count, self._st
        for n in node_ids:
            if st[n] == _OUT:  # new to the tier (a resident node keeps its count)
                count[n] = 0

    def _touch(self, n: i64, now: int) -> None:
        self._count[n] += 1

    def _fold(self, child: i64, parent: i64) -> None:
        self._count[parent] += self._count[child]

    def _forget(self, n: i64, ordered: bool) -> None:
        if ordered:
            p = self._order.prio_of(n)
            if p > self._age:
                self._age = p


@mypyc_attr(allow_interpreted_subclasses=True)  # users may subclass a built-in policy
class CostPolicy(LFUPolicy):
    """Cost-aware (GreedyDual-Size-Frequency): priority = L + count * recompute_cost / size_bytes.

    Recomputing a chunk costs its tokens times (1 + prefix_tokens / attention_tokens): the linear
    layers cost the same per token, attention grows with the prefix in front of the chunk, so deep
    chunks of long prompts are dearer to lose. ``attention_tokens`` is the context length at which
    attention costs as much as the rest of the layer (~8k for 7-70B models). L (the priority of the
    last eviction) ages old value away, as in LFU-DA."""

    name: ClassVar[str] = "cost"

    def __init__(self, attention_tokens: int = 8192) -> None:
        super().__init__()
        if not isinstance(attention_tokens, int) or attention_tokens <= 0:
            raise ConfigError(f"cost policy: attention_tokens={attention_tokens!r} must be a positive int")
        self._attn = float(attention_tokens)
        # by node id: recompute cost per byte (static while resident); grows by assignment in _grow
        self._unit: vec[float] = vec[float]()

    def _grow(self, n_slots: int) -> None:
        self._unit = extend(self._unit, vec[float]([0.0] * (n_slots - len(self._unit))))
        super()._grow(n_slots)

    def _prio(self, n: i64) -> float:
        return self._age + float(self._count[n]) * self._unit[n]

    def _unit_cost(self, n: int) -> float:
        # Recompute cost per byte: static for a node while its depth is (its tokens and size never change).
        t = int(self._cols.tokens[n])
        return t * (1.0 + (int(self._cols.depth[n]) - 1) * t / self._attn) / max(int(self._cols.size[n]), 1)

    def _admit(self, node_ids: list[int], now: int) -> None:
        super()._admit(node_ids, now)
        unit = self._unit
        for n in node_ids:
            unit[n] = self._unit_cost(n)

    def on_graft(self, node_ids: Sequence[int]) -> None:
        # A deeper chunk costs more to recompute: its unit cost follows its new depth, and an ordered
        # node's priority moves by the count times the change (the value a push now would have,
        # with the age of its own push).
        if len(self._st) < len(self._cols.depth):
            # as in _HeapPolicy.on_graft
            self._grow(column_slots(len(self._st), len(self._cols.depth)))
        st, unit, count, order, depth = self._st, self._unit, self._count, self._order, self._cols.depth
        for n in node_ids:
            if st[n] == _OUT:
                continue
            old = unit[n]
            new = unit[n] = self._unit_cost(n)
            if st[n] == _ORDERED:
                order.push(n, order.prio_of(n) + float(count[n]) * (new - old), depth[n])

    def check_integrity(self) -> None:
        super().check_integrity()
        st, unit = self._st, self._unit
        wrong = [n for n in range(len(st)) if st[n] != _OUT and unit[n] != self._unit_cost(n)]
        assert not wrong, f"cost: {len(wrong)} unit costs not of the chunk's depth, e.g. {wrong[:5]}"
        assert len(self._unit) == len(self._count) == len(self._st), (
            f"cost: {len(self._unit)} unit costs, {len(self._count)} counts, {len(self._st)} slots"
        )


@mypyc_attr(allow_interpreted_subclasses=True)  # users may subclass a built-in policy
class AgedRefPolicy(_HeapPolicy):
    """Aged reference count with a ghost history: radixkv's own policy (see docs/policy-research.md).

    Signal: a chunk's references, each weighing 2^(-age / half_life), summed (an exponentially aged
    reference count, LRFU's CRF). Ordering by it keeps chunks that many requests share (system
    prompts, documents, a conversation's older turns) over the one-hit chunks that flood a small
    cache, while the decay lets stale popularity go. The priority, in time units, is
    ``H * log2(sum 2^(t_i / H))`` (about ``last use + H * log2(references)``): static between touches,
    so a heap orders it exactly; a parent's sum includes its children's, so eviction stays leaf-first.

    * ``H`` adapts to the workload: it tracks the ``gap_quantile`` (default: 60th percentile) of the
      reuse gaps the policy sees (a request's deepest hit chunk, a chunk coming back from the ghost
      history), so references are remembered for about one typical reuse gap, on any time scale. It
      moves by a relative ``gap_step`` (default 1 %) per observed gap: smaller steps track slower but
      keep the priorities in the heap (each computed with the ``H`` of its time) comparable;
    * the count's bonus is scaled by ``count_weight`` (default 0.5): the priority is
      ``last use + count_weight * (score - last use)``, about ``last use + count_weight * H *
      log2(references)``, so a long memory of references does not also make stale chunks outstay;
    * ghost history: aged counts of recently evicted chunks are remembered by key (bounded to
      ``ghost_factor`` x resident chunks) and restored when the chunk comes back, so a chunk that
      keeps returning is recognized even when the cache is too small to hold it between uses;
    * partial chunks (fewer tokens than a full chunk: a prompt's ragged end) go first: a longer prompt
      extending the same text yields a different chunk, so they are almost never reused;
    * ``long_gap_share`` > 0 (default 0: off; oddsref's default 0.05) scales the count's bonus down
      where LRU would already catch the reuses: the bonus is multiplied by ``min(1, share /
      long_gap_share)``, where ``share`` is a running share (a step of 0.003 per observation) of the
      observed reuse gaps longer than the tier's turnover (resident chunks / chunks inserted per
      insert: how long LRU keeps a chunk nobody touches), counted once the tier has evicted.

    Time is counted in path touches (one per request).
    """

    name: ClassVar[str] = "agedref"

    # How far below its own priority a partial chunk is ordered. A class variable (ClassVar: the
    # compiled build reads it from the class, as Python does), so a Python subclass may override it;
    # as a plain class attribute the compiled build made it an instance slot holding 1e15, which
    # ignored a subclass's value. Read once per instance, into _partial_penalty (_prio is hot).
    _PARTIAL_PENALTY: ClassVar[float] = 1e15

    def __init__(self, gap_quantile: float = 0.6, ghost_factor: float = 32.0,
                 initial_half_life: float = 100.0, count_weight: float = 0.5, gap_step: float = 0.01,
                 long_gap_share: float = 0.0) -> None:
        super().__init__()
        if not 0.0 < gap_quantile < 1.0:
            raise ConfigError(f"{self.name}: gap_quantile={gap_quantile!r} must be in (0, 1)")
        if not 0.0 < gap_step < 0.5:
            raise ConfigError(f"{self.name}: gap_step={gap_step!r} must be in (0, 0.5) (a relative step of H)")
        if not 0.0 < count_weight <= 1.0:
            raise ConfigError(f"{self.name}: count_weight={count_weight!r} must be in (0, 1]")
        if not ghost_factor >= 0:
            raise ConfigError(f"{self.name}: ghost_factor={ghost_factor!r} must be >= 0")
        if not initial_half_life >= 1.0:
            # 1 is H's own floor; a tiny H (1e-310) made every priority NaN (inf - inf)
            raise ConfigError(f"{self.name}: initial_half_life={initial_half_life!r} must be >= 1 request")
        if not 0.0 <= long_gap_share <= 1.0:
            raise ConfigError(f"{self.name}: long_gap_share={long_gap_share!r} must be in [0, 1] (0: off)")
        self._up = 1.0 + gap_step * gap_quantile  # H's step per gap above it, and below it
        self._down = 1.0 - gap_step * (1.0 - gap_quantile)
        self._w0 = float(count_weight)
        # The count weight in use: count_weight, scaled down by the long-gap guard (long_gap_share).
        self._w = self._w0
        self._long_gap_share = float(long_gap_share)
        self._long_share = 1.0  # running share of observed gaps longer than the turnover
        self._inserted = 1.0  # running mean of chunks per insert (_admit)
        self._evicted = False  # the tier has let a chunk go: the turnover means something
        self._h = float(initial_half_life)
        self._ghost_factor = float(ghost_factor)
        self._partial_penalty = float(self._PARTIAL_PENALTY)
        # By node id, meaningful while the node is resident:
        # H * log2(aged reference count) + time, in requests; grows by assignment in _grow
        self._score: vec[float] = vec[float]()
        self._last: vec[i64] = vec[i64]()  # clock of the node's last direct touch (_NEVER: none)
        # score a node came back with from the ghost history (NaN: it did not); grows in _grow
        self._restored: vec[float] = vec[float]()
        # the ghost history's hash of the node's name, from its lookup at admission, for its entry
        # at eviction (-1: not looked up; put hashes it); grows in _grow
        self._name_hash: vec[i64] = vec[i64]()
        self._ghost = GhostHistory()  # evicted chunks: score, last touch and tag (aux, see _WHEN)
        # Machine integers: compared with the tree's columns on every touch and eviction. The largest
        # chunk of the tier, and of each namespace (chunk sizes are per namespace: a chunk is partial
        # only below its own namespace's, see _partial).
        self._full_tokens: i64 = 0
        self._ns_full: dict[str, int] = {}
        # _ns_full's entry of the namespace asked last (one identity test per chunk in a tier of one
        # namespace, the simulator's, instead of a dict lookup)
        self._space: str | None = None
        self._space_full: i64 = 0
        self._clock: i64 = 0

    def _grow(self, n_slots: int) -> None:
        self._score = extend(self._score, vec[float]([-math.inf] * (n_slots - len(self._score))))
        self._last = extend(self._last, vec[i64]([_NEVER] * (n_slots - len(self._last))))
        self._restored = extend(self._restored, vec[float]([math.nan] * (n_slots - len(self._restored))))
        self._name_hash = extend(self._name_hash, vec[i64]([-1] * (n_slots - len(self._name_hash))))
        super()._grow(n_slots)

    @property
    def half_life(self) -> float:
        """The current adaptive half-life H, in requests."""
        return self._h

    @property
    def bonus_weight(self) -> float:
        """The count weight in use: ``count_weight``, scaled down by the long-gap guard where few
        observed reuse gaps outlast the tier's turnover (``long_gap_share``; 0: off, never scaled)."""
        return self._w

    def _observe_gap(self, gap: int) -> None:
        # Streaming quantile: H settles where P(gap > H) = 1 - q.
        if gap > self._h:
            self._h *= self._up
        else:
            self._h = max(1.0, self._h * self._down)
        if self._long_gap_share > 0.0 and self._evicted:
            # The long-gap guard. The bonus only pays for reuses LRU would miss, those after more
            # than the turnover; where nearly every gap is shorter (an agent workload at 25 %), it
            # evicts fresh chunks that return within a few requests for stale ones that don't.
            # It also breaks a loop: the fresh chunks a long bonus evicts come back from the ghost
            # history, and their gaps (one per chunk) push H, hence the bonus, up
            # (docs/policy-research.md).
            turnover = float(self._resident) / self._inserted
            x = 1.0 if float(gap) > turnover else 0.0
            self._long_share += _LONG_GAP_RATE * (x - self._long_share)
            self._w = self._w0 * min(1.0, self._long_share / self._long_gap_share)

    def _add(self, a: float, b: float) -> float:
        h = self._h
        return h * _log2_add(a / h, b / h)

    def _prio(self, n: i64) -> float:
        s = self._score[n]
        t = self._last[n]
        if t != _NEVER and s > -math.inf:  # compared as integers: native when compiled
            last = float(t)
            # last use + count_weight * H * log2(aged references): the count's bonus is scaled down
            # without shortening the memory H of the count itself.
            s = last + self._w * (s - last)
        t = self._cols.tokens[n]
        return s - self._partial_penalty if t < self._full_tokens and self._short(n, t) else s

    # A chunk is *partial* (a prompt's ragged end: the simulator's partial last block) when it holds
    # fewer tokens than the largest chunk of its own namespace. A tier shared by namespaces of
    # different chunk sizes (a store's pools, engine groups) would otherwise take every chunk of the
    # smaller size for one. Callers test `tokens < self._full_tokens` first (a chunk of the tier's
    # largest size is never partial: every full chunk of a one-namespace tier, the simulator's),
    # inline, so that case costs what it did before namespaces counted; then `_short`.
    def _short(self, n: i64, t: i64) -> bool:
        """Whether ``n`` (``t`` tokens, below the tier's largest chunk) is partial in its namespace."""
        space = self._ns[n]
        if space is None:
            return True  # (not reached: policies hear of a node before the tree forgets its name)
        if space is not self._space:
            self._space = space
            self._space_full = self._ns_full.get(space, 0)
        return t < self._space_full

    def _note_ns_full(self, space: str, t: i64) -> None:
        ns_full = self._ns_full
        if space not in ns_full and len(ns_full) >= _NS_FULL_MAX:
            # Bounded: a namespace per tenant salt or LoRA adapter must not grow it for good. The
            # oldest entry goes; its namespace relearns its size from its next chunks (until then
            # none of its chunks counts as partial: an order heuristic, never wrong bytes).
            del ns_full[next(iter(ns_full))]
        ns_full[space] = t
        self._space, self._space_full = space, t

    def _partial(self, n: i64) -> bool:
        """Whether ``n`` is partial (see :meth:`_short`); for the cooler paths."""
        t = self._cols.tokens[n]
        return t < self._full_tokens and self._short(n, t)

    def _admit(self, node_ids: list[int], now: int) -> None:
        score, ghost, keys, ns, tokens = self._score, self._ghost, self._keys, self._ns, self._cols.tokens
        if not node_ids:
            return
        p = self._parent[node_ids[0]]
        if p >= 0 and self._last[p] != _NEVER:
            self._observe_gap(self._clock + 1 - self._last[p])  # the request's deepest hit chunk
        name_hash = self._name_hash
        for n in node_ids:
            t = tokens[n]
            if t > self._full_tokens:
                self._full_tokens = t
            space = ns[n]
            if space is not None:
                if space is not self._space:
                    self._space = space
                    self._space_full = self._ns_full.get(space, 0)
                if t > self._space_full:
                    self._note_ns_full(space, t)
            taken = False
            h: i64 = -1  # an empty history is not asked: _forget's put hashes the name then
            if len(ghost):
                taken = ghost.take(ns[n], keys[n])
                h = ghost.last_hash
            name_hash[n] = h
            if not taken:
                score[n] = -math.inf
            else:
                score[n] = self._restored[n] = ghost.last_score
                aux = ghost.last_aux
                self._observe_gap(self._clock + 1 - (aux & _WHEN))
                if aux > _WHEN:
                    self._untag(n, (aux >> _WHEN_BITS) - 1)
        self._inserted += 0.01 * (float(len(node_ids)) - self._inserted)

    def _touch(self, n: i64, now: int) -> None:
        t = self._cols.tokens[n]
        if t >= self._full_tokens or not self._short(n, t):
            self._clock += 1  # a partial tail touched right after its full prefix: same request
        self._last[n] = self._clock
        self._score[n] = self._add(self._score[n], float(self._clock))

    def _fold(self, child: i64, parent: i64) -> None:
        t = self._cols.tokens[child]
        if t < self._full_tokens and self._short(child, t):
            return  # a partial tail's touch repeats its parent's (same request)
        s = self._score[child]
        base = self._restored[child]
        if not math.isnan(base):
            # The restored part was folded into the parent when the child left before: add only
            # the references since it came back.
            if s <= base:
                return
            h = self._h
            rest = 1.0 - math.pow(2.0, (base - s) / h)  # as 2.0 ** x (libm pow), but native compiled
            if rest <= 0.0:  # s is base re-rounded (an ulp above it): nothing was added since
                return
            s = s + h * _log2(rest)
        self._score[parent] = self._add(self._score[parent], s)
        lc = self._last[child]
        if lc > self._last[parent]:  # _NEVER is below every clock value
            self._last[parent] = lc

    def _tag(self, n: i64) -> i64:
        """The tag kept with evicted chunk ``n``'s ghost entry (-1: none; at most 2**23 - 2). A
        subclass's hook (oddsref: the class of a chunk evicted fresh), so that one history, one index
        probe per eviction, carries both."""
        return -1

    def _untag(self, n: i64, tag: i64) -> None:
        """Chunk ``n`` came back from the ghost history with a ``tag`` >= 0 (see :meth:`_tag`)."""

    def _forget(self, n: i64, ordered: bool) -> None:
        self._evicted = True
        s = self._score[n]
        self._restored[n] = math.nan
        last = self._last[n]
        self._last[n] = _NEVER  # the slot may be reused by another node
        t = self._cols.tokens[n]
        if self._ghost_factor and s > -math.inf and (t >= self._full_tokens or not self._short(n, t)):
            ghost = self._ghost
            when = last
            if last == _NEVER:  # a statement, not a conditional expression: int and i64 join as object
                when = self._clock
            aux = when | (self._tag(n) + 1) << _WHEN_BITS
            ghost.put(self._ns[n], self._keys[n], s, aux, self._name_hash[n])
            # As floats: an int compared with a float is a generic (boxed) comparison when compiled.
            if float(len(ghost)) > self._ghost_factor * float(self._resident) + 64.0:
                ghost.pop_oldest()

    def _ghost_tags(self) -> list[int]:
        # The ghost entries' tags, oldest first (-1: none), for integrity checks.
        return [(a >> _WHEN_BITS) - 1 for a in self._ghost.aux_values()]

    def check_integrity(self) -> None:
        super().check_integrity()
        self._ghost.check_integrity()
        bad = [a for a in self._ghost.aux_values() if a < 0 or (a & _WHEN) > self._clock]
        assert not bad, f"{self.name}: ghost entries touched at no past clock value, e.g. {bad[:5]}"
        assert 0.0 <= self._long_share <= 1.0 and 0.0 <= self._w <= self._w0, (
            f"{self.name}: long-gap share {self._long_share}, count weight {self._w} of {self._w0}"
        )
        assert self._long_gap_share > 0.0 or self._w == self._w0, f"{self.name}: count weight moved, guard off"
        assert len(self._ns_full) <= _NS_FULL_MAX and all(f <= self._full_tokens for f in self._ns_full.values()), (
            f"{self.name}: {len(self._ns_full)} namespace sizes, tier's largest chunk {self._full_tokens}"
        )

    def on_cleared(self) -> None:
        # One removal trims at most one entry while adding its own: after a clear of many chunks the
        # history would keep the old tier's size (nothing shrinks it until the tier holds as many
        # chunks again). Trimmed here rather than in _forget: a loop there moves the simulator's
        # hit rates (Mooncake at 1 %: agedref +0.06, oddsref +0.14 points, past the pinned 0.05).
        self._ghost.trim(self._ghost_factor * self._resident + 64)


def _log2_add(a: float, b: float) -> float:
    """log2(2^a + 2^b) without overflow."""
    if a < b:
        a, b = b, a
    if b == -math.inf:
        return a
    return a + _log2(1.0 + math.pow(2.0, b - a))  # math.pow: 2.0 ** x, native when compiled
