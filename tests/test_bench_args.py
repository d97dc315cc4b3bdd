"""``python -m radixkv.bench NAME`` with bad arguments: a one-line usage error, never a traceback.

Each case was a ValueError / ZeroDivisionError / StatisticsError / RuntimeError / ConfigError
traceback (or, for bench sim, an error only after the baselines ran). Nothing here runs a benchmark,
but for the temp-directory tests at the end (one 1 MiB chunk, one repetition)."""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest

from radixkv.bench.__main__ import main


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["tree", "--pages", "abc"], "'abc'"),
        (["tree", "--pages", "16,0"], "'0' in '16,0'"),
        (["tree", "--seqs", "-1"], "--seqs: '-1'"),
        (["tree", "--convs", "0"], "--convs: '0'"),
        (["tiers", "--sizes-mib", "abc"], "--sizes-mib: 'abc'"),
        (["tiers", "--sizes-mib", "0"], "--sizes-mib: '0'"),
        (["tiers", "--reps", "0"], "--reps: '0'"),
        (["tiers", "--torch-threads", "0"], "--torch-threads: '0'"),
        (["tiers", "--io-threads", "0"], "--io-threads: '0'"),
        (["tiers", "--disk-overlap-mib", "-1"], "--disk-overlap-mib -1"),
        (["store", "--sizes-mib", "0"], "--sizes-mib: '0'"),
        (["store", "--batch", "0"], "--batch: '0'"),
        (["store", "--reps", "0"], "--reps: '0'"),
        # sglang: checked before SGLang is imported (they were an IndexError, a ZeroDivisionError,
        # an empty min() after every round ran, and SGLang's own ValueError)
        (["sglang", "--pages", "0"], "--pages: '0'"),
        (["sglang", "--page-size", "0"], "--page-size: '0'"),
        (["sglang", "--rounds", "0"], "--rounds: '0'"),
        (["sglang", "--disk-io-threads", "0"], "--disk-io-threads: '0'"),
        (["sglang", "--layers", "x"], "--layers: 'x'"),
        (["tiers", "--batch-mib", "0"], "--batch-mib: '0'"),
        (["tiers", "--tiers", ","], "--tiers ',' names no tier"),  # measured nothing, exit 0
        # kernels: --threads 0 / -5 were clamped to 1 silently; a bad device was a RuntimeError (or
        # for meta a misleading aliasing error) after a banner saying "on CPU"
        (["kernels", "--threads", "0"], "--threads: '0'"),
        (["kernels", "--threads", "-5"], "--threads: '-5'"),
        (["kernels", "--device", "foo"], "--device: 'foo' is not a device"),
        (["kernels", "--device", "meta"], "--device: 'meta' is not a device"),
        (["kernels", "--device", "cuda:x"], "--device: 'cuda:x' is not a device"),
        # vllm: checked before vLLM is imported
        (["vllm", "--repeats", "0"], "--repeats: '0'"),
        (["vllm", "--block", "0"], "--block: '0'"),
        (["vllm", "--chunks", "-1"], "--chunks: '-1'"),
        (["vllm", "--chunk-tokens", "0"], "--chunk-tokens: '0'"),
        (["vllm", "--chunk-tokens", "24", "--block", "16"], "--chunk-tokens 24 is not a multiple of --block 16"),
    ],
)
def test_bad_counts_and_sizes_are_usage_errors(argv, named, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and "Traceback" not in err and named in err, err


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["--reps", "0"], "--reps: '0'"),  # statistics.StatisticsError after the server started
        (["--batch-mib", "0"], "--batch-mib: '0'"),
        (["--sizes-mib", "0"], "'0' must be a number > 0"),  # ZeroDivisionError
        (["--sizes-mib", "x"], "'x' must be a number > 0"),  # ValueError traceback
    ],
)
def test_redis_tier_bench_bad_arguments_are_usage_errors(argv, named, capsys):
    pytest.importorskip("redis")
    from radixkv.bench._redis_tier import main as redis_main

    with pytest.raises(SystemExit) as e:
        redis_main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and "Traceback" not in err and named in err, err


def _refused_url() -> str:
    """A loopback port nothing listens on (connections are refused at once)."""
    import socket

    with socket.socket() as s:  # bound but never listening: connecting is refused
        s.bind(("127.0.0.1", 0))
        return f"redis://127.0.0.1:{s.getsockname()[1]}"


def test_bench_tiers_with_an_unreachable_redis_url_says_so_before_any_row(capsys):
    """It ran the other rows, then ended in `AssertionError: tier put failed` (the tier turns a down
    server into failed puts by design)."""
    pytest.importorskip("redis")
    url = _refused_url()
    with pytest.raises(SystemExit) as e:
        main(["tiers", "--tiers", "memory,redis", "--sizes-mib", "0.001", "--reps", "1", "--redis-url", url])
    captured = capsys.readouterr()
    assert e.value.code == 2 and "cannot reach the Redis server" in captured.err and url in captured.err
    assert "| memory |" not in captured.out  # checked before the memory rows ran
    from radixkv.bench._redis_tier import main as redis_main

    assert redis_main(["--url", url, "--sizes-mib", "0.001", "--reps", "1"]) == 2
    assert "cannot reach the Redis server" in capsys.readouterr().err


