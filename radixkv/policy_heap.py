"""Priority-ordered eviction policies (lfu, cost, agedref) on a lazily invalidated heap.

Imported by :mod:`radixkv.policies`, which registers them; see its docstring for the protocol."""

from __future__ import annotations

import heapq
import math
from heapq import heappush
from collections import OrderedDict
from typing import TYPE_CHECKING, Any, ClassVar, Generator, Sequence

from librt.vecs import extend, vec
from mypy_extensions import i64

from radixkv.compiler_hints import mypyc_attr
from radixkv.errors import ConfigError

if TYPE_CHECKING:
    from radixkv.tree import RadixTree, TreeColumns


# ---------------------------------------------------------------------------------------------------
# Priority-ordered policies. Each keeps a static priority per node in a lazily invalidated heap
# (smallest first; ties deepest first), parks interior nodes until on_leaf, and folds a removed node's
# statistics into its parent, which is how lazy path touches reach ancestors.

# ``AgedRefPolicy._last`` of a node never touched directly (clock values are >= 0).
_NEVER = -(1 << 60)

# The slot of a resident interior node in ``_entry``: ordered only once it becomes a leaf. (Any
# empty tuple is this object, and no heap entry is empty.)
_PARKED: tuple[Any, ...] = ()

# A heap entry: (priority, -depth, node id). Entries are told apart by identity (the live one is the
# object in _entry, older ones are stale), so the type is a variable-length tuple on purpose: mypyc
# unboxes fixed-length tuples into C structs, which would make each use a new object.
HeapEntry = tuple[Any, ...]


