"""``radixkv sim``: replay a trace (or a synthetic workload) through the real tree and policies.

With no arguments it runs the embedded default workload (``mix``) at the default capacities and
policies and prints the table. Examples::

    radixkv sim
    radixkv sim --trace tests/data/mooncake_conversation.jsonl.xz --capacity 1%,5%,10% \\
        --policy lru,s3fifo,cost,agedref,oddsref,opt --model llama3-70b --json out.json --plot mrc.png
    radixkv sim --workload rag --tiers mem,disk=25%@7 --capacity 64GiB --model llama3-8b
    radixkv sim --workload rag --tiers mem,disk=25%@7:lru --policy agedref --model llama3-8b
    radixkv sim --workload chat --tiers mem,disk=25% --write-policy write_back
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from dataclasses import dataclass

from radixkv.config import WRITE_POLICIES
from radixkv.errors import RadixKVError
from radixkv.sims.model import DEFAULT_TIER_MODELS, TierModel, parse_model
from radixkv.sims.policy_spec import PolicySpec, parse_policy_spec
from radixkv.sims.report import check_plot_backend, format_table, plot, records, write_csv, write_json
from radixkv.sims.sweep import LowerTier, parse_capacity, run_sweep, tier_models
from radixkv.sims.traces import read_trace
from radixkv.sims.workloads import ARRIVALS, DEFAULT_WORKLOAD, WORKLOADS, WorkloadConfig, generate

__all__ = ["main", "build_parser"]

DEFAULT_CAPACITIES = "1%,5%,10%,25%"
DEFAULT_POLICIES = "lru,s3fifo,cost,agedref,oddsref,opt"
DEFAULT_MODEL = "llama3-8b"


def _pct(text: str) -> str:
    """``text`` for an argparse help string, which %-formats it (a bare "%" would crash ``--help``)."""
    return text.replace("%", "%%")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="radixkv sim",
        description="Offline eviction simulator: replay a request trace through radixkv's radix tree "
        "and eviction policies; report hit rates (vs OPT and an infinite cache) and estimated TTFT.",
    )
    src = p.add_mutually_exclusive_group()
    src.add_argument("--trace", metavar="PATH", help="Mooncake or radixkv JSONL trace")
    src.add_argument("--workload", choices=sorted(WORKLOADS), help=f"synthetic workload (default {DEFAULT_WORKLOAD})")
    # None = not given: a trace refuses them (they would be silently ignored), a workload defaults them.
    p.add_argument("--requests", type=int, default=None, help="requests of a synthetic workload (default 4000)")
    p.add_argument("--seed", type=int, default=None, help="seed of a synthetic workload (default 0)")
    p.add_argument("--rate", type=float, default=None,
                   help="new sessions per second of a synthetic workload: conversations (chat), queries (rag); "
                        "agent tasks start at half this rate (default 4)")
    p.add_argument("--arrivals", choices=ARRIVALS, default=None,
                   help="how a synthetic workload's sessions arrive: burst (default) starts sessions until their "
                        "requests suffice, then they play out; steady keeps starting them for the whole trace "
                        "(a service at constant load)")
    p.add_argument("--block-tokens", type=int, default=None,
                   help="tokens per block (Mooncake: 512; radixkv traces: their header; synthetic: 256)")
    p.add_argument("--limit", type=int, default=None, help="read only the first N requests of a trace")
    p.add_argument("--capacity", default=DEFAULT_CAPACITIES,
                   help=f"top-tier capacities: 5%% of unique blocks, 1828 blocks, or 64GiB (default {_pct(DEFAULT_CAPACITIES)})")
    p.add_argument("--policy", default=DEFAULT_POLICIES,
                   help=f"comma-separated policies, each NAME or NAME:KEY=VALUE[:KEY=VALUE...] with the policy's "
                        f"options, e.g. oddsref:gap_quantile=0.7 (default {_pct(DEFAULT_POLICIES)})")
    p.add_argument("--tiers", default="mem",
                   help="tiers fastest first, NAME[=CAPACITY][@GBps][:POLICY[:KEY=VALUE...]]; the first tier's "
                        "capacity is --capacity and its policy the swept --policy; a lower tier runs the swept "
                        "policy too unless given one (lru is usually the better choice there) "
                        "(default: mem). Example: mem@50,disk=25%%@7:lru")
    p.add_argument("--write-policy", choices=WRITE_POLICIES, default=None,
                   help="the store's write_policy to model with several tiers: write_through (the store's "
                        "default: every new block is also written to each lower tier) or write_back (a block "
                        "reaches a lower tier only when evicted from the one above) (default write_through)")
    p.add_argument("--model", default=DEFAULT_MODEL,
                   help=f"model preset or layers=..,kv_heads=..,head_dim=..,dtype=..,prefill_tps=.. for the "
                        f"byte sizes and TTFT (default {DEFAULT_MODEL}; 'none' to skip TTFT)")
    p.add_argument("--overlap", action="store_true", help="overlap loading with prefill layer by layer")
    p.add_argument("--json", metavar="OUT", help="write one JSON array of records")
    p.add_argument("--csv", metavar="OUT", help="write the records as CSV")
    p.add_argument("--plot", metavar="OUT.png", help="write miss-ratio curves and a TTFT CDF (matplotlib)")
    p.add_argument("--jobs", type=int, default=None, help="parallel processes (default: one per CPU)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


_TIER_SYNTAX = "NAME[=CAPACITY][@GB/s][:POLICY], e.g. disk=25%@7:lru"


@dataclass(slots=True, frozen=True)
class _TierArg:
    """One parsed ``--tiers`` entry: capacity text (None if not given), load model (None: the name's
    default) and policy (None: the swept policy)."""

    name: str
    capacity_text: str | None
    model: TierModel | None
    policy: PolicySpec | None


def _tier(text: str) -> _TierArg:
    """Parse ``NAME[=CAPACITY][@GB/s][:POLICY[:KEY=VALUE...]]`` (the policy comes last so that its
    own ``:KEY=VALUE`` options read as in ``--policy``)."""
    spec_text, colon, policy_text = text.partition(":")
    name, at, bw = spec_text.partition("@")
    name, _, cap = name.partition("=")
    name, cap, bw = name.strip(), cap.strip(), bw.strip()
    if not name:
        raise RadixKVError(f"--tiers: {text.strip()!r} has no tier name; the syntax is {_TIER_SYNTAX}")
    model = None
    if at:
        try:
            gbps = float(bw)
        except ValueError:
            gbps = math.nan
        # An empty, negative, zero or infinite bandwidth would silently model a tier that is not there.
        if not 0 < gbps * 1e9 < math.inf:  # (in bytes/s: 1e308 GB/s overflows)
            raise RadixKVError(f"--tiers: tier {text.strip()!r}: bandwidth {bw!r} must be a finite number of GB/s "
                               f"> 0, as in {name}@7; the syntax is {_TIER_SYNTAX}")
        base = DEFAULT_TIER_MODELS.get(name)
        model = TierModel(name, gbps * 1e9, base.latency_s if base else 0.0)
    policy = None
    if colon:
        try:
            policy = parse_policy_spec(policy_text)
        except RadixKVError as e:
            raise RadixKVError(f"--tiers: tier {text.strip()!r}: {e}; the syntax is {_TIER_SYNTAX}") from None
        if policy.offline:
            raise RadixKVError(f"--tiers: tier {text.strip()!r}: {policy.label} needs the future and models a single "
                               "tier; give the tier an online policy such as lru")
    return _TierArg(name, cap or None, model, policy)


_PLOT_FORMATS = ("png", "pdf", "svg", "jpg", "jpeg")


def _check_output(path: str | None, what: str) -> None:
    """Fail before the sweep (minutes, on a real trace), not after it."""
    if path is None:
        return
    if not path.strip():
        raise RadixKVError(f"{what} needs a file path, got an empty string")
    if os.path.isdir(path):
        raise RadixKVError(f"{what} {path!r} is a directory; give a file path")
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise RadixKVError(f"{what} {path!r}: directory {parent!r} does not exist")
    if not os.access(parent, os.W_OK) or (os.path.exists(path) and not os.access(path, os.W_OK)):
        raise RadixKVError(f"{what} {path!r} is not writable")


def _check_args(args: argparse.Namespace) -> None:
    if args.trace is not None and not args.trace.strip():
        raise RadixKVError("--trace needs a file path, got an empty string")
    if args.trace is not None:
        given = [name for name, v in (("--requests", args.requests), ("--seed", args.seed), ("--rate", args.rate),
                                      ("--arrivals", args.arrivals)) if v is not None]
        if given:
            verb = "shapes" if len(given) == 1 else "shape"
            raise RadixKVError(f"{' and '.join(given)} {verb} a synthetic --workload, not a --trace; to replay "
                               "part of a trace use --limit N")
    if args.limit is not None:
        if args.trace is None:
            raise RadixKVError("--limit reads the first N requests of a --trace; for a --workload use --requests")
        if args.limit < 1:
            raise RadixKVError(f"--limit {args.limit} must be at least 1 request")
    if args.block_tokens is not None and args.block_tokens < 1:
        # (a radixkv trace without a header read 0 as "unset" and replayed 256-token blocks)
        raise RadixKVError(f"--block-tokens {args.block_tokens}: block_tokens={args.block_tokens} must be a "
                           "positive integer (tokens per block); omit it for the trace's or workload's default")
    if args.rate is not None and not 0 < args.rate < math.inf:
        raise RadixKVError(f"--rate {args.rate}: give a finite number of new sessions per second > 0, "
                           "e.g. --rate 0.5")
    if args.jobs is not None and args.jobs < 1:
        raise RadixKVError(f"--jobs {args.jobs} must be at least 1 process")
    _check_output(args.json, "--json")
    _check_output(args.csv, "--csv")
    _check_output(args.plot, "--plot")
    # Each output is a new file: one naming the trace, or another output, would overwrite it.
    named = [(flag, path) for flag, path in (("--trace", args.trace), ("--json", args.json),
                                              ("--csv", args.csv), ("--plot", args.plot)) if path]
    for i, (flag, path) in enumerate(named):
        for other, other_path in named[:i]:
            if os.path.realpath(path) == os.path.realpath(other_path):
                raise RadixKVError(f"{flag} {path!r} is the file {other} names too; the output would "
                                   f"overwrite it: give {flag} a path of its own")
    if args.plot is not None and args.plot.rsplit(".", 1)[-1].lower() not in _PLOT_FORMATS:
        raise RadixKVError(f"--plot {args.plot!r}: name the image with one of the extensions "
                           f"{', '.join('.' + f for f in _PLOT_FORMATS)}")
    if args.plot is not None:
        check_plot_backend()  # matplotlib is an optional extra: fail now, not after the sweep


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    try:
        return _main(args)
    except RadixKVError as e:
        print(f"radixkv sim: error: {e}", file=sys.stderr)
        return 2


def _main(args: argparse.Namespace) -> int:
    t0 = time.perf_counter()
    policies = [parse_policy_spec(s).label for s in args.policy.split(",") if s.strip()]
    if not policies:
        raise RadixKVError(f"--policy {args.policy!r} names no policy; give one or more, e.g. --policy lru,oddsref")
    if not any(c.strip() for c in args.capacity.split(",")):
        raise RadixKVError(f"--capacity {args.capacity!r} names no capacity; give one or more, e.g. --capacity 1%,5%")
    _check_args(args)
    if args.trace is not None:
        trace = read_trace(args.trace, block_tokens=args.block_tokens, limit=args.limit)
        source = args.trace
    else:
        name = args.workload or DEFAULT_WORKLOAD
        trace = generate(name, WorkloadConfig(requests=4000 if args.requests is None else args.requests,
                                              seed=0 if args.seed is None else args.seed,
                                              arrivals=args.arrivals or "burst",
                                              rate_per_s=4.0 if args.rate is None else args.rate,
                                              block_tokens=256 if args.block_tokens is None else args.block_tokens))
        source = f"workload {trace.name}"
    if not trace.requests:
        raise RadixKVError(f"{source}: no requests to replay")
    trace.check_prefix_closed()
    model = None if args.model in ("none", "") else parse_model(args.model)
    if args.overlap and model is None:
        print("note: --overlap only changes the TTFT estimate, and --model none skips it: --overlap does "
              "nothing here", file=sys.stderr)
    block_bytes = model.block_bytes(trace.block_tokens) if model else None
    unique = trace.unique_blocks
    capacity_texts = [c.strip() for c in args.capacity.split(",") if c.strip()]
    capacities = [parse_capacity(c, unique, block_bytes) for c in capacity_texts]
    # As a repeated --policy: the same points twice, and duplicate records. Compared parsed (5% and
    # 5.0%, 1828 and "1828 blocks" are one capacity), not as text.
    for i, c in enumerate(capacities):
        j = capacities.index(c)
        if j < i:
            a, b = capacity_texts[j], capacity_texts[i]
            if a == b:
                raise RadixKVError(f"--capacity names {a!r} twice; name each capacity once")
            what = f"{c.blocks:,} block{'s' * (c.blocks != 1)}" if c.fraction is None \
                else f"{c.fraction * 100:g}% of unique blocks"
            raise RadixKVError(f"--capacity names one capacity twice: {a!r} and {b!r} are both {what}; "
                               "name each capacity once")
    tiers = [_tier(t) for t in args.tiers.split(",") if t.strip()]
    if not tiers:
        raise RadixKVError("--tiers needs at least one tier name")
    seen_tiers: set[str] = set()
    for t in tiers:  # the tree refuses it too, but mid-sweep and without naming --tiers
        if t.name in seen_tiers:
            raise RadixKVError(f"--tiers names tier {t.name!r} twice; name each tier once, fastest first, e.g. "
                               "mem,disk=25%")
        seen_tiers.add(t.name)
    top = tiers[0]
    if top.capacity_text is not None:
        raise RadixKVError(f"--tiers: the first tier's capacity is --capacity; drop '={top.capacity_text}' "
                           f"from {top.name!r}")
    if top.policy is not None:
        raise RadixKVError(f"--tiers: the first tier's policy is the swept --policy; drop ':{top.policy.label}' "
                           f"from {top.name!r} and pass --policy {top.policy.label}")
    for t in tiers:
        if t.model is None and t.name not in DEFAULT_TIER_MODELS:
            raise RadixKVError(f"--tiers: tier {t.name!r} has no default bandwidth (known: "
                               f"{', '.join(sorted(DEFAULT_TIER_MODELS))}); give one, e.g. {t.name}@7 for 7 GB/s")
    lower = []
    for t in tiers[1:]:
        if t.capacity_text is None:
            raise RadixKVError(f"tier {t.name!r} needs a capacity: --tiers ...,{t.name}=25%")
        lower.append(LowerTier(t.name, t.capacity_text, t.model, t.policy))
    if args.write_policy is not None and not lower:
        print(f"note: --write-policy {args.write_policy} decides how blocks reach lower tiers, and --tiers gives "
              "one tier: it does nothing here", file=sys.stderr)
    # A capacity above the unique blocks is legal (the infinite cache), but usually a unit slip.
    checked = list(zip(capacity_texts, capacities))
    for lt in lower:
        try:
            checked.append((f"{lt.name}={lt.capacity_text}", parse_capacity(lt.capacity_text, unique, block_bytes)))
        except RadixKVError as e:  # say which tier: the message quotes only the capacity
            raise RadixKVError(f"--tiers: tier {lt.name!r}: {e}") from None
    for text, cap in checked:
        if cap.blocks > unique:
            print(f"note: capacity {text!r} is {cap.blocks:,} blocks, over 100% of the trace's {unique:,} unique "
                  "blocks: it never evicts (the infinite cache)", file=sys.stderr)
    if lower and "opt" in policies:
        policies = [p for p in policies if p != "opt"]
        if not policies:
            raise RadixKVError("--policy opt models a single tier and --tiers gives several: drop --tiers "
                               "for opt, or add online policies (e.g. --policy lru,oddsref)")
        print("note: opt models a single tier; left out with --tiers", file=sys.stderr)
    infinite = trace.infinite_hit_blocks() / max(trace.block_references, 1)
    points = run_sweep(
        trace, policies, capacities, top_tier=top.name, lower_tiers=lower, model=model,
        top_tier_model=top.model, overlap=args.overlap, jobs=args.jobs,
        progress=not args.no_progress and sys.stderr.isatty(),
        write_policy=args.write_policy or "write_through",
    )
    recs = records(points, infinite)
    title = (
        f"{source}: {len(trace):,} requests, {trace.block_references:,} block references, "
        f"{unique:,} unique blocks of {trace.block_tokens} tokens; infinite cache {infinite * 100:.2f}%"
        + (f"; model {model.name}" if model else "")
        + (f"; tiers {', '.join([top.name] + [t.name for t in lower])}, {args.write_policy or 'write_through'}"
           if lower else "")
    )
    print(format_table(recs, title))
    print("block/token hit: share of referenced blocks/tokens found cached (infinite cache: block hits, "
          "an upper bound); gap closed: share of the LRU-to-OPT gap at that capacity; TTFT: modelled "
          "(load the hit, prefill the rest); M acc/s: replay speed. docs/simulator.md, 'Outputs'.")
    if model is not None and not args.overlap:
        # (with --overlap a load hides behind the prefill beside it: such a tier may still be loaded)
        names = [t.name for t in tiers]
        for name, tm in zip(names, tier_models(top.name, top.model, lower)):
            if tm.always_recomputed(model):
                print(f"note: {name} loads at {tm.bandwidth_bytes_per_s / 1e9:g} GB/s, below the "
                      f"{model.kv_bytes_per_token * model.prefill_tokens_per_s / 1e9:.3g} GB/s at which loading "
                      f"beats prefill for {model.name}: the TTFT model recomputes every {name} hit (counted in "
                      "recomputed_tokens, no loaded bytes), so those hits do not lower TTFT")
    try:
        if args.json is not None:
            write_json(recs, args.json)
        if args.csv is not None:
            write_csv(recs, args.csv)
        if args.plot is not None:
            plot(points, infinite, args.plot, title=trace.name)
    except OSError as e:  # checked before the sweep, but the disk may fill or vanish meanwhile
        raise RadixKVError(f"cannot write {e.filename or 'an output file'}: {e.strerror or e}") from None
    print(f"({len(points)} points in {time.perf_counter() - t0:.1f} s)", file=sys.stderr)
    return 0
