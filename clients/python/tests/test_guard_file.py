"""Guard with the signal file: starting values, cheap refresh, and robustness to every bad file."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import List

import pytest

import memguard_client.guard as guard_mod
from conftest import age, signal_dict, write_atomic
from memguard_client import Guard


def test_without_env_or_sidecar_it_is_a_no_op_with_constructor_defaults() -> None:
    g = Guard(env={}, batch_size=16, grad_accumulation=2)
    assert not g.enabled
    assert (g.batch_size, g.grad_accumulation, g.grad_checkpointing) == (16, 2, False)
    assert (g.level, g.seq, g.signal) == ("ok", -1, None)
    for _ in range(3):
        assert g.refresh() is False
    assert g.report(step=1) is False
    assert g.batch_size == 16


def test_starting_values_come_from_memguard_env_over_constructor_defaults() -> None:
    env = {
        "MEMGUARD_BATCH_SIZE": "4",
        "MEMGUARD_GRAD_ACCUMULATION": "8",
        "MEMGUARD_GRAD_CHECKPOINTING": "true",
    }
    g = Guard(env=env, batch_size=32, grad_accumulation=1)
    assert (g.batch_size, g.grad_accumulation, g.grad_checkpointing) == (4, 8, True)
    assert g.effective_batch == 32


@pytest.mark.parametrize("bad", ["", "zero", "0", "-3", "1.5"])
def test_bad_env_values_fall_back_to_defaults(bad: str) -> None:
    g = Guard(env={"MEMGUARD_BATCH_SIZE": bad, "MEMGUARD_GRAD_CHECKPOINTING": "maybe"}, batch_size=7)
    assert g.batch_size == 7 and g.grad_checkpointing is False


def test_signal_file_comes_from_env_and_explicit_empty_disables_it(signal_path: Path) -> None:
    write_atomic(signal_path, signal_dict(0, batch=32, accum=1))
    g = Guard(env={"MEMGUARD_SIGNAL_FILE": str(signal_path)})
    assert g.signal_file == str(signal_path)
    assert g.refresh() and g.batch_size == 32
    off = Guard(signal_file="", env={"MEMGUARD_SIGNAL_FILE": str(signal_path)})
    assert not off.enabled and off.refresh() is False


def test_follows_a_downgrade_and_reports_true_once(signal_path: Path) -> None:
    write_atomic(signal_path, signal_dict(0, batch=32, accum=1))
    g = Guard(signal_file=str(signal_path), env={})
    assert g.refresh() is True
    assert g.refresh() is False
    write_atomic(signal_path, signal_dict(1, batch=16, accum=2, level="downgrade"))
    assert g.refresh() is True
    assert (g.batch_size, g.grad_accumulation, g.level, g.seq) == (16, 2, "downgrade", 1)
    assert g.seen_at is not None and abs(g.seen_at - time.time()) < 5
    assert g.refresh() is False


def test_missing_file_keeps_starting_values_then_picks_up_the_file(signal_path: Path) -> None:
    g = Guard(signal_file=str(signal_path), env={"MEMGUARD_BATCH_SIZE": "12"})
    assert g.refresh() is False and g.batch_size == 12
    write_atomic(signal_path, signal_dict(0, batch=6, accum=2))
    assert g.refresh() is True and g.batch_size == 6
    signal_path.unlink()
    assert g.refresh() is False and g.batch_size == 6  # a vanished file keeps the last values


@pytest.mark.parametrize(
    "content",
    [b"", b"{", b"\x00\x01\x02", b"not json at all", json.dumps(signal_dict(5, version=2)).encode()],
)
def test_garbage_or_wrong_version_is_ignored_and_the_next_good_file_applies(
    signal_path: Path, content: bytes
) -> None:
    write_atomic(signal_path, signal_dict(0, batch=8, accum=1))
    g = Guard(signal_file=str(signal_path), env={})
    assert g.refresh()
    write_atomic(signal_path, content)
    assert g.refresh() is False
    assert (g.batch_size, g.seq) == (8, 0)
    write_atomic(signal_path, signal_dict(1, batch=4, accum=2))
    assert g.refresh() is True and g.batch_size == 4


def test_a_directory_or_an_oversized_file_is_ignored(tmp_path: Path) -> None:
    d = tmp_path / "dir"
    d.mkdir()
    assert Guard(signal_file=str(d), env={}).refresh() is False
    big = tmp_path / "big.json"
    sig = signal_dict(1, reason="x" * (guard_mod.MAX_SIGNAL_BYTES + 10))
    big.write_text(json.dumps(sig))
    g = Guard(signal_file=str(big), env={"MEMGUARD_BATCH_SIZE": "3"})
    assert g.refresh() is False and g.batch_size == 3


def test_seq_never_goes_backwards(signal_path: Path) -> None:
    write_atomic(signal_path, signal_dict(5, batch=4, accum=8))
    g = Guard(signal_file=str(signal_path), env={})
    assert g.refresh()
    write_atomic(signal_path, signal_dict(3, batch=32, accum=1))
    assert g.refresh() is False
    assert (g.seq, g.batch_size) == (5, 4)


def test_half_written_file_from_a_non_atomic_writer_is_never_applied(signal_path: Path) -> None:
    """A writer that writes in place (not what the sidecar does): the reader sees half a file."""
    write_atomic(signal_path, signal_dict(0, batch=8, accum=1))
    g = Guard(signal_file=str(signal_path), env={})
    assert g.refresh()
    data = json.dumps(signal_dict(1, batch=2, accum=4)).encode()
    with open(signal_path, "r+b") as f:
        f.truncate(0)
        f.write(data[: len(data) // 2])
        f.flush()
        assert g.refresh() is False  # half a file: ignored, no exception
        assert g.batch_size == 8
        f.write(data[len(data) // 2 :])
        f.flush()
    assert g.refresh() is True and g.batch_size == 2


def test_unchanged_file_costs_one_stat_and_no_read(signal_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write_atomic(signal_path, signal_dict(0))
    age(signal_path)
    opens: List[str] = []
    real_open = open

    def counting_open(*args, **kwargs):  # type: ignore[no-untyped-def]
        opens.append(str(args[0]))
        return real_open(*args, **kwargs)

    monkeypatch.setattr(guard_mod, "open", counting_open, raising=False)
    g = Guard(signal_file=str(signal_path), env={})
    assert g.refresh()
    for _ in range(2000):
        assert g.refresh() is False
    assert len(opens) == 1
    write_atomic(signal_path, signal_dict(1))
    assert g.refresh() is True
    assert len(opens) == 2


def test_racy_rewrite_with_same_size_and_reused_inode_is_not_missed(
    signal_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two replaces within the file system's timestamp granularity, same size, the same inode
    number reused: the stat key does not change, yet the second signal must be picked up."""
    write_atomic(signal_path, signal_dict(1, batch=8))
    g = Guard(signal_file=str(signal_path), env={})
    assert g.refresh() and g.seq == 1
    st = os.stat(signal_path)
    key = (st.st_mtime_ns, st.st_size, st.st_ino, st.st_dev)
    write_atomic(signal_path, signal_dict(2, batch=4))  # same length: seq 1 -> 2, 8 -> 4
    os.utime(signal_path, ns=(st.st_atime_ns, st.st_mtime_ns))
    real_stat = os.stat

    class Same:
        st_mtime_ns, st_size, st_ino, st_dev = key

    monkeypatch.setattr(
        guard_mod.os, "stat", lambda p, *a, **k: Same if p == str(signal_path) else real_stat(p, *a, **k)
    )
    assert g.refresh() is True and (g.seq, g.batch_size) == (2, 4)


