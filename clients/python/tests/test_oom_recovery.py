"""In-process OOM recovery with the real exception classes (one process; the 2-rank case is in
test_distributed.py).

The OOM is injected by a forward pre-hook (or a backward hook) that raises the real
``torch.OutOfMemoryError`` when a micro-batch has more rows than a threshold: exactly what a
CUDA allocator raises inside a step. The CPU allocator's ``RuntimeError`` is provoked for real.
"""

from __future__ import annotations

import types
from pathlib import Path
from typing import Any, Dict, List

import pytest

from conftest import FakeSidecar, signal_dict, write_atomic
from memguard_client import Guard
from memguard_client.recovery import classify_oom

torch = pytest.importorskip("torch", reason="torch is installed by scripts/install-deps.sh")


def make_model() -> Any:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))


def data(rows: int = 8) -> Any:
    g = torch.Generator().manual_seed(3)
    return torch.randn(rows, 4, generator=g), torch.randn(rows, 1, generator=g)


def full_batch_grads(batch: Any) -> List[Any]:
    model = make_model()
    torch.nn.functional.mse_loss(model(batch[0]), batch[1]).backward()
    return [p.grad.clone() for p in model.parameters()]


class OomAbove:
    """Forward pre-hook raising the real torch.OutOfMemoryError above `limit` rows."""

    def __init__(self, limit: int) -> None:
        self.limit, self.raised, self.rows = limit, 0, []  # type: ignore[var-annotated]

    def __call__(self, _module: Any, args: Any) -> None:
        self.rows.append(args[0].shape[0])
        if args[0].shape[0] > self.limit:
            self.raised += 1
            raise torch.OutOfMemoryError(f"CUDA out of memory (injected above {self.limit} rows)")


def batcher_for(signal_path: Path, batch: int = 8, **kw: Any) -> Any:
    from memguard_client.torch import MicroBatcher

    write_atomic(signal_path, signal_dict(0, batch=batch, accum=1))
    return MicroBatcher(Guard(signal_file=str(signal_path), env={}), **kw)


def loss_fn_of(model: Any) -> Any:
    return lambda mb: torch.nn.functional.mse_loss(model(mb[0]), mb[1])


def test_classify_recognises_the_real_exception_classes() -> None:
    assert classify_oom(torch.OutOfMemoryError("CUDA out of memory")) == "cuda_oom"
    with pytest.raises(RuntimeError) as err:  # the CPU allocator, for real: 2**60 bytes
        torch.empty(2**57, dtype=torch.float64)
    assert classify_oom(err.value) == "cpu_oom"
    assert classify_oom(RuntimeError("shape mismatch")) is None
    assert classify_oom(ValueError("out of memory")) is None


def test_forward_oom_halves_and_runs_the_rest_again_exactly(signal_path: Path) -> None:
    batch = data()
    model = make_model()
    hook = OomAbove(3)
    model[0].register_forward_pre_hook(hook)
    batcher = batcher_for(signal_path)
    batcher.backward(batch, loss_fn_of(model), model=model)
    assert hook.rows == [8, 4, 2, 2, 2, 2] and hook.raised == 2
    assert batcher.oom_recoveries == 2 and batcher.micro_batch_size == 2
    assert batcher.skipped_steps == 0 and not batcher.skip_step
    for p, g in zip(model.parameters(), full_batch_grads(batch)):
        torch.testing.assert_close(p.grad, g, rtol=1e-5, atol=1e-6)
    # The halved size holds for the next steps (the sidecar's signal still says 8).
    batcher.backward(batch, loss_fn_of(model), model=model)
    assert hook.rows[6:] == [2, 2, 2, 2]