@mypyc_attr(allow_interpreted_subclasses=True)  # users may subclass a built-in policy
class _HeapPolicy:
    """Base of the priority policies: subclasses define ``_prio(n)`` and the ``_admit`` / ``_touch`` /
    ``_fold`` / ``_forget`` hooks on their own per-node statistics."""

    name: ClassVar[str] = "_heap"
    live_candidates: ClassVar[bool] = True

    def __init__(self) -> None:
        self._heap: list[HeapEntry] = []
        # Per-node state lives in lists indexed by node id, like the tree's own columns: a list slot
        # costs a fraction of an int-keyed dict probe, and these are read on every touch, insert and
        # eviction. ``_entry[n]``: None if n is not resident in the tier, _PARKED if it is an
        # interior node, else its live heap entry. Subclasses keep their columns in step (_grow).
        self._entry: list[HeapEntry | None] = []
        self._resident = 0  # slots of _entry that are not None
        self._aside: list[HeapEntry] = []
        self._tokens: list[int] = []
        self._keys: list[str | None] = []
        self._ns: list[str | None] = []
        self._t = 0
        self._bit = 1

    _cols: TreeColumns  # set by bind: the tree's columns (not the tree: no reference cycle)

    def bind(self, tree: RadixTree, tier_index: int) -> None:
        self._cols, self._t, self._bit = tree._views, tier_index, 1 << tier_index
        # Read-only views of the tree's node columns (struct of arrays, indexed by node id): its
        # lists are kept, its vec columns read through its column holder, tree._views (one is replaced
        # when it grows; the tree itself is not kept: a reference cycle).
        self._tokens, self._keys, self._ns = tree._tokens, tree._key, tree._ns

    @property
    def _tchild(self) -> vec[i64]:
        # The tree's column of children resident in the tier (read-only), from tree._views at each use.
        return self._cols.tchild[self._t]

    @property
    def _mask(self) -> vec[i64]:
        # The tree's column of residency masks (read-only), from tree._views at each use.
        return self._cols.mask

    @property
    def _depth(self) -> vec[i64]:
        # The tree's column of depths (read-only), from tree._views at each use.
        return self._cols.depth

    @property
    def _parent(self) -> vec[i64]:
        # The tree's column of parents (read-only), from tree._views at each use.
        return self._cols.parent

    def __len__(self) -> int:
        return self._resident

    def _grow(self, n_slots: int) -> None:
        """Extend the per-node columns to ``n_slots`` (the tree's column length; new slots are
        empty). Subclasses with columns of their own extend them too."""
        self._entry.extend([None] * (n_slots - len(self._entry)))

    # subclass hooks --------------------------------------------------------------------------
    def _prio(self, n: int) -> float:
        raise NotImplementedError

    def _admit(self, node_ids: Sequence[int], now: int) -> None:
        pass

    def _touch(self, n: int, now: int) -> None:
        pass

    def _fold(self, child: int, parent: int) -> None:
        pass

    def _forget(self, n: int, entry: HeapEntry | None) -> None:
        pass

    # protocol ---------------------------------------------------------------------------------
    def _push(self, n: int) -> None:
        e: HeapEntry = (self._prio(n), -self._depth[n], n)
        self._entry[n] = e
        heapq.heappush(self._heap, e)

    def on_insert(self, node_ids: Sequence[int], now: int) -> None:
        if len(self._entry) < len(self._depth):
            self._grow(len(self._depth))
        self._admit(node_ids, now)
        tchild, entry, push = self._tchild, self._entry, self._push
        for n in node_ids:
            if entry[n] is None:
                self._resident += 1
            if tchild[n]:
                entry[n] = _PARKED  # interior: ordered when it becomes a leaf
            else:
                push(n)

    def on_access(self, node_id: int, now: int) -> None:
        self._touch(node_id, now)
        self._push(node_id)

    def on_leaf(self, node_id: int) -> None:
        if self._entry[node_id] is not None:
            self._push(node_id)

    def on_remove(self, node_ids: Sequence[int]) -> None:
        entry, parent = self._entry, self._parent
        n_slots = len(entry)
        for n in node_ids:
            e = entry[n] if n < n_slots else None
            if e is None:
                continue  # not resident in the tier
            entry[n] = None
            self._resident -= 1
            p = parent[n]
            if p >= 0 and entry[p] is not None:
                self._fold(n, p)
            self._forget(n, e)
        if len(self._heap) > 2 * self._resident + 1024:
            self._compact()

    def on_graft(self, node_ids: Sequence[int]) -> None:
        """The nodes' depths grew: their run was grafted under a chain (``RadixTree._graft``, optional
        hook). Re-key their heap entries, whose tie-break is -depth; a priority is kept as pushed.
        The columns grow to the tree's: the new parent may be newer than this tier's last insert
        (on_remove folds into it)."""
        if len(self._entry) < len(self._depth):
            self._grow(len(self._depth))
        entry, depth, heap = self._entry, self._depth, self._heap
        for n in node_ids:
            e = entry[n]
            if e is None or e is _PARKED:
                continue  # not in the tier, or parked: pushed with its depth when it becomes a leaf
            ne: HeapEntry = (e[0], -depth[n], n)
            entry[n] = ne
            heappush(heap, ne)

    def _compact(self) -> None:
        # Drop the stale entries once they outnumber the live ones (rare: amortized O(1)). In place:
        # a candidates() run in progress (the tree evicts between its steps, and on_remove or
        # on_evict lands here) reads this very list; a new one would hide every later push from it.
        heap = self._heap
        heap[:] = [e for e in self._entry if e is not None and e is not _PARKED]
        heapq.heapify(heap)

    def candidates(self) -> Generator[int, None, None]:
        heap, entry, tchild, aside = self._heap, self._entry, self._tchild, self._aside
        pop = heapq.heappop
        # The top entry is popped before it is looked at: a yielded node the tree did not evict (its
        # entry is still its live one: pinned, or the run was closed before the caller evicted it) is
        # set aside and pushed back when iteration ends. An evicted node's entry leaves the heap here
        # rather than as a stale entry at the next step; the heap's live entries, and so the order of
        # candidates, are the same.
        try:
            while heap:
                e = pop(heap)
                n = e[2]
                if entry[n] is not e:
                    continue  # stale
                if tchild[n]:  # interior in the tier
                    entry[n] = _PARKED  # park until on_leaf
                    continue
                try:
                    yield n
                except GeneratorExit:
                    if entry[n] is e:
                        aside.append(e)  # closed before the caller evicted it
                    raise
                if entry[n] is e:
                    aside.append(e)  # the tree skipped it (pinned): keep it for later
        finally:
            while aside:
                e = aside.pop()
                if entry[e[2]] is e:
                    heapq.heappush(heap, e)

    def check_integrity(self) -> None:
        entry = self._entry
        live = {e[2] for e in self._heap if entry[e[2]] is e}
        ordered = {n for n, e in enumerate(entry) if e is not None and e is not _PARKED}
        assert live == ordered, f"{self.name}: {len(ordered - live)} ordered nodes missing from the heap"
        assert not self._aside, f"{self.name}: {len(self._aside)} candidates left aside"
        resident = sum(1 for e in entry if e is not None)
        assert resident == self._resident, f"{self.name}: {resident} resident slots, counted {self._resident}"
        assert len(entry) <= len(self._depth), f"{self.name}: {len(entry)} slots for {len(self._depth)} nodes"
        depth = self._depth
        stale = [n for n in ordered if entry[n][1] != -depth[n]]  # type: ignore[index]
        assert not stale, f"{self.name}: {len(stale)} heap entries keyed with an old depth, e.g. {stale[:5]}"
        # The slots held are exactly the tier's nodes (a count alone misses a dead node's slot kept
        # in place of a live one's), and a parked node has a child in the tier: on_leaf orders it
        # when the last one leaves, so a parked leaf would never be a candidate again.
        mask, bit, tchild = self._mask, self._bit, self._tchild
        held = {n for n, e in enumerate(entry) if e is not None}
        tier = {n for n, m in enumerate(mask) if m & bit}
        assert held == tier, (
            f"{self.name}: slots of nodes not in the tier {sorted(held - tier)[:5]}, tier nodes without "
            f"a slot {sorted(tier - held)[:5]}"
        )
        lost = [n for n, e in enumerate(entry) if e is _PARKED and not tchild[n]]
        assert not lost, f"{self.name}: {len(lost)} tier leaves parked (never candidates), e.g. {lost[:5]}"


