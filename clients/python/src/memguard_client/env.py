"""Names of the environment variables memguard writes into the trainer (memguard_api::env)."""

from __future__ import annotations

from typing import Any, Mapping, Optional

#: Recommended per-device batch size.
BATCH_SIZE = "MEMGUARD_BATCH_SIZE"
#: Recommended gradient accumulation steps.
GRAD_ACCUMULATION = "MEMGUARD_GRAD_ACCUMULATION"
#: ``true`` when gradient checkpointing should be on.
GRAD_CHECKPOINTING = "MEMGUARD_GRAD_CHECKPOINTING"
#: Recommended sequence length.
SEQ_LENGTH = "MEMGUARD_SEQ_LENGTH"
#: Recommended LoRA rank.
LORA_RANK = "MEMGUARD_LORA_RANK"
#: Recommended number of adapted layers.
LORA_LAYERS = "MEMGUARD_LORA_LAYERS"
#: ``each-batch`` when the trainer should sync gradients at every micro-batch (Accelerate's
#: ``sync_each_batch``: FSDP keeps them sharded), ``accumulate`` otherwise (FSDP on several
#: ranks only).
GRAD_SYNC = "MEMGUARD_GRAD_SYNC"
#: :data:`GRAD_SYNC`'s values.
EACH_BATCH = "each-batch"
ACCUMULATE = "accumulate"
#: The estimated peak of the final config, in bytes.
ESTIMATE_BYTES = "MEMGUARD_ESTIMATE_BYTES"
#: The budget the plan aimed at, in bytes.
BUDGET_BYTES = "MEMGUARD_BUDGET_BYTES"
#: Path of the signal file on the shared volume.
SIGNAL_FILE = "MEMGUARD_SIGNAL_FILE"
#: URL of the sidecar's trainer API.
SIDECAR_URL = "MEMGUARD_SIDECAR_URL"

#: Where a fatal OOM record is written (default: /dev/termination-log when it exists).
TERMINATION_LOG = "MEMGUARD_TERMINATION_LOG"
#: ``0``/``false``: the injected client does not attach itself to a ``transformers.Trainer``.
AUTO_ATTACH = "MEMGUARD_AUTO_ATTACH"
#: ``pipelined`` (default, also when unset): the ranks' per-step agreement overlaps the step
#: (applied one step later); ``blocking``: applied at the step it is made
#: (memguard_client.distributed).
AGREEMENT = "MEMGUARD_AGREEMENT"
#: Seconds the first training step waits for the sidecar's train-start plan (default 2).
TRAIN_START_WAIT = "MEMGUARD_TRAIN_START_WAIT"
#: :data:`AGREEMENT`'s values.
PIPELINED = "pipelined"
BLOCKING = "blocking"
#: ``true`` when the webhook admitted the pod with "cannot fit": a fatal OOM exits 87, not 86.
CANNOT_FIT = "MEMGUARD_CANNOT_FIT"

#: Default signal file path (memguard_api::wellknown::SIGNAL_FILE).
DEFAULT_SIGNAL_FILE = "/var/run/memguard/signal.json"

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def non_negative_int(value: Any) -> Optional[int]:
    """``value`` as an int >= 0 (a number, or a string of one); ``None`` for anything else, a
    bool included. The one reader of counts in what the sidecar and the frameworks report."""
    if value is None or isinstance(value, bool):
        return None
    try:
        n = int(value)
    except (TypeError, ValueError, OverflowError):
        return None
    return n if n >= 0 else None


def env_int(environ: Mapping[str, str], name: str, default: int) -> int:
    """A positive integer from ``environ[name]``; ``default`` when unset or not a positive int."""
    raw = environ.get(name)
    if raw is None:
        return default
    try:
        value = int(raw.strip())
    except ValueError:
        return default
    return value if value >= 1 else default


def env_seconds(environ: Mapping[str, str], name: str, default: float) -> float:
    """Seconds ≥ 0 from ``environ[name]`` (at most an hour); ``default`` when unset or not one."""
    raw = environ.get(name)
    if raw is None:
        return default
    try:
        value = float(raw.strip())
    except ValueError:
        return default
    return value if 0.0 <= value <= 3600.0 else default


def env_grad_sync(environ: Mapping[str, str], default: str) -> str:
    """:data:`EACH_BATCH` or :data:`ACCUMULATE` from ``environ[GRAD_SYNC]`` (the spellings
    memguard_estimator::GradSync accepts); ``default`` when unset or unknown."""
    raw = environ.get(GRAD_SYNC)
    v = raw.strip().lower() if raw is not None else ""
    if v in (EACH_BATCH, "sync-each-batch"):
        return EACH_BATCH
    if v in (ACCUMULATE, "no-sync"):
        return ACCUMULATE
    return default


def env_bool(environ: Mapping[str, str], name: str, default: bool) -> bool:
    """A boolean from ``environ[name]`` (true/false/1/0/yes/no/on/off); ``default`` otherwise."""
    raw = environ.get(name)
    if raw is None:
        return default
    v = raw.strip().lower()
    if v in _TRUE:
        return True
    if v in _FALSE:
        return False
    return default
