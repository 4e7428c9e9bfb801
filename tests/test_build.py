"""Kernel builds that never hang and say what they do (issue 28 §3): torchnext._build and the two extensions on it.

A fake compiler (a shell script) stands in for the real one, so every behaviour is checked in milliseconds: the
start/end lines, the compiler and lock timeouts and the fallback they lead to, one translation unit per core,
pruning, and the lock without ``fcntl``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from torchnext import _build as common
from torchnext.lowp.cpu import _build as cpu_build

pytestmark = pytest.mark.skipif(os.name != "posix", reason="the fake compilers are POSIX shell scripts")

_FAKE_CXX = """#!/bin/sh
# a stand-in compiler: --version answers; otherwise create the -o file (after SLEEP seconds)
if [ "$1" = "--version" ]; then echo "fakecc 1.0"; exit 0; fi
sleep "${FAKE_SLEEP:-0}"
out=""
while [ $# -gt 0 ]; do
  if [ "$1" = "-o" ]; then out="$2"; fi
  shift
done
[ -n "$FAIL" ] && { echo "fake error: $FAIL"; exit 3; }
: > "$out"
"""


@pytest.fixture
def fake_cxx(tmp_path: Path) -> Path:
    path = tmp_path / "fakecc"
    path.write_text(_FAKE_CXX)
    path.chmod(0o755)
    return path


def test_a_build_says_when_it_starts_and_ends(fake_cxx: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cache = tmp_path / "cache"
    res = cpu_build.build(cache, str(fake_cxx), timeout_s=30)
    err = capsys.readouterr().err.splitlines()
    assert res.built and res.library.exists() and res.compiler == "fakecc 1.0"
    assert len(err) == 2, err
    assert err[0].startswith("torchnext: building torchnext's C++ CPU kernels (first use with torch ")
    assert f"about 60 s, once: cached in {res.library.parent})" in err[0]
    assert err[1].startswith("torchnext: built torchnext's C++ CPU kernels in ") and str(res.library.parent) in err[1]
    # the second time: from the cache, silently; the start line now quotes the time measured here
    again = cpu_build.build(cache, str(fake_cxx), timeout_s=30)
    assert not again.built and capsys.readouterr().err == ""
    seconds = json.loads((res.library.parent / "build.json").read_text())["seconds"]
    assert common.typical_seconds(cache, cpu_build.LIBRARY_NAME, 60.0) == seconds


def test_a_failing_compiler_is_reported_on_the_end_line(fake_cxx: Path, tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("FAIL", "no such header")
    with pytest.raises(RuntimeError, match="exited with 3:\nfake error: no such header"):
        cpu_build.build(tmp_path / "cache", str(fake_cxx), timeout_s=30)
    err = capsys.readouterr().err
    assert "torchnext: building torchnext's C++ CPU kernels failed after" in err and "exited with 3" in err


def test_a_hung_compiler_is_killed_and_the_kernels_fall_back(fake_cxx: Path, tmp_path: Path) -> None:
    """Through status()'s own path in a fresh process: unavailable with the reason, a warning, well within 30 s."""
    code = ("import torchnext.lowp.cpu as c, time; t = time.monotonic(); s = c.status(); "
            "print('RESULT', s.available, round(time.monotonic() - t, 1), '|', s.reason)")
    env = {**os.environ, "TORCHNEXT_CXX": str(fake_cxx), "FAKE_SLEEP": "61.5", "TORCHNEXT_BUILD_TIMEOUT": "2",
           "TORCHNEXT_KERNEL_CACHE": str(tmp_path / "cache")}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    line = next(ln for ln in out.stdout.splitlines() if ln.startswith("RESULT"))
    _, available, seconds, _ = line.split(" ", 3)
    assert available == "False" and float(seconds) < 20, line
    assert "ran past 2 s (TORCHNEXT_BUILD_TIMEOUT); killed" in line
    assert "build failed, using the pure-torch paths" in out.stderr
    assert "torchnext: building torchnext's C++ CPU kernels failed after" in out.stderr
    assert not _running("sleep 61.5"), "the hung compiler was left running"


def test_a_hung_compiler_leaves_process_groups_on_the_python_path(fake_cxx: Path, tmp_path: Path) -> None:
    """The native extension's compile (ninja under a child process) is bounded the same way, ninja and the compiler
    under it killed with it."""
    code = ("from torchnext.comms import native; import time; t = time.monotonic(); s = native.status(); "
            "print('RESULT', s.available, round(time.monotonic() - t, 1), '|', s.reason)")
    env = {**os.environ, "TORCHNEXT_CXX": str(fake_cxx), "CXX": str(fake_cxx), "FAKE_SLEEP": "62.5",
           "TORCHNEXT_BUILD_TIMEOUT": "4", "TORCHNEXT_KERNEL_CACHE": str(tmp_path / "cache")}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=90)
    line = next((ln for ln in out.stdout.splitlines() if ln.startswith("RESULT")), out.stdout + out.stderr)
    assert line.startswith("RESULT False"), line
    assert "ran past 4 s (TORCHNEXT_BUILD_TIMEOUT); killed" in line, line
    assert float(line.split()[2]) < 30, line
    assert "torchnext: building torchnext's native process-group extension (first use" in out.stderr
    assert not _running("sleep 62.5"), "the hung compiler was left running"