@mypyc_attr(allow_interpreted_subclasses=True)  # users may subclass a built-in policy
class LFUPolicy(_HeapPolicy):
    """Least frequently used leaf first, with dynamic aging (LFU-DA): priority = L + count, where L is
    the priority of the last evicted chunk, so counts earned long ago lose their weight. A chunk's
    count includes every access below it (folded in as its children leave)."""

    name: ClassVar[str] = "lfu"

    def __init__(self) -> None:
        super().__init__()
        self._count: list[int] = []  # by node id; meaningful while the node is resident
        self._age = 0.0

    def _grow(self, n_slots: int) -> None:
        self._count.extend([0] * (n_slots - len(self._count)))
        super()._grow(n_slots)

    def _prio(self, n: int) -> float:
        return self._age + self._count[n]

    def _admit(self, node_ids: Sequence[int], now: int) -> None:
        count, entry = self._count, self._entry
        for n in node_ids:
            if entry[n] is None:  # new to the tier (a resident node keeps its count)
                count[n] = 0

    def _touch(self, n: int, now: int) -> None:
        self._count[n] += 1

    def _fold(self, child: int, parent: int) -> None:
        self._count[parent] += self._count[child]

    def _forget(self, n: int, entry: HeapEntry | None) -> None:
        if entry is not None and entry is not _PARKED and entry[0] > self._age:
            self._age = entry[0]


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
        self._size: list[int] = []

    def _grow(self, n_slots: int) -> None:
        self._unit = extend(self._unit, vec[float]([0.0] * (n_slots - len(self._unit))))
        super()._grow(n_slots)

    def bind(self, tree: RadixTree, tier_index: int) -> None:
        super().bind(tree, tier_index)
        self._size = tree._size

    def _prio(self, n: int) -> float:
        return self._age + self._count[n] * self._unit[n]

    def _push(self, n: int) -> None:
        # _prio written out: this is the cost policy's hottest line (every touch and every new leaf).
        e: HeapEntry = (self._age + self._count[n] * self._unit[n], -self._depth[n], n)
        self._entry[n] = e
        heapq.heappush(self._heap, e)

    # The four hooks below are _HeapPolicy's with _push, _fold and _forget written out: cost is the
    # slowest policy of the simulator's sweep, and each hook runs once per eviction, touch or new leaf
    # (4-6 Python calls per evicted chunk otherwise). Same effects in the same order as the base's.
    def on_insert(self, node_ids: Sequence[int], now: int) -> None:
        if len(self._entry) < len(self._depth):
            self._grow(len(self._depth))
        self._admit(node_ids, now)
        tchild, entry, count, unit, depth = self._tchild, self._entry, self._count, self._unit, self._depth
        heap, age = self._heap, self._age
        for n in node_ids:
            if entry[n] is None:
                self._resident += 1
            if tchild[n]:
                entry[n] = _PARKED  # interior: ordered when it becomes a leaf
            else:
                e: HeapEntry = (age + count[n] * unit[n], -depth[n], n)
                entry[n] = e
                heappush(heap, e)

    def on_access(self, node_id: int, now: int) -> None:
        count = self._count
        c = count[node_id] = count[node_id] + 1
        e: HeapEntry = (self._age + c * self._unit[node_id], -self._depth[node_id], node_id)
        self._entry[node_id] = e
        heappush(self._heap, e)

    def on_leaf(self, node_id: int) -> None:
        entry = self._entry
        if entry[node_id] is not None:
            e: HeapEntry = (self._age + self._count[node_id] * self._unit[node_id],
                            -self._depth[node_id], node_id)
            entry[node_id] = e
            heappush(self._heap, e)

    def on_evict(self, node_id: int, leaf_parent: int) -> None:
        # on_remove((node_id,)) then on_leaf(leaf_parent), in one call (see EvictionPolicy). node_id
        # is the node candidates() just yielded, so it has a live (not parked) entry.
        entry, count = self._entry, self._count
        e: HeapEntry | None = entry[node_id]
        entry[node_id] = None
        self._resident -= 1
        p = self._parent[node_id]
        if p >= 0 and entry[p] is not None:
            count[p] += count[node_id]
        if e[0] > self._age:  # type: ignore[index]
            self._age = e[0]  # type: ignore[index]
        if len(self._heap) > 2 * self._resident + 1024:
            self._compact()
        if leaf_parent >= 0 and entry[leaf_parent] is not None:
            pe: HeapEntry = (self._age + count[leaf_parent] * self._unit[leaf_parent],
                             -self._depth[leaf_parent], leaf_parent)
            entry[leaf_parent] = pe
            heappush(self._heap, pe)

    def on_remove(self, node_ids: Sequence[int]) -> None:
        entry, parent, count = self._entry, self._parent, self._count
        n_slots = len(entry)
        for n in node_ids:
            e = entry[n] if n < n_slots else None
            if e is None:
                continue  # not resident in the tier
            entry[n] = None
            self._resident -= 1
            p = parent[n]
            if p >= 0 and entry[p] is not None:
                count[p] += count[n]  # _fold: the parent's count includes every access below it
            if e is not _PARKED and e[0] > self._age:
                self._age = e[0]
        if len(self._heap) > 2 * self._resident + 1024:
            self._compact()

    def _admit(self, node_ids: Sequence[int], now: int) -> None:
        super()._admit(node_ids, now)
        # Recompute cost per byte is static for a node (its tokens, depth and size never change).
        tokens, depth, size, attn, unit = self._tokens, self._depth, self._size, self._attn, self._unit
        for n in node_ids:
            t = tokens[n]
            unit[n] = t * (1.0 + (int(depth[n]) - 1) * t / attn) / max(size[n], 1)

    def on_graft(self, node_ids: Sequence[int]) -> None:
        # A deeper chunk costs more to recompute: its unit cost follows its new depth, and a live
        # entry's priority moves by the count times the change (the value a push now would have,
        # with the age of its own push).
        if len(self._entry) < len(self._depth):
            self._grow(len(self._depth))  # as in _HeapPolicy.on_graft
        tokens, depth, size, attn, unit = self._tokens, self._depth, self._size, self._attn, self._unit
        entry, count, heap = self._entry, self._count, self._heap
        for n in node_ids:
            if entry[n] is None:
                continue
            t = tokens[n]
            old = unit[n]
            new = unit[n] = t * (1.0 + (int(depth[n]) - 1) * t / attn) / max(size[n], 1)
            e = entry[n]
            if e is _PARKED:
                continue
            ne: HeapEntry = (e[0] + count[n] * (new - old), -depth[n], n)  # type: ignore[index]
            entry[n] = ne
            heappush(heap, ne)

    def check_integrity(self) -> None:
        super().check_integrity()
        tokens, depth, size, attn, unit = self._tokens, self._depth, self._size, self._attn, self._unit
        wrong = [n for n, e in enumerate(self._entry) if e is not None
                 and unit[n] != tokens[n] * (1.0 + (int(depth[n]) - 1) * tokens[n] / attn) / max(size[n], 1)]
        assert not wrong, f"cost: {len(wrong)} unit costs not of the chunk's depth, e.g. {wrong[:5]}"
        assert len(self._unit) == len(self._count) == len(self._entry), (
            f"cost: {len(self._unit)} unit costs, {len(self._count)} counts, {len(self._entry)} slots"
        )


