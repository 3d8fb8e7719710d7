"""Property-based fuzzing (hypothesis) of what the client reads: the signal file or HTTP body,
RFC 3339 timestamps, the MEMGUARD_* environment, and a Guard reading a signal file that holds
anything at all. None of them may raise; what they accept must be a valid signal.

The examples are bounded (``max_examples``) so that the suite stays quick; the committed Rust
corpus of the signal target is replayed here too, so both readers see the same hostile inputs.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import FIXTURE, REPO, signal_dict
from memguard_client.env import env_bool, env_int
from memguard_client.guard import Guard
from memguard_client.signal import LEVELS, parse_rfc3339, parse_signal, signal_from_dict

SETTINGS = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False)
    | st.text(max_size=20),
    lambda children: st.lists(children, max_size=4)
    | st.dictionaries(st.text(max_size=10), children, max_size=4),
    max_leaves=20,
)
FIELDS = list(signal_dict(0).keys())


def check_valid(sig: Any) -> None:
    """What the trainer acts on is always usable."""
    assert sig.version == 1
    assert isinstance(sig.seq, int) and sig.seq >= 0
    assert sig.level in LEVELS
    assert isinstance(sig.batch_size, int) and sig.batch_size >= 1
    assert isinstance(sig.grad_accumulation, int) and sig.grad_accumulation >= 1
    assert isinstance(sig.grad_checkpointing, bool)
    assert isinstance(sig.reason, str) and isinstance(sig.timestamp, str)


@SETTINGS
@given(st.binary(max_size=512))
def test_arbitrary_bytes_never_raise(data: bytes) -> None:
    sig = parse_signal(data)
    if sig is not None:
        check_valid(sig)


@SETTINGS
@given(st.sampled_from(FIELDS), json_values, st.booleans())
def test_a_signal_with_one_field_replaced_by_anything_is_valid_or_refused(
    field: str, value: Any, drop: bool
) -> None:
    d = signal_dict(5)
    if drop:
        del d[field]
    else:
        d[field] = value
    sig = parse_signal(json.dumps(d).encode())
    if sig is not None:
        check_valid(sig)
        if not drop and field in ("seq", "batch_size", "grad_accumulation"):
            assert getattr(sig, field) == value


@SETTINGS
@given(
    st.integers(min_value=0, max_value=2**64 - 1),
    st.sampled_from(LEVELS),
    st.integers(min_value=1, max_value=2**32),
    st.integers(min_value=1, max_value=2**32),
    st.booleans(),
    st.text(max_size=50),
)
def test_every_valid_signal_round_trips(
    seq: int, level: str, batch: int, accum: int, ckpt: bool, reason: str
) -> None:
    d = signal_dict(seq, batch=batch, accum=accum, level=level, reason=reason)
    d["grad_checkpointing"] = ckpt
    sig = parse_signal(json.dumps(d))
    assert sig is not None
    assert (sig.seq, sig.level, sig.batch_size, sig.grad_accumulation) == (seq, level, batch, accum)
    assert (sig.grad_checkpointing, sig.reason) == (ckpt, reason)
    assert signal_from_dict(d) == sig


@SETTINGS
@given(st.text(max_size=40))
def test_timestamps_never_raise(text: str) -> None:
    t = parse_rfc3339(text)
    assert t is None or math.isfinite(t)


@SETTINGS
@given(
    st.datetimes(timezones=st.timezones()),
    st.sampled_from(["seconds", "milliseconds", "microseconds"]),
)
def test_real_rfc3339_timestamps_parse_to_their_instant(when: Any, spec: str) -> None:
    text = when.isoformat(timespec=spec)
    t = parse_rfc3339(text)
    assert t is not None, text
    # isoformat truncates to the precision asked for.
    keep = {"seconds": 0, "milliseconds": when.microsecond // 1000 * 1000}
    expected = when.replace(microsecond=keep.get(spec, when.microsecond)).timestamp()
    assert abs(t - expected) <= 1e-6 + abs(expected) * 1e-15, text


@SETTINGS
@given(st.text(max_size=30), st.integers(min_value=1, max_value=64))
def test_env_readers_never_raise_and_keep_their_contract(raw: str, default: int) -> None:
    n = env_int({"X": raw}, "X", default)
    assert isinstance(n, int) and n >= 1
    b = env_bool({"X": raw}, "X", True)
    assert isinstance(b, bool)
    if raw.strip().lower() in ("0", "false", "no", "off"):
        assert b is False


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.binary(max_size=2048) | json_values.map(lambda v: json.dumps(v).encode()))
def test_a_guard_reading_a_signal_file_of_anything_keeps_a_valid_signal(
    tmp_path: Path, data: bytes
) -> None:
    path = tmp_path / "signal.json"
    path.write_bytes(json.dumps(signal_dict(1, batch=6, accum=2)).encode())
    guard = Guard(signal_file=str(path), env={}, background=False)
    guard.refresh()
    assert guard.batch_size == 6
    path.write_bytes(data)
    os.utime(path, ns=(0, 10**18))  # a new mtime, so the guard rereads
    guard.refresh()
    check_valid(guard.signal)
    sig = parse_signal(data)
    if sig is None or sig.seq <= 1:
        assert (guard.seq, guard.batch_size) == (1, 6), "garbage or an older signal is ignored"
    else:
        assert guard.seq == sig.seq


def test_the_rust_signal_corpus_is_read_without_raising() -> None:
    corpus = REPO / "fuzz" / "corpus" / "signal_report"
    files = sorted(corpus.iterdir())
    assert len(files) >= 3
    for f in files:
        sig = parse_signal(f.read_bytes())
        if sig is not None:
            check_valid(sig)
    assert parse_signal(FIXTURE.read_bytes()) is not None