def test_backward_oom_with_fresh_gradients_reruns_the_batch_exactly(signal_path: Path) -> None:
    batch = data()
    model = make_model()
    state = {"left": 1}

    def backward_hook(_m: Any, _gi: Any, _go: Any) -> None:
        if state["left"]:
            state["left"] -= 1
            raise torch.OutOfMemoryError("CUDA out of memory (injected in backward)")

    model[0].register_full_backward_hook(backward_hook)
    batcher = batcher_for(signal_path, batch=4)
    batcher.backward(batch, loss_fn_of(model), model=model)
    assert batcher.oom_recoveries == 1 and batcher.micro_batch_size == 2
    assert batcher.skipped_steps == 0
    for p, g in zip(model.parameters(), full_batch_grads(batch)):
        torch.testing.assert_close(p.grad, g, rtol=1e-5, atol=1e-6)


def test_backward_oom_after_accumulation_skips_the_step_and_counts_it(signal_path: Path) -> None:
    batch = data()
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    batcher = batcher_for(signal_path, batch=4)
    batcher.backward(batch, loss_fn_of(model), model=model)  # gradients now accumulated
    state = {"left": 1}

    def backward_hook(_m: Any, _gi: Any, _go: Any) -> None:
        if state["left"]:
            state["left"] -= 1
            raise torch.OutOfMemoryError("CUDA out of memory (injected in backward)")

    model[0].register_full_backward_hook(backward_hook)
    before = [p.detach().clone() for p in model.parameters()]
    batcher.backward(batch, loss_fn_of(model), model=model)
    assert batcher.skip_step and batcher.skipped_steps == 1
    assert all(p.grad is None for p in model.parameters())  # the spoiled gradients are gone
    assert batcher.step(opt) is False
    for p, b in zip(model.parameters(), before):
        assert torch.equal(p, b)
    # The next batch steps normally.
    batcher.backward(batch, loss_fn_of(model), model=model)
    assert batcher.step(opt) is True


def test_at_micro_batch_one_the_error_propagates_with_a_clear_message(signal_path: Path) -> None:
    batch = data()
    model = make_model()
    model[0].register_forward_pre_hook(OomAbove(0))
    batcher = batcher_for(signal_path, batch=2)
    with pytest.raises(torch.OutOfMemoryError) as err:
        batcher.backward(batch, loss_fn_of(model), model=model)
    notes = " ".join(getattr(err.value, "__notes__", []))
    assert "micro-batch size 1" in notes and "nothing smaller" in notes
    assert batcher.oom_recoveries == 1  # 2 -> 1, then 1 failed too


def test_retries_are_bounded(signal_path: Path) -> None:
    model = make_model()
    hook = OomAbove(1)
    model[0].register_forward_pre_hook(hook)
    batcher = batcher_for(signal_path, batch=8, max_oom_retries=1)
    with pytest.raises(torch.OutOfMemoryError):
        batcher.backward(data(), loss_fn_of(model), model=model)
    assert hook.rows == [8, 4]  # one retry, then it gives up although 1 row would fit


def test_a_non_oom_error_is_never_swallowed(signal_path: Path) -> None:
    model = make_model()
    batcher = batcher_for(signal_path)
    with pytest.raises(RuntimeError, match="mat1 and mat2"):
        batcher.backward((torch.randn(8, 3), torch.randn(8, 1)), loss_fn_of(model), model=model)
    assert batcher.oom_recoveries == 0


def test_recovery_is_reported_to_the_sidecar(tmp_path: Path, sidecar: FakeSidecar) -> None:
    from memguard_client.torch import MicroBatcher

    model = make_model()
    model[0].register_forward_pre_hook(OomAbove(3))
    guard = Guard(signal_file="", sidecar_url=sidecar.url, env={"MEMGUARD_BATCH_SIZE": "8"}, background=False)
    batcher = MicroBatcher(guard)
    batcher.backward(data(), loss_fn_of(model), model=model)
    ooms = [r["oom"] for r in sidecar.reports if "oom" in r]  # step reports come too
    assert [(o["kind"], o["outcome"]) for o in ooms] == [("cuda_oom", "recovered")] * 2
    assert [(o["batch_size"], o["new_batch_size"]) for o in ooms] == [(8, 4), (4, 2)], ooms