def test_bench_vllm_without_vllm_prints_a_hint(capsys):
    import importlib.metadata

    try:
        importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        pass
    else:
        pytest.skip("vllm is installed here")
    with pytest.raises(SystemExit) as e:  # was a ModuleNotFoundError traceback
        main(["vllm", "--repeats", "1"])
    assert "vllm==0.33.0 is not installed here" in str(e.value.code)
    assert "setup_vllm_env.sh" in str(e.value.code)


def test_bench_sim_bad_policy_fails_before_any_run(capsys):
    assert main(["sim", "--trace", "/nonexistent.jsonl", "--policy", "lru,nosuch"]) == 2
    captured = capsys.readouterr()
    assert "'nosuch'" in captured.err and "dict-lru" not in captured.out


def test_bench_sim_bad_capacity_is_one_line(tmp_path, capsys):
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"hash_ids": [1, 2], "input_length": 1000}\n')
    assert main(["sim", "--trace", str(trace), "--capacity", "abc"]) == 2
    captured = capsys.readouterr()
    assert "python -m radixkv.bench sim: error: capacity 'abc'" in captured.err and "dict-lru" not in captured.out


def test_bench_sim_repeat_must_be_positive(tmp_path, capsys):
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"hash_ids": [1, 2], "input_length": 1000}\n')
    assert main(["sim", "--trace", str(trace), "--repeat", "0"]) == 2
    captured = capsys.readouterr()
    assert "--repeat 0" in captured.err and "dict-lru" not in captured.out


def test_bench_sim_prints_one_row_per_policy_and_capacity_whatever_the_repeats(tmp_path, capsys):
    # the fastest of --repeat runs per row, not a row per run
    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(f'{{"hash_ids": [0, {2 * i + 1}, {2 * i + 2}], "input_length": 1536}}\n'
                             for i in range(20)))
    assert main(["sim", "--trace", str(trace), "--policy", "lru,opt", "--capacity", "10%,50%",
                 "--repeat", "2"]) == 0
    rows = [line.split()[:2] for line in capsys.readouterr().out.splitlines()
            if line.split()[:1] in (["dict-lru"], ["lru"], ["opt"], ["opt+table"])]
    assert rows == [[label, cap] for cap in ("10%", "50%") for label in ("dict-lru", "lru", "opt", "opt+table")]


def test_bench_sim_says_which_machine_it_timed(tmp_path, capsys):
    # rates differ by up to ~2x between machines: the output names the CPU and the CPU count
    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(f'{{"hash_ids": [0, {i + 1}], "input_length": 1024}}\n' for i in range(10)))
    assert main(["sim", "--trace", str(trace), "--policy", "lru", "--capacity", "50%", "--repeat", "1"]) == 0
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("machine: ")]
    assert len(lines) == 1 and f"{os.cpu_count()} cpus" in lines[0], lines


def test_bench_sim_missing_trace_is_an_error_not_another_workload(tmp_path, capsys):
    # It printed a note and timed the synthetic mix workload instead: numbers read as the trace's.
    missing = tmp_path / "typo.jsonl"
    assert main(["sim", "--trace", str(missing), "--policy", "lru", "--capacity", "1%"]) == 2
    captured = capsys.readouterr()
    assert f"--trace '{missing}' is not a file" in captured.err and "dict-lru" not in captured.out


# --- temp directories: "default: a temp dir" is removed when the run ends, as bench tiers and bench
# sglang did; bench store left its chunk files (a default run: 144 MiB in /tmp per run) and the Redis
# rows their redis-server's directory.

def _bench_temp_dirs(root) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.name.startswith("radixkv-bench-"))


def test_bench_store_removes_the_temp_dir_it_made(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    assert main(["store", "--sizes-mib", "1", "--batch", "1", "--reps", "1"]) == 0
    assert "disk" in capsys.readouterr().out
    assert _bench_temp_dirs(tmp_path) == []
    given = tmp_path / "given"  # a --disk-dir of the caller's is left as it is
    assert main(["store", "--sizes-mib", "1", "--batch", "1", "--reps", "1", "--disk-dir", str(given)]) == 0
    assert given.is_dir()


@pytest.mark.redis
@pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs redis-server")
@pytest.mark.parametrize("bench", ["tiers", "_redis_tier"])
def test_bench_redis_rows_remove_their_server_dir(bench, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    args = ["--sizes-mib", "1", "--batch-mib", "1", "--reps", "1"]
    if bench == "tiers":
        assert main(["tiers", "--tiers", "redis", *args]) == 0
    else:
        from radixkv.bench._redis_tier import main as redis_main

        assert redis_main(args) == 0
    assert "| 1 MiB | 1 | get |" in capsys.readouterr().out.replace("| redis ", "")  # the rows ran
    assert _bench_temp_dirs(tmp_path) == []