@mypyc_attr(allow_interpreted_subclasses=True)  # users may subclass a built-in policy
class AgedRefPolicy(_HeapPolicy):
    """Aged reference count with a ghost history: radixkv's own policy (see docs/simulator.md).

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
      extending the same text yields a different chunk, so they are almost never reused.

    Time is counted in path touches (one per request).
    """

    name: ClassVar[str] = "agedref"

    # How far below its own priority a partial chunk is ordered. A class variable (ClassVar: the
    # compiled build reads it from the class, as Python does), so a Python subclass may override it;
    # as a plain class attribute the compiled build made it an instance slot holding 1e15, which
    # ignored a subclass's value. Read once per instance, into _partial_penalty (_prio is hot).
    _PARTIAL_PENALTY: ClassVar[float] = 1e15

    def __init__(self, gap_quantile: float = 0.6, ghost_factor: float = 32.0,
                 initial_half_life: float = 100.0, count_weight: float = 0.5, gap_step: float = 0.01) -> None:
        super().__init__()
        if not 0.0 < gap_quantile < 1.0:
            raise ConfigError(f"{self.name}: gap_quantile={gap_quantile!r} must be in (0, 1)")
        if not 0.0 < gap_step < 0.5:
            raise ConfigError(f"{self.name}: gap_step={gap_step!r} must be in (0, 0.5) (a relative step of H)")
        if not 0.0 < count_weight <= 1.0:
            raise ConfigError(f"{self.name}: count_weight={count_weight!r} must be in (0, 1]")
        if not ghost_factor >= 0:
            raise ConfigError(f"{self.name}: ghost_factor={ghost_factor!r} must be >= 0")
        if not initial_half_life > 0:
            raise ConfigError(f"{self.name}: initial_half_life={initial_half_life!r} must be > 0 requests")
        self._up = 1.0 + gap_step * gap_quantile  # H's step per gap above it, and below it
        self._down = 1.0 - gap_step * (1.0 - gap_quantile)
        self._w = float(count_weight)
        self._h = float(initial_half_life)
        self._ghost_factor = float(ghost_factor)
        self._partial_penalty = float(self._PARTIAL_PENALTY)
        # By node id, meaningful while the node is resident:
        # H * log2(aged reference count) + time, in requests; grows by assignment in _grow
        self._score: vec[float] = vec[float]()
        self._last: list[int] = []  # clock of the node's last direct touch (_NEVER: none)
        self._restored: dict[int, float] = {}  # score a node came back with from the ghost history
        self._ghost: OrderedDict[tuple[str | None, str | None], tuple[float, int]] = OrderedDict()
        self._full_tokens = 0
        self._clock = 0

    def _grow(self, n_slots: int) -> None:
        self._score = extend(self._score, vec[float]([-math.inf] * (n_slots - len(self._score))))
        self._last.extend([_NEVER] * (n_slots - len(self._last)))
        super()._grow(n_slots)

    @property
    def half_life(self) -> float:
        """The current adaptive half-life H, in requests."""
        return self._h

    def _observe_gap(self, gap: int) -> None:
        # Streaming quantile: H settles where P(gap > H) = 1 - q.
        if gap > self._h:
            self._h *= self._up
        else:
            self._h = max(1.0, self._h * self._down)

    def _add(self, a: float, b: float) -> float:
        h = self._h
        return h * _log2_add(a / h, b / h)

    def _prio(self, n: int) -> float:
        s = self._score[n]
        last = self._last[n]
        if last != _NEVER and s > -math.inf:
            # last use + count_weight * H * log2(aged references): the count's bonus is scaled down
            # without shortening the memory H of the count itself.
            s = last + self._w * (s - last)
        return s - self._partial_penalty if self._tokens[n] < self._full_tokens else s

    def _admit(self, node_ids: Sequence[int], now: int) -> None:
        score, ghost, keys, ns, tokens = self._score, self._ghost, self._keys, self._ns, self._tokens
        if not node_ids:
            return
        p = self._parent[node_ids[0]]
        if p >= 0 and self._last[p] != _NEVER:
            self._observe_gap(self._clock + 1 - self._last[p])  # the request's deepest hit chunk
        for n in node_ids:
            if tokens[n] > self._full_tokens:
                self._full_tokens = tokens[n]
            g = ghost.pop((ns[n], keys[n]), None) if ghost else None
            if g is None:
                score[n] = -math.inf
            else:
                score[n] = self._restored[n] = g[0]
                self._observe_gap(self._clock + 1 - g[1])

    def _touch(self, n: int, now: int) -> None:
        if self._tokens[n] >= self._full_tokens:
            self._clock += 1  # a partial tail touched right after its full prefix: same request
        self._last[n] = self._clock
        self._score[n] = self._add(self._score[n], float(self._clock))

    def _fold(self, child: int, parent: int) -> None:
        if self._tokens[child] < self._full_tokens:
            return  # a partial tail's touch repeats its parent's (same request)
        s = self._score[child]
        base = self._restored.get(child)
        if base is not None:
            # The restored part was folded into the parent when the child left before: add only
            # the references since it came back.
            if s <= base:
                return
            h = self._h
            rest = 1.0 - 2.0 ** ((base - s) / h)
            if rest <= 0.0:  # s is base re-rounded (an ulp above it): nothing was added since
                return
            s = s + h * math.log2(rest)
        self._score[parent] = self._add(self._score[parent], s)
        lc = self._last[child]
        if lc > self._last[parent]:  # _NEVER is below every clock value
            self._last[parent] = lc

    def _forget(self, n: int, entry: HeapEntry | None) -> None:
        s = self._score[n]
        self._restored.pop(n, None)
        last = self._last[n]
        self._last[n] = _NEVER  # the slot may be reused by another node
        if self._ghost_factor and s > -math.inf and self._tokens[n] >= self._full_tokens:
            ghost = self._ghost
            ghost[(self._ns[n], self._keys[n])] = (s, self._clock if last == _NEVER else last)
            if len(ghost) > self._ghost_factor * self._resident + 64:
                ghost.popitem(last=False)  # O(1); deleting a plain dict's first key is not

    def on_cleared(self) -> None:
        # One removal trims at most one entry while adding its own: after a clear of many chunks the
        # history would keep the old tier's size (nothing shrinks it until the tier holds as many
        # chunks again). Trimmed here rather than in _forget: a loop there moves the simulator's
        # hit rates (Mooncake at 1 %: agedref +0.06, oddsref +0.14 points, past the pinned 0.05).
        _trim_ghost(self._ghost, self._ghost_factor * self._resident + 64)


def _trim_ghost(ghost: OrderedDict[Any, Any], bound: float) -> None:
    """Drop a ghost history's oldest entries until it holds at most ``bound``."""
    while len(ghost) > bound:
        ghost.popitem(last=False)


def _log2_add(a: float, b: float) -> float:
    """log2(2^a + 2^b) without overflow."""
    if a < b:
        a, b = b, a
    if b == -math.inf:
        return a
    return a + math.log2(1.0 + 2.0 ** (b - a))
