"""The signal schema: the Rust fixture parses; anything invalid gives None, never an exception."""

from __future__ import annotations

import json

import pytest

from conftest import FIXTURE, signal_dict
from memguard_client.signal import LEVELS, parse_rfc3339, parse_signal, signal_from_dict


def test_parses_the_contract_fixture_shared_with_the_rust_crate() -> None:
    sig = parse_signal(FIXTURE.read_bytes())
    assert sig is not None
    assert (sig.version, sig.seq, sig.level) == (1, 3, "downgrade")
    assert (sig.batch_size, sig.grad_accumulation, sig.grad_checkpointing) == (4, 8, True)
    assert sig.effective_batch == 32
    assert sig.pressure.memory_ratio == 0.87
    assert sig.pressure.working_set_bytes == 14944647168
    assert sig.pressure.limit_bytes == 17179869184
    assert sig.pressure.gpu_ratio is None
    assert sig.timestamp_seconds() == pytest.approx(1795384800.0)


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"{",
        b'{"version": 1, "seq": 3, "lev',
        b"\xff\xfe\x00garbage",
        b"null",
        b"[1, 2, 3]",
        b'"a string"',
        b"[" * 100000,
    ],
)
def test_garbage_gives_none(data: bytes) -> None:
    assert parse_signal(data) is None


@pytest.mark.parametrize(
    "change",
    [
        {"version": 2},
        {"version": "1"},
        {"version": True},
        {"seq": -1},
        {"seq": 1.5},
        {"seq": True},
        {"level": "panic"},
        {"level": None},
        {"batch_size": 0},
        {"batch_size": "8"},
        {"batch_size": True},
        {"grad_accumulation": 0},
        {"grad_checkpointing": "true"},
    ],
)
def test_invalid_actionable_field_gives_none(change: dict) -> None:
    d = signal_dict(1)
    d.update(change)
    assert signal_from_dict(d) is None


@pytest.mark.parametrize("missing", ["version", "seq", "level", "batch_size", "grad_accumulation", "grad_checkpointing"])
def test_missing_actionable_field_gives_none(missing: str) -> None:
    d = signal_dict(1)
    del d[missing]
    assert parse_signal(json.dumps(d)) is None


def test_informative_fields_are_lenient_and_extra_fields_tolerated() -> None:
    d = signal_dict(2, pressure={"memory_ratio": "high", "limit_bytes": 100, "new_figure": 1}, future=1)
    del d["reason"]
    d["timestamp"] = 12
    sig = signal_from_dict(d)
    assert sig is not None
    assert sig.pressure.memory_ratio is None and sig.pressure.limit_bytes == 100
    assert sig.reason == "" and sig.timestamp == "" and sig.timestamp_seconds() is None


def test_levels_are_the_contract_levels() -> None:
    assert LEVELS == ("ok", "warn", "downgrade", "critical")


@pytest.mark.parametrize(
    "text, expected",
    [
        ("2026-11-22T22:00:00Z", 1795384800.0),
        ("2026-11-22T22:00:00.5Z", 1795384800.5),
        ("2026-11-22T22:00:00.123456789Z", 1795384800.123456),
        ("2026-11-22T23:00:00.000+01:00", 1795384800.0),
    ],
)
def test_rfc3339(text: str, expected: float) -> None:
    assert parse_rfc3339(text) == pytest.approx(expected, abs=1e-6)


@pytest.mark.parametrize("text", ["", "yesterday", "2026-13-40T00:00:00Z"])
def test_bad_rfc3339_gives_none(text: str) -> None:
    assert parse_rfc3339(text) is None
