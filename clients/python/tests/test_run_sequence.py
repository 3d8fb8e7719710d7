"""The sequence a Trainer is planned on at train start (issue 37): the longest its run will
see, never its first micro-batch alone. A stock script whose collator pads each batch to its
longest row and whose data grows longer (bench/survival/stock_hf_trainer.py) was planned on its
first 90-token batch, "fits as configured" at 16, and then needed four downgrades."""
from types import SimpleNamespace
from typing import Any, Dict, List

import pytest
import torch

from memguard_client.train_config import MAX_ROWS_READ, run_sequence


def rows(lengths: List[int]) -> List[Dict[str, Any]]:
    return [{"input_ids": list(range(n))} for n in lengths]


def batch(length: int) -> Dict[str, torch.Tensor]:
    return {"input_ids": torch.zeros(4, length, dtype=torch.long)}


def trainer(dataset: Any, collator: Any = None, **args: Any) -> SimpleNamespace:
    return SimpleNamespace(train_dataset=dataset, data_collator=collator, args=SimpleNamespace(**args))


def test_growing_data_is_planned_on_its_longest_row_not_the_first_batch() -> None:
    t = trainer(rows([32, 90, 400, 1024]))
    assert run_sequence(t, batch(90)) == {"seq-length": 1024.0}


def test_a_datasets_column_is_read_and_padding_to_a_multiple_rounds_up() -> None:
    import datasets
    ds = datasets.Dataset.from_dict({"input_ids": [list(range(n)) for n in (10, 700, 33)]})
    collator = SimpleNamespace(padding=True, pad_to_multiple_of=64, max_length=None)
    assert run_sequence(trainer(ds, collator), batch(64)) == {"seq-length": 704.0}


def test_a_collator_padding_to_max_length_bounds_the_run() -> None:
    collator = SimpleNamespace(padding="max_length", max_length=512, pad_to_multiple_of=None)
    lazy = (r for r in rows([8]))  # no len(): the data cannot be read at train start
    assert run_sequence(trainer(lazy, collator), batch(512)) == {"seq-length": 512.0}


def test_trls_max_length_bounds_a_set_it_cannot_read() -> None:
    class Lazy(torch.utils.data.Dataset):  # __getitem__ may tokenize: never called here
        def __len__(self) -> int:
            return 10

        def __getitem__(self, i: int) -> Dict[str, Any]:
            raise AssertionError("read at train start")

    assert run_sequence(trainer(Lazy(), max_length=2048), batch(300)) == {"seq-length": 2048.0}


def test_nothing_that_bounds_the_run_leaves_the_sequence_unknown() -> None:
    big = rows([4]) * (MAX_ROWS_READ + 1)
    assert run_sequence(trainer(big), batch(4)) == {}
    assert run_sequence(trainer(rows([5]) and [{"text": "no ids"}]), batch(4)) == {}
    assert run_sequence(trainer(None), batch(4)) == {}


def test_never_shorter_than_the_first_batch() -> None:
    # A collator that adds tokens (a BOS, a prompt template) makes the batch longer than the rows.
    assert run_sequence(trainer(rows([100, 200])), batch(260)) == {"seq-length": 260.0}
