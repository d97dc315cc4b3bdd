"""A disk tier's root that holds more than the tier's own files (a misconfigured ``/``, a data disk's
mount point, a home directory): the tier reads, removes and replaces only names of its layout, and
says that the root is not its own. Also the modes of the directories a tier makes, and bad roots."""

from __future__ import annotations

import logging
import os
import stat
import time

import pytest
import torch

from radixkv.errors import ConfigError
from radixkv.tiers.disk import DiskTier
from radixkv.tiers.disk_layout import DiskLayout
from radixkv.tiers.registry import make_tier

KiB = 1 << 10
NS = "0123456789abcdef0123456789abcdef"


def pl(seed: int, nbytes: int = 4 * KiB) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)


def _tree(root: str) -> set[str]:
    """Every file, link and directory under ``root`` (relative paths; links not followed)."""
    out = set()
    for d, dirs, files in os.walk(root):
        for n in dirs + files:
            out.add(os.path.relpath(os.path.join(d, n), root))
    return out


def _write(path: str, data: str = "not a chunk") -> str:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(data)
    return path


@pytest.mark.parametrize("shared", [False, True], ids=["private", "shared"])
def test_a_start_on_a_populated_root_removes_nothing_that_is_not_the_tiers(tmp_path, caplog, shared):
    """Found by an audit: a private tier opened on a directory holding other files deleted some of
    them at start, silently: every ``.*.tmp`` at any depth (an editor's buffer, a file in ``.git``),
    every link directly under the root named as a namespace could be (``bin -> usr/bin``), and every
    ``*.kv`` at any depth below a namespace-named directory (``srv/models/weights.kv``, dot
    directories included) that was no valid frame. The tier's own leftovers still go."""
    root = str(tmp_path / "populated")
    os.makedirs(root, mode=0o700)
    os.chmod(root, 0o700)
    foreign = [
        _write(f"{root}/home/alice/project/.notes.tmp"),  # someone's temp files
        _write(f"{root}/home/alice/project/.git/.COMMIT_EDITMSG.swp.tmp"),
        _write(f"{root}/.bashrc.tmp"),
        _write(f"{root}/.k0.1.2.abc.tmp.bak"),
        _write(f"{root}/srv/models/weights.kv"),  # .kv files: not at a chunk's place
        _write(f"{root}/data/.cache/x.y/not.a.key.kv"),
        _write(f"{root}/models/ab/cd/ef/k.kv"),  # two-hex directories, but one level too deep
        _write(f"{root}/models/zz/k.kv"),  # a key-named .kv in a directory of another shape
        _write(f"{root}/models/ab/.k.1.2.abc.tmp/keep"),  # a directory named like a temp file
        _write(f"{root}/.retired.mine"),  # no name detach_ns_dirs makes
        _write(f"{root}/{NS}/ab/notes.txt"),  # other names beside chunk files
        _write(f"{root}/{NS}/ab/.hidden.kv"),
        _write(f"{root}/{NS}/README"),
    ]
    os.makedirs(f"{root}/usr/bin")
    os.symlink("usr/bin", f"{root}/bin")  # a link a namespace could be named as, no put names it
    # The tier's own leftovers of a process killed mid-write (private: all removed at start;
    # shared: only those older than stale_temp_s, so age them).
    t = DiskTier(root=root, capacity_bytes=1 << 20, shared=shared)
    assert t.put_many(NS, ["k0", "k1"], [pl(0), pl(1)]) == [True, True]
    t.close()
    chunk_dir = os.path.dirname(DiskLayout(root, "disk").path(NS, "k0"))
    own = [_write(f"{chunk_dir}/.k0.999.140.1a2b3c4d.tmp", "partial"),
           _write(f"{root}/.probe.999.1a2b3c4d.tmp", "\0"),
           _write(f"{root}/.clock.999.140.1a2b3c4d.tmp", "\0")]
    old = time.time() - 3600
    for p in own:
        os.utime(p, (old, old))
    if not shared:
        retired = f"{root}/.retired.{NS}.1a2b3c4d"
        os.makedirs(f"{retired}/00")
        own.append(retired)
    before = _tree(root)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="radixkv"):
        t = DiskTier(root=root, capacity_bytes=1 << 20, shared=shared)
    try:
        after = _tree(root)
        removed = before - after
        assert not [p for p in foreign if not os.path.exists(p)], removed
        assert os.path.islink(f"{root}/bin") and os.path.isdir(f"{root}/usr/bin")
        assert not [p for p in own if os.path.exists(p)], "the tier's own leftovers stay"
        assert t.stats().extra["temp_removed"] == 3 and t.stats().extra["scan_skipped"] == 0
        assert t.contains_many(NS, ["k0", "k1"]) == 2
        out = torch.zeros(4 * KiB, dtype=torch.uint8)
        assert t.get_many(NS, ["k1"], [out]) == [True] and torch.equal(out, pl(1))
        warned = [r.getMessage() for r in caplog.records if "not the tier's" in r.getMessage()]
        if shared:  # a shared directory is not the tier's alone by design: nothing to say
            assert not warned
        else:
            assert len(warned) == 1 and "bin" in warned[0] and "should be a directory of its own" in warned[0]
        t.clear()  # a clear of the whole tier removes chunk files only
        assert not [p for p in foreign if not os.path.exists(p)]
        assert t.contains_many(NS, ["k0"]) == 0
        t.check_integrity()
    finally:
        t.close()


