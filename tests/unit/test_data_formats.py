"""Data as the ecosystem writes it: verl's parquet layout read as is (message-list prompt, dotted
``reward_model.ground_truth``, ``data_source``, ``extra_info``), Hugging Face ``datasets`` saved to disk or
read by ``load_dataset``, and a dict label refused for a built-in reward at its first row."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from rlrun.data.prompt_files import PromptDataError, lookup, read_rows
from rlrun.rollout.rewards.labels import check_text_labels

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "configs/data"))
from make_addition_verl import verl_rows, write  # noqa: E402


@pytest.fixture(scope="module")
def verl_parquet(tmp_path_factory) -> Path:
    return write(tmp_path_factory.mktemp("verl") / "addition_verl.parquet")


def test_verl_parquet_reads_as_is(verl_parquet):
    rows = read_rows(verl_parquet, "prompt", "reward_model.ground_truth")
    assert len(rows) == 100
    row = rows[34]
    assert row.prompt == [{"role": "user", "content": "What is 3 + 4? Reply with only the number."}]
    assert row.label == "7" and row.where == f"{verl_parquet}:row 35"
    assert row.metadata["data_source"] == "addition"
    assert row.metadata["extra_info"] == {"split": "train", "index": 34, "a": 3, "b": 4}
    extra = read_rows(verl_parquet, "prompt", "reward_model.ground_truth", metadata_key="extra_info")
    assert extra[34].metadata == {"split": "train", "index": 34, "a": 3, "b": 4}


def test_dotted_keys_walk_objects_and_name_what_is_missing(tmp_path):
    assert lookup({"a": {"b": {"c": 1}}}, "a.b.c") == 1
    assert lookup({"a.b": 2, "a": {"b": 3}}, "a.b") == 2  # a key written with its dots wins
    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps({"prompt": "q", "reward_model": {"style": "rule"}}) + "\n")
    with pytest.raises(PromptDataError) as info:
        read_rows(path, "prompt", "reward_model.ground_truth")
    assert str(info.value) == (
        f"{path}:1: missing key 'reward_model.ground_truth' (data.label_key); the reward_model has keys ['style']"
    )


def test_dict_label_is_refused_for_a_text_reward_at_the_first_row(verl_parquet):
    rows = read_rows(verl_parquet, "prompt", "reward_model")
    with pytest.raises(PromptDataError) as info:
        check_text_labels(rows, "reward_model", "gsm8k")
    message = str(info.value)
    assert message.startswith(f"{verl_parquet}:row 1: data.label_key (reward_model) holds dict ")
    assert message.endswith("so every sample would score 0; set data.label_key: reward_model.ground_truth")
    check_text_labels(rows, "reward_model", "format_boxed")  # reads no label
    check_text_labels(rows, "reward_model", "my_rewards.py:score")  # a user reward may take an object
    check_text_labels(read_rows(verl_parquet, "prompt", "reward_model.ground_truth"), "reward_model", "gsm8k")


def test_datasets_saved_to_disk_and_load_dataset_files(tmp_path):
    datasets = pytest.importorskip("datasets")
    rows = verl_rows()[:6]
    dataset = datasets.Dataset.from_list(rows)
    dataset.save_to_disk(str(tmp_path / "saved"))
    datasets.DatasetDict({"train": dataset, "test": dataset.select(range(2))}).save_to_disk(str(tmp_path / "dict"))
    saved = read_rows(f"{tmp_path / 'saved'}@[2:4]", "prompt", "reward_model.ground_truth")
    assert [r.label for r in saved] == ["2", "3"] and saved[0].where == f"{tmp_path / 'saved'}:row 3"
    assert saved[0].metadata["extra_info"]["b"] == 2
    test_split = read_rows(tmp_path / "dict", "prompt", "reward_model.ground_truth", split="test")
    assert [r.label for r in test_split] == ["0", "1"]
    with pytest.raises(PromptDataError, match=r"data.split \(dev\) must name one of the dataset's splits"):
        read_rows(tmp_path / "dict", "prompt", "reward_model.ground_truth", split="dev")
    csv = tmp_path / "rows.csv"
    csv.write_text("question,answer\nWhat is 1 + 1?,2\nWhat is 2 + 2?,4\n")
    from_csv = read_rows(csv, "question", "answer")
    assert [(r.prompt, r.label) for r in from_csv] == [("What is 1 + 1?", 2), ("What is 2 + 2?", 4)]
    files = tmp_path / "files"
    files.mkdir()
    (files / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert len(read_rows(files, "prompt", "reward_model.ground_truth")) == 6