def test_concurrent_atomic_replace_never_tears_never_raises_never_goes_back(
    signal_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A writer thread replaces the file thousands of times while the reader refreshes."""
    writes = 3000
    parsed_none: List[bytes] = []
    real_parse = guard_mod.parse_signal

    def checking_parse(data):  # type: ignore[no-untyped-def]
        sig = real_parse(data)
        if sig is None:
            parsed_none.append(data)
        return sig

    monkeypatch.setattr(guard_mod, "parse_signal", checking_parse)
    write_atomic(signal_path, signal_dict(0, batch=1, accum=2))
    g = Guard(signal_file=str(signal_path), env={})
    done = threading.Event()
    errors: List[BaseException] = []

    def writer() -> None:
        try:
            for seq in range(1, writes + 1):
                # Sizes vary with seq, and batch/accum encode seq so a mixed read is detectable.
                write_atomic(signal_path, signal_dict(seq, batch=seq + 1, accum=seq + 2, reason="r" * (seq % 50)))
        except BaseException as err:  # pragma: no cover - reported below
            errors.append(err)
        finally:
            done.set()

    t = threading.Thread(target=writer)
    t.start()
    seen: List[int] = []
    refreshes = 0
    while not done.is_set() or refreshes < 5000:
        if g.refresh():
            assert g.batch_size == g.seq + 1 and g.grad_accumulation == g.seq + 2
            seen.append(g.seq)
        refreshes += 1
        if refreshes > 2_000_000:
            break
    t.join()
    g.refresh()
    if g.signal is not None and (not seen or seen[-1] != g.seq):
        seen.append(g.seq)
    assert not errors
    assert parsed_none == [], "the reader saw a torn or partial file"
    assert seen == sorted(set(seen)), "seq went backwards or repeated"
    assert g.seq == writes, "the last signal was missed"
    assert refreshes >= 5000 and len(seen) > 10


def test_a_restarted_trainer_starts_from_the_sticky_signal_before_its_first_step(
    signal_path: Path,
) -> None:
    # The sidecar wrote a sticky downgrade after the previous start died; the env still says 8.
    write_atomic(signal_path, signal_dict(5, batch=4, accum=4, level="downgrade"))
    age(signal_path)
    g = Guard(signal_file=str(signal_path), sidecar_url="", env={"MEMGUARD_BATCH_SIZE": "8",
              "MEMGUARD_GRAD_ACCUMULATION": "2"}, oom_hook=False)
    assert (g.batch_size, g.grad_accumulation, g.seq) == (4, 4, 5), "read at construction"
    assert g.refresh() is True, "the first refresh reports it as new"
    assert g.refresh() is False