def test_a_tier_of_its_own_root_warns_of_nothing(tmp_path, caplog):
    root = str(tmp_path / "disk")
    t = DiskTier(root=root, capacity_bytes=1 << 20)
    t.put_many(NS, ["a", "b"], [pl(1), pl(2)])
    t.delete_many(NS, ["a"])  # a spare file
    t.close()
    with caplog.at_level(logging.WARNING, logger="radixkv"):
        t = DiskTier(root=root, capacity_bytes=1 << 20)
    t.close()
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text


def test_a_killed_writers_temp_files_in_the_older_layout_go_too(tmp_path):
    """The older two-level layout's files (``<ns>/<hh>/<hh>/<key>.kv``) and its temp files are
    the tier's own: a private start removes them (docs/tiers.md "Upgrades")."""
    root = str(tmp_path / "disk")
    t = DiskTier(root=root, capacity_bytes=1 << 20)
    t.put_many(NS, ["a"], [pl(1)])
    t.close()
    deeper = os.path.join(os.path.dirname(DiskLayout(root, "disk").path(NS, "a")), "cd")
    old_file = _write(f"{deeper}/b.kv", "an old frame")
    old_temp = _write(f"{deeper}/.b.12.34.deadbeef.tmp", "partial")
    t = DiskTier(root=root, capacity_bytes=1 << 20)
    try:
        assert not os.path.exists(old_file) and not os.path.exists(old_temp) and not os.path.exists(deeper)
        assert t.stats().extra["temp_removed"] == 1 and t.contains_many(NS, ["a"]) == 1
    finally:
        t.close()


@pytest.mark.parametrize("fsync", [False, True], ids=["no-fsync", "fsync"])
def test_every_directory_a_tier_makes_is_0700_whatever_the_umask(tmp_path, fsync):
    """Found by an audit: ``os.makedirs(root, mode=0o700)`` gave only the last directory that mode;
    the missing parents got 0777 less the umask (0777 under umask 0)."""
    base = tmp_path / "modes"
    root = base / "sub" / "deeper" / "root"
    old = os.umask(0)
    try:
        t = DiskTier(root=str(root), capacity_bytes=1 << 20, fsync=fsync)
        try:
            assert t.put_many(NS, ["a", "b"], [pl(1), pl(2)]) == [True, True]
            t.delete_many(NS, ["a"])
            assert t.put_many(NS, ["c"], [pl(3)]) == [True]
        finally:
            t.close()
    finally:
        os.umask(old)
    opened = []
    for d, dirs, files in os.walk(base):
        for n in dirs + files:
            p = os.path.join(d, n)
            mode = stat.S_IMODE(os.lstat(p).st_mode)
            if mode & 0o077:
                opened.append((os.path.relpath(p, base), oct(mode)))
    assert not opened
    for d in (base / "sub", base / "sub" / "deeper", root):
        assert stat.S_IMODE(os.stat(d).st_mode) == 0o700, d


def test_a_root_below_a_file_is_a_config_error(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match="not writable"):
        DiskTier(root=str(tmp_path / "file" / "a" / "b"), capacity_bytes=1 << 20)


@pytest.mark.parametrize("how", ["url", "config"])
def test_a_nul_in_the_root_is_a_config_error(tmp_path, how):
    """Found by an audit: os.stat's ValueError ("embedded null byte") came out of make_tier."""
    with pytest.raises(ConfigError, match="NUL"):
        if how == "url":
            make_tier(f"file://{tmp_path}/x%00y?capacity=1MiB")
        else:
            DiskTier(root=f"{tmp_path}/x\0y", capacity_bytes=1 << 20)