# --- the real Hugging Face Trainer -------------------------------------------------------------


def _trainer(tmp_path: Path, name: str, model: Any, accum: int = 1) -> Any:
    transformers = pytest.importorskip("transformers")
    rows = [{"x": x, "labels": y} for x, y in zip(*data(48))]
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / name), per_device_train_batch_size=8,
        gradient_accumulation_steps=accum, num_train_epochs=1, learning_rate=0.1,
        report_to=[], save_strategy="no", logging_strategy="no", use_cpu=True, seed=0,
        lr_scheduler_type="constant", optim="sgd",
    )
    return transformers.Trainer(model=model, args=args, train_dataset=rows)


class HFTiny(torch.nn.Module):  # type: ignore[misc,name-defined]
    def __init__(self) -> None:
        super().__init__()
        self.net = make_model()

    def forward(self, x: Any, labels: Any = None) -> Dict[str, Any]:
        out = self.net(x)
        return {"loss": torch.nn.functional.mse_loss(out, labels), "logits": out}


def test_hf_trainer_recovers_from_forward_oom_exactly(tmp_path: Path) -> None:
    from memguard_client.hf import attach

    ref = HFTiny()
    _trainer(tmp_path, "ref", ref).train()
    model = HFTiny()
    hook = OomAbove(3)
    model.net[0].register_forward_pre_hook(hook)
    trainer = _trainer(tmp_path, "guarded", model)
    signal = tmp_path / "signal.json"
    write_atomic(signal, signal_dict(0, batch=8, accum=1))
    cb = attach(trainer, Guard(signal_file=str(signal), env={}))
    trainer.train()
    assert hook.rows[:6] == [8, 4, 2, 2, 2, 2] and set(hook.rows[6:]) == {2}
    assert cb.oom_recoveries == 2 and cb.skipped_steps == 0
    assert trainer.state.global_step == 6
    for a, b in zip(ref.parameters(), model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_hf_trainer_skips_a_step_spoiled_by_backward_oom(tmp_path: Path) -> None:
    from memguard_client.hf import attach

    model = HFTiny()
    state = {"calls": 0}

    def backward_hook(_m: Any, _gi: Any, _go: Any) -> None:
        state["calls"] += 1
        if state["calls"] == 4:  # the second batch of the second accumulation window
            raise torch.OutOfMemoryError("CUDA out of memory (injected in backward)")

    model.net[0].register_full_backward_hook(backward_hook)
    trainer = _trainer(tmp_path, "skip", model, accum=2)
    steps: List[int] = []
    from torch.optim.optimizer import register_optimizer_step_post_hook

    handle = register_optimizer_step_post_hook(lambda *a: steps.append(1))
    try:
        signal = tmp_path / "signal.json"
        write_atomic(signal, signal_dict(0, batch=8, accum=2))
        cb = attach(trainer, Guard(signal_file=str(signal), env={}))
        trainer.train()
    finally:
        handle.remove()
    assert cb.skipped_steps == 1 and cb.oom_recoveries == 1
    assert trainer.state.global_step == 3  # the Trainer's loop went on
    assert len(steps) == 2  # but the optimizer stepped only for the two clean windows


def test_attach_refuses_deepspeed_with_a_clear_message() -> None:
    accelerate_utils = pytest.importorskip("accelerate.utils")
    from memguard_client.hf import UnsupportedTrainerError, attach

    trainer = types.SimpleNamespace(
        accelerator=types.SimpleNamespace(distributed_type=accelerate_utils.DistributedType.DEEPSPEED),
        training_step=lambda *a, **k: None, compute_loss=lambda *a, **k: None,
    )
    with pytest.raises(UnsupportedTrainerError, match="does not support DeepSpeed"):
        attach(trainer, Guard(env={}))
    assert not hasattr(trainer, "_memguard_callback")  # nothing was wrapped
