"""``oddsref``: agedref plus a learned bypass of fresh chunks from request classes that rarely
return.

Imported by :mod:`radixkv.policies` (which registers it); see :mod:`radixkv.policies` for the
protocol and docs/policy-research.md for the measurements.
"""

from __future__ import annotations

import math
from typing import ClassVar

from librt.vecs import extend, vec
from mypy_extensions import i64

from radixkv.compiler_hints import mypyc_attr
from radixkv.errors import ConfigError
from radixkv.policy_heap import _OUT, AgedRefPolicy, _log2

_Class = tuple[int, int, int]


def _pack(c: _Class) -> int:
    # A class in one integer, the key of its number (each part is a log2 of a count, below 64).
    return c[0] | c[1] << 16 | c[2] << 32


@mypyc_attr(allow_interpreted_subclasses=True)  # users may subclass a built-in policy
class OddsRefPolicy(AgedRefPolicy):
    """agedref whose *fresh* chunks (created by a request, never reused since) are ordered by the
    learned reuse odds of the request class that created them.

    Signal. Every request that brings new chunks has a class: ``(log2(1 + children of the chunk its
    hit ended at), log2(1 + number of new chunks), log2(depth of the first new chunk))``, i.e. how
    many different continuations the shared prefix it extends already has (a generic system prompt
    with thousands of continuations versus a specific document or conversation with a few), how much
    new text it adds, and how deep in the prompt the new text starts. Per class the policy counts
    the fresh chunks it created and how many of them were reused later (a later request's hit
    covering them, a wholly hit request ending on them, or their key coming back through the ghost
    history), with exponential forgetting (``class_decay`` per 1,024 requests). A fresh chunk of a
    class whose odds of reuse are below the average fresh chunk's gets its priority lowered by
    ``odds_weight * count_weight * H * log2(odds_class / odds_all)`` (H the adaptive half-life): it
    is evicted before fresh chunks of classes that do return, which is admission control (bypass)
    learned online; classes above average are not promoted (promoting them too lost 3 points of the
    LRU-to-OPT gap at 5 % on the Mooncake trace, and lost to LRU on agent loops at 25 %). Once a
    chunk is reused it is ordered exactly as in ``agedref``.

    Every other rule (aged reference counts, adaptive H, ghost history, partial chunks first) is
    agedref's, with agedref's long-gap guard on (``long_gap_share=0.05``: the count's bonus fades
    where LRU's turnover outlasts nearly every observed reuse gap; the class demotion keeps its
    weight). Extra state: one class per fresh chunk (kept in its ghost entry once it leaves, beside
    agedref's score: one history, one index probe per eviction), a table of classes. In
    a lower tier, chunks arriving by demotion are classed like new ones (the tier sees them for the
    first time).
    """

    name: ClassVar[str] = "oddsref"

    def __init__(
        self, odds_weight: float = 1.0, class_decay: float = 0.9, gap_quantile: float = 0.6,
        ghost_factor: float = 32.0, initial_half_life: float = 100.0, count_weight: float = 0.5,
        gap_step: float = 0.01, long_gap_share: float = 0.05,
    ) -> None:
        # agedref's options, spelled out (same defaults but long_gap_share, on here) rather than
        # passed on as **kwargs
        super().__init__(gap_quantile, ghost_factor, initial_half_life, count_weight, gap_step, long_gap_share)
        if not odds_weight >= 0:
            raise ConfigError(f"oddsref: odds_weight={odds_weight!r} must be >= 0")
        if not 0.0 < class_decay <= 1.0:
            raise ConfigError(f"oddsref: class_decay={class_decay!r} must be in (0, 1]")
        self._beta = float(odds_weight)
        self._decay = float(class_decay)
        # Classes are numbered in order of first sight (a class never loses its number); the
        # per-class counts and each fresh chunk's class are vec columns by that number, so the hot
        # paths (_prio, _forget, a hit's walk) read a column where they probed dicts keyed by tuples.
        self._class_no: dict[int, int] = {}  # packed class (_pack) -> its number
        self._classes: list[_Class] = []  # by number
        self._made: vec[float] = vec[float]()  # by number: fresh chunks created (decayed)
        self._used: vec[float] = vec[float]()  # by number: of those, reused later (decayed)
        # By node id: the number of the class of the request that made it, while it is a fresh
        # resident chunk (-1: not one); grows by assignment in _grow.
        self._cls: vec[i64] = vec[i64]()
        self._made_all = 0.0
        self._used_all = 0.0
        # _penalty's last value per class and the count version it was computed at (_counts_v moves
        # with every change of a count): the pushes of one eviction run, which change no count,
        # reuse it instead of taking a log2 each. The same arithmetic on the same counts.
        self._counts_v: i64 = 0
        self._pen: vec[float] = vec[float]()
        self._pen_v: vec[i64] = vec[i64]()
        self._requests = 0
        self._new: list[int] = []  # fresh chunks of the request being inserted

    def _grow(self, n_slots: int) -> None:
        self._cls = extend(self._cls, vec[i64]([-1] * (n_slots - len(self._cls))))
        super()._grow(n_slots)

    def class_of(self, node_id: int) -> _Class | None:
        """The class of fresh chunk ``node_id`` (None: not a fresh resident chunk); for tests and
        inspection."""
        k = self._cls[node_id] if 0 <= node_id < len(self._cls) else -1
        return self._classes[k] if k >= 0 else None

    def class_odds(self) -> dict[_Class, float]:
        """Learned reuse probability of fresh chunks per class (for tests and inspection)."""
        return {c: self._p(k) for k, c in enumerate(self._classes)}

    def class_penalty(self, c: _Class) -> float:
        """The priority penalty of a fresh chunk of class ``c``, in units of count_weight * H (0 for
        a class at or above the average odds; for tests and inspection)."""
        k = self._class_no.get(_pack(c))
        return self._penalty(-1 if k is None else k)

    def _p(self, k: int) -> float:
        # Laplace's rule: a rarely seen class starts near even odds (not demoted on little data).
        # k < 0: a class never seen (no counts).
        if k < 0:
            return 0.5
        return (self._used[k] + 1.0) / (self._made[k] + 2.0)

    def _penalty(self, k: int) -> float:
        if k >= 0 and self._pen_v[k] == self._counts_v:
            return self._pen[k]
        p, pa = self._p(k), (self._used_all + 1.0) / (self._made_all + 2.0)
        b = _log2((p / (1.0 - p)) / (pa / (1.0 - pa))) if p < 1.0 and pa < 1.0 else 0.0
        pen = min(0.0, self._beta * b)
        if k >= 0:
            self._pen[k] = pen
            self._pen_v[k] = self._counts_v
        return pen

    def _credit(self, k: int) -> None:
        self._used[k] += 1.0
        self._used_all += 1.0
        self._counts_v += 1

    def _class_number(self, c: _Class) -> int:
        # The number of class c, numbering it if it is new.
        packed = _pack(c)
        k = self._class_no.get(packed, -1)
        if k < 0:
            k = self._class_no[packed] = len(self._classes)
            self._classes.append(c)
            self._made = extend(self._made, vec[float]([0.0]))
            self._used = extend(self._used, vec[float]([0.0]))
            self._pen = extend(self._pen, vec[float]([0.0]))
            self._pen_v = extend(self._pen_v, vec[i64]([-1]))  # never computed
        return k

    def _classify(self, boundary: int, fresh: list[int]) -> _Class:
        # live children of the boundary node, read from the tree's column (a bound method of the
        # tree kept here made every tree with this policy a reference cycle)
        fan_out = int(self._cols.nchild[boundary]) if boundary >= 0 else 0
        return (
            int(_log2(fan_out + 1)),
            int(_log2(len(fresh) + 1)),
            int(_log2(self._depth[fresh[0]])),
        )

    def _credit_path(self, q: int) -> None:
        # A request's hit covered q and its ancestors: the fresh ones among them are reused.
        cls, parent = self._cls, self._parent
        while q >= 0:
            k = cls[q]
            if k < 0:
                break
            cls[q] = -1
            self._credit(k)
            q = parent[q]

    def _prio(self, n: i64) -> float:
        s = super()._prio(n)
        k = self._cls[n]
        t = self._cols.tokens[n]
        if k >= 0 and s > -math.inf and (t >= self._full_tokens or not self._short(n, t)):
            # count_weight itself, not the guard's scaled weight: the guard is about the bonus
            s += self._w0 * self._h * self._penalty(k)
        return s

    def _admit(self, node_ids: list[int], now: int) -> None:
        if not node_ids:
            return
        boundary = self._parent[node_ids[0]]
        super()._admit(node_ids, now)
        if self._partial(node_ids[0]):
            return  # a request's partial tail, inserted on its own: never classed
        fresh: list[int] = []
        full, tokens = self._full_tokens, self._cols.tokens
        # A chunk back from the ghost history is not fresh (agedref's _admit has credited its class
        # through _untag if it had left fresh).
        for n in node_ids:
            t = tokens[n]
            if math.isnan(self._restored[n]) and (t >= full or not self._short(n, t)):
                fresh.append(n)
        self._credit_path(boundary)
        self._new = fresh
        if not fresh:
            return
        k = self._class_number(self._classify(boundary, fresh))
        cls = self._cls
        for n in fresh:
            cls[n] = k
        # float + float, written out: a float += int compiles to a generic (boxed) in-place add
        made, n_fresh = self._made, float(len(fresh))
        made[k] = made[k] + n_fresh
        self._made_all = self._made_all + n_fresh
        self._counts_v += 1

    def _touch(self, n: i64, now: int) -> None:
        super()._touch(n, now)
        t = self._cols.tokens[n]
        if t < self._full_tokens and self._short(n, t):
            return
        if self._cls[n] >= 0:
            # n not in self._new, as a native loop (`in` on a list boxes n and compares generically)
            new = True
            for x in self._new:
                if x == n:
                    new = False
                    break
            if new:
                self._credit_path(n)  # a request wholly hit (no new chunks): its path is reused
        self._new = []
        self._requests += 1
        if self._requests % 1024 == 0 and self._decay < 1.0:
            d = self._decay
            made, used = self._made, self._used
            for k in range(len(made)):
                made[k] = made[k] * d
                used[k] = used[k] * d
            self._made_all *= d
            self._used_all *= d
            self._counts_v += 1

    def _tag(self, n: i64) -> i64:
        # A chunk leaving fresh takes its class into agedref's ghost entry ...
        return self._cls[n]

    def _untag(self, n: i64, tag: i64) -> None:
        # ... and credits it once if it comes back (as a full chunk: partial tails are never classed).
        if not self._partial(n):
            self._credit(tag)

    def _forget(self, n: i64, ordered: bool) -> None:
        super()._forget(n, ordered)  # takes the class into the ghost entry (_tag) first
        self._cls[n] = -1  # the slot may be reused by another node

    def check_integrity(self) -> None:
        super().check_integrity()
        st, cls, n_classes = self._st, self._cls, len(self._classes)
        assert len(self._made) == len(self._used) == len(self._pen) == len(self._pen_v) == n_classes == len(
            self._class_no
        ), (
            f"oddsref: {n_classes} classes, {len(self._class_no)} numbered, counts of "
            f"{len(self._made)} / {len(self._used)}"
        )
        assert all(self._class_no[_pack(c)] == k for k, c in enumerate(self._classes)), "oddsref: class numbers drifted"
        stray = [n for n in range(len(cls)) if cls[n] >= 0 and (n >= len(st) or st[n] == _OUT)]
        assert not stray, (
            f"oddsref: {len(stray)} classed chunks not resident, e.g. {stray[:5]}"
        )
        bad = [n for n in range(len(cls)) if not -1 <= cls[n] < n_classes]
        assert not bad, f"oddsref: chunks with no such class, e.g. {bad[:5]}"
        ghost_bad = [t for t in self._ghost_tags() if not -1 <= t < n_classes]
        assert not ghost_bad, f"oddsref: ghost entries with no such class, e.g. {ghost_bad[:5]}"
