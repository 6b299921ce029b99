"""Prompt sources: jsonl and parquet, ``path@[start:end]`` slices, metadata / tools keys, chat template
kwargs, and resuming the sampler on sliced data (exact continuation, changed data refused)."""

from __future__ import annotations

import json

import pytest

from rlrun.config.schema import DataConfig
from rlrun.data.prompts import PromptDataError, PromptDataset, PromptSampler, read_rows
from tiny_models import make_tokenizer

ROWS = [{"prompt": f"q{i}", "label": i, "meta": {"src": f"s{i}"}, "extra": i * 10} for i in range(10)]
# A template that renders tools and a kwarg, to see both reach apply_chat_template.
TOOLS_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTOOLS:{% for t in tools %}{{ t['name'] }};{% endfor %}<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% if think is defined and not think %}<no-think>{% endif %}"
    "{% endif %}"
)


def write_jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def write_parquet(path, rows):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


@pytest.fixture(scope="module")
def tokenizer():
    return make_tokenizer()


@pytest.mark.parametrize(
    "spec, expected",
    [
        ("", list(range(10))),
        ("@[2:5]", [2, 3, 4]),
        ("@[:3]", [0, 1, 2]),
        ("@[7:]", [7, 8, 9]),
        ("@[-2:]", [8, 9]),
        ("@[1:-7]", [1, 2]),
        ("@[:]", list(range(10))),
    ],
)
def test_slices_select_rows_like_python(tmp_path, spec, expected):
    # Blank lines are not rows: the slice counts rows, and errors still name the file line.
    path = write_jsonl(tmp_path / "p.jsonl", [ROWS[0], "", *ROWS[1:]])
    rows = read_rows(f"{path}{spec}")
    assert [r.label for r in rows] == expected == list(range(10))[slice(*_bounds(spec))]
    assert [r.index for r in rows] == list(range(len(expected)))
    assert rows[0].where == f"{path}:{expected[0] + 1 + (expected[0] > 0)}"


def _bounds(spec: str):
    if not spec:
        return (None,)
    start, end = spec[2:-1].split(":")
    return (int(start) if start else None, int(end) if end else None)


def test_parquet_reads_the_same_rows_as_jsonl(tmp_path, tokenizer):
    pytest.importorskip("pyarrow")
    jsonl = write_jsonl(tmp_path / "p.jsonl", ROWS)
    parquet = write_parquet(tmp_path / "p.parquet", ROWS)
    for spec in ("", "@[3:6]", "@[-4:]"):
        a = PromptDataset(DataConfig(path=f"{jsonl}{spec}", metadata_key="meta"), tokenizer)
        b = PromptDataset(DataConfig(path=f"{parquet}{spec}", metadata_key="meta"), tokenizer)
        assert [(p.prompt_ids, p.label, p.metadata) for p in a.prompts] == [
            (p.prompt_ids, p.label, p.metadata) for p in b.prompts
        ]
        assert a.fingerprint == b.fingerprint
    rows = read_rows(f"{parquet}@[3:6]")
    assert [r.where for r in rows] == [f"{parquet}:row {n}" for n in (4, 5, 6)]
    assert rows[0].metadata == {"meta": {"src": "s3"}, "extra": 30}  # no metadata_key: every other column


def test_parquet_errors_name_the_row(tmp_path):
    pytest.importorskip("pyarrow")
    path = write_parquet(tmp_path / "bad.parquet", [{"prompt": "a", "label": 1}, {"prompt": "", "label": 2}])
    with pytest.raises(PromptDataError, match=rf"^{path}:row 2: 'prompt' \(\"\"\) must be a non-empty string"):
        read_rows(path)
    assert len(read_rows(f"{path}@[:1]")) == 1  # the bad row is outside the slice: never trained on
    garbage = tmp_path / "garbage.parquet"
    garbage.write_bytes(b"not parquet")
    with pytest.raises(PromptDataError, match=rf"^{garbage}: not a readable parquet file"):
        read_rows(garbage)