def _running(pattern: str) -> list[str]:
    time.sleep(0.2)
    return subprocess.run(["pgrep", "-f", pattern], capture_output=True, text=True).stdout.split()


def test_another_processs_hung_build_is_waited_for_only_so_long(fake_cxx: Path, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    cache.mkdir()
    key = cpu_build.cache_key("fakecc 1.0")
    holder = subprocess.Popen([sys.executable, "-c", (
        "import fcntl, sys, time; f = open(sys.argv[1], 'a'); fcntl.flock(f, fcntl.LOCK_EX); print('held', flush=True); "
        "time.sleep(60)"), str(cache / f".{cpu_build.LIBRARY_NAME}-{key}.lock")], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        t0 = time.monotonic()
        with pytest.raises(common.BuildTimeout, match=r"another process held the build lock .* for 1 s"):
            cpu_build.build(cache, str(fake_cxx), timeout_s=1.0)
        assert time.monotonic() - t0 < 5.0
    finally:
        holder.kill()
        holder.wait(timeout=10)
    assert cpu_build.build(cache, str(fake_cxx), timeout_s=5.0).built  # free again: it builds


def test_at_most_one_translation_unit_per_core(tmp_path: Path) -> None:
    """Each command takes a directory as a mutex (mkdir fails when it exists): with one job at a time none fails;
    three at once do collide (the check can fail)."""
    gate = tmp_path / "busy"
    cmd = ["sh", "-c", f"mkdir {gate} || exit 7; sleep 0.3; rmdir {gate}"]
    common.run_commands([cmd] * 3, timeout_s=30, max_jobs=1)
    with pytest.raises(RuntimeError, match="exited with 7"):
        common.run_commands([cmd] * 3, timeout_s=30, max_jobs=3)
    assert common.jobs() == len(os.sched_getaffinity(0))


def _fake_build(cache: Path, name: str, days_ago: float) -> Path:
    folder = cache / name
    folder.mkdir(parents=True)
    marker = folder / "build.json"
    marker.write_text(json.dumps({"seconds": 1.0}))
    t = time.time() - days_ago * 86400
    os.utime(marker, (t, t))
    return folder


def test_builds_unused_for_long_are_pruned_others_kept(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    old = _fake_build(cache, "torchnext_cpu-aaaa", 40)
    old_native = _fake_build(cache, "torchnext_native-bbbb", 31)
    recent = _fake_build(cache, "torchnext_cpu-cccc", 3)
    busy = _fake_build(cache, "torchnext_cpu-dddd", 90)
    current = _fake_build(cache, "torchnext_cpu-eeee", 100)
    (cache / "unrelated").mkdir()  # no build.json: not ours
    done = threading.Event()
    release = threading.Event()

    def hold() -> None:
        with common.build_lock(cache / f".{busy.name}.lock", timeout_s=5):
            done.set()
            release.wait(10)

    t = threading.Thread(target=hold)
    t.start()
    done.wait(5)
    try:
        removed = common.prune(cache, keep=current, days=30)
    finally:
        release.set()
        t.join(10)
    assert sorted(removed) == sorted([old, old_native])
    assert not old.exists() and not old_native.exists()
    assert recent.exists() and busy.exists() and current.exists() and (cache / "unrelated").exists()
    assert common.prune(cache, keep=current, days=0) == []


def test_a_cache_hit_counts_as_a_use(fake_cxx: Path, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    res = cpu_build.build(cache, str(fake_cxx), timeout_s=30)
    marker = res.library.parent / "build.json"
    os.utime(marker, (0, 0))
    cpu_build.build(cache, str(fake_cxx), timeout_s=30)
    assert marker.stat().st_mtime > time.time() - 60


def test_the_lock_works_without_fcntl(fake_cxx: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(common, "fcntl", None)
    lock = tmp_path / "x.lock"
    with common.build_lock(lock, timeout_s=1):
        assert lock.read_text() == str(os.getpid())
        with pytest.raises(common.BuildTimeout, match="another process held the build lock"):
            with common.build_lock(lock, timeout_s=0.2):
                pass
    assert not lock.exists()
    # a lock file left by a process that died is taken over
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    lock.write_text(str(dead.pid))
    with common.build_lock(lock, timeout_s=1):
        assert lock.read_text() == str(os.getpid())
    # and a whole build goes through it
    assert cpu_build.build(tmp_path / "cache", str(fake_cxx), timeout_s=30).built


def test_bad_build_settings_are_named(monkeypatch: pytest.MonkeyPatch) -> None:
    from torchnext._config import env_config

    monkeypatch.setenv("TORCHNEXT_BUILD_TIMEOUT", "0")
    with pytest.raises(ValueError, match=r"TORCHNEXT_BUILD_TIMEOUT=0 must be >= 1 \(seconds\)"):
        env_config()
    monkeypatch.setenv("TORCHNEXT_BUILD_TIMEOUT", "5")
    monkeypatch.setenv("TORCHNEXT_KERNEL_CACHE_KEEP_DAYS", "-1")
    with pytest.raises(ValueError, match="TORCHNEXT_KERNEL_CACHE_KEEP_DAYS=-1 must be >= 0"):
        env_config()