def test_metadata_and_tools_keys(tmp_path, tokenizer):
    tools = [{"name": "calc"}, {"name": "search"}]
    path = write_jsonl(
        tmp_path / "t.jsonl",
        [
            {"prompt": "hi", "label": 1, "meta": {"k": 1}, "tools": tools, "other": 5},
            {"prompt": "yo", "label": 2, "tools": json.dumps(tools[:1])},  # parquet exports often hold JSON strings
            {"prompt": "no tools", "label": 3, "meta": None},
        ],
    )
    tok = make_tokenizer()
    tok.chat_template = TOOLS_TEMPLATE
    ds = PromptDataset(
        DataConfig(path=str(path), metadata_key="meta", tools_key="tools", chat_template_kwargs={"think": False}), tok
    )
    assert [p.metadata for p in ds.prompts] == [{"k": 1}, {}, {}]
    assert [p.tools for p in ds.prompts] == [tools, tools[:1], None]
    expected = [
        tok.apply_chat_template(
            [{"role": "user", "content": c}], tools=t, think=False, tokenize=False, add_generation_prompt=True
        )
        for c, t in (("hi", tools), ("yo", tools[:1]), ("no tools", None))
    ]
    assert [p.prompt_text for p in ds.prompts] == expected
    assert ds[0].prompt_text.startswith("<|im_start|>system\nTOOLS:calc;search;") and ds[0].prompt_text.endswith(
        "<no-think>"
    )
    assert ds[0].prompt_ids == tok(expected[0], add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize(
    "row, message",
    [
        (
            {"prompt": "a", "label": 1, "meta": [1]},
            "'meta' ([1]) must be a JSON object because it is data.metadata_key",
        ),
        ({"prompt": "a", "label": 1, "tools": "{oops"}, "'tools' is a string but not JSON"),
        ({"prompt": "a", "label": 1, "tools": [1, 2]}, "'tools' ([1, 2]) must be a list of tool-schema objects"),
    ],
)
def test_bad_metadata_and_tools_name_the_line(tmp_path, row, message):
    path = write_jsonl(tmp_path / "b.jsonl", [{"prompt": "ok", "label": 0}, row])
    with pytest.raises(PromptDataError) as info:
        read_rows(path, metadata_key="meta", tools_key="tools")
    assert str(info.value).startswith(f"{path}:2: {message}")


def test_rows_without_labels_and_empty_slices(tmp_path):
    path = write_jsonl(tmp_path / "n.jsonl", [{"prompt": "a"}, {"prompt": "b"}])
    assert [r.label for r in read_rows(path, label_key=None)] == [None, None]
    with pytest.raises(PromptDataError, match=r"no prompts \(the file is empty or the slice selects no rows\)"):
        read_rows(f"{path}@[5:9]")
    with pytest.raises(PromptDataError, match="prompt file not found"):
        read_rows(f"{tmp_path}/missing.jsonl@[0:2]")


def draw(sampler, batches, n):
    return [p.label for _ in range(batches) for p in sampler.next_batch(n)]


def test_resume_on_a_slice_continues_exactly(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "p.jsonl", ROWS)
    cfg = DataConfig(path=f"{path}@[2:9]")  # 7 rows: batches of 3 straddle epochs
    straight = draw(PromptSampler(PromptDataset(cfg, tokenizer), seed=5), batches=8, n=3)
    assert sorted(straight[:7]) == list(range(2, 9)) and sorted(straight[7:14]) == list(range(2, 9))
    for cut in (1, 2, 5):  # resume after 3, 6 (one row left in epoch 0) and 15 draws (epoch 2)
        first = PromptSampler(PromptDataset(cfg, tokenizer), seed=5)
        before = draw(first, cut, 3)
        state = json.loads(json.dumps(first.state_dict()))
        resumed = PromptSampler(PromptDataset(cfg, tokenizer), seed=5)  # a fresh process rebuilds everything
        resumed.load_state_dict(state)
        assert before + draw(resumed, 8 - cut, 3) == straight


def test_resume_on_changed_data_is_refused(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "p.jsonl", ROWS)
    state = PromptSampler(PromptDataset(DataConfig(path=f"{path}@[0:5]"), tokenizer), seed=0).state_dict()
    other = PromptDataset(DataConfig(path=f"{path}@[1:6]"), tokenizer)  # same count, different rows
    with pytest.raises(ValueError, match=r"sampler state fingerprint \(\w+\) must match the dataset's"):
        PromptSampler(other, seed=0).load_state_dict(state)
