"""A new user's mistakes (a config, a data file, a model directory, a hook) end in one message naming the key,
the file and the line, never a bare traceback; a hook that raises is reported with the line of the user's code."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from test_rewards import sample

from minimal_config import write_config
from rlrun.config import ConfigError, read_config
from rlrun.data.prompt_files import PromptDataError, read_rows
from rlrun.preflight import preflight
from rlrun.rollout.rewards import RewardSpecError, load_reward_fn, score_samples
from rlrun.tools.prepare import PrepareError, prepare_smollm2

REPO = Path(__file__).resolve().parents[2]


def problems(path: Path, overrides: tuple[str, ...] = ()) -> list[str]:
    with pytest.raises(ConfigError) as info:
        preflight(read_config(path, overrides))
    return str(info.value).splitlines()


def test_a_model_directory_without_weights_or_tokenizer_fails_before_any_process_starts(tmp_path, tiny_model_dirs):
    """Without this check the run failed after its engine workers had started, in transformers' OSError."""
    model = tmp_path / "half_downloaded"
    model.mkdir()
    shutil.copy(tiny_model_dirs["llama"] / "config.json", model)
    path = write_config(tmp_path / "run.yaml", f"model:\n  path: {model}\n")
    assert problems(path) == [
        f"{path}:2: model.path ({model}) must be a Hugging Face model directory (config.json, weights, tokenizer) "
        "because the run loads it, but it has no *.safetensors weights, no tokenizer files (tokenizer.json, "
        "tokenizer_config.json); save the model there with save_pretrained, or set model.path to a complete one"
    ]
    for file in tiny_model_dirs["llama"].glob("*.safetensors"):
        shutil.copy(file, model)
    [line] = problems(path)
    assert "but it has no tokenizer files" in line and "weights" not in line.split("but it has")[1]
    for file in tiny_model_dirs["llama"].glob("tokenizer*"):
        shutil.copy(file, model)
    assert preflight(read_config(path)).model.path == str(model)


def test_a_jsonl_line_that_is_not_utf8_names_its_line(tmp_path):
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(b'{"prompt": "a", "label": 1}\n{"prompt": "caf\xe9", "label": 2}\n')
    with pytest.raises(PromptDataError) as info:
        read_rows(path)
    assert str(info.value) == f"{path}:2: not UTF-8 (byte 0xe9 at column 16); save the file as UTF-8"


def test_a_pretty_printed_json_file_says_jsonl_is_one_object_per_line(tmp_path):
    path = tmp_path / "rows.json"
    path.write_text(json.dumps([{"prompt": "a", "label": 1}], indent=2))
    with pytest.raises(PromptDataError) as info:
        read_rows(path)
    assert str(info.value) == (
        f"{path}:1: invalid JSON (Expecting value at column 2); the line ends inside its JSON value: each row must "
        "be one complete JSON object on one line (JSON Lines)"
    )
    path.write_text('{"prompt": "a" "label": 1}\n')  # a typo within the line gets no such hint
    with pytest.raises(PromptDataError) as info:
        read_rows(path)
    assert str(info.value) == f"{path}:1: invalid JSON (Expecting ',' delimiter at column 16)"


def test_a_byte_order_mark_is_not_a_json_error(tmp_path):
    path = tmp_path / "notepad.jsonl"
    path.write_bytes('\ufeff{"prompt": "a", "label": 1}\n'.encode())
    [row] = read_rows(path)
    assert row.prompt == "a" and row.where == f"{path}:1"


def test_a_binary_or_directory_config_is_one_line(tmp_path):
    binary = tmp_path / "weights.yaml"
    binary.write_bytes(b"model:\n  path: x\n\x89PNG\n")
    with pytest.raises(ConfigError) as info:
        read_config(binary)
    assert str(info.value) == f"{binary}:3: not UTF-8 text (byte 0x89); pass a YAML run config, saved as UTF-8"
    with pytest.raises(ConfigError) as info:
        read_config(tmp_path)
    assert str(info.value) == f"{tmp_path}: is a directory, not a config file; pass the path of a YAML run config in it"


@pytest.mark.parametrize(
    "text, message",
    [
        (
            'model:\n  path: "abc\nrollout:\n  reward: math\n',
            ":5: invalid YAML: found unexpected end of stream (while scanning a quoted scalar that starts on line 2)",
        ),
        (
            "train:\n  num_steps: [50\n  seed: 1\n",
            ":3: invalid YAML: expected ',' or ']', but got ':' (while parsing a flow sequence that starts on line 2)",
        ),
    ],
)
def test_an_unclosed_quote_or_bracket_names_the_line_it_opens_on(tmp_path, text, message):
    path = tmp_path / "run.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        read_config(path)
    assert str(info.value) == f"{path}{message}"


def test_a_critic_config_with_a_yaml_error_names_its_line(tmp_path, tiny_model_dirs):
    critic = tmp_path / "critic.yaml"
    critic.write_text("models:\n  - role: critic\n    overrides: {optimizer.lr: 1.0e-3\n")
    text = f"model:\n  path: {tiny_model_dirs['llama']}\nalgorithm:\n  advantage_estimator: ppo\ncritic:\n"
    path = write_config(tmp_path / "run.yaml", f"{text}  config: {critic}\n")
    assert (
        f"{path}:6: {critic}:4: invalid YAML: expected ',' or '}}', but got '<stream end>' (while parsing a flow "
        "mapping that starts on line 3)" in problems(path)
    )


def test_a_hook_that_fails_on_import_names_its_line(tmp_path):
    hook = tmp_path / "reward.py"
    hook.write_text(
        "import json\nTABLE = json.loads(open('missing_table.json').read())\n\ndef score(s):\n    return 0\n"
    )
    with pytest.raises(RewardSpecError) as info:
        load_reward_fn(f"{hook}:score")
    assert (
        f"importing '{hook}' raised FileNotFoundError: [Errno 2] No such file or directory: 'missing_table.json' "
        f"(at {hook}:2 in <module>);" in str(info.value)
    )


def test_a_reward_that_raises_names_the_users_innermost_line(tmp_path):
    """The line is the user's own, not the library's it called into (json here) nor rlrun's."""
    hook = tmp_path / "reward.py"
    hook.write_text(
        "import json\n\ndef parse(text):\n    return json.loads(text)\n\n"
        "def score(s):\n    return parse(s.response_text)\n"
    )
    [failed] = samples = [sample("not json", 0)]
    assert score_samples(samples, load_reward_fn(f"{hook}:score")) == 1
    assert failed.reward_error == f"JSONDecodeError: Expecting value: line 1 column 1 (char 0) (at {hook}:4 in parse)"
    text = tmp_path / "text_reward.py"
    text.write_text("def score(s):\n    return 'yes'\n")
    [returned_text] = samples = [sample("x", 0)]  # rlrun's own check of the value: no user line to name
    assert score_samples(samples, load_reward_fn(f"{text}:score")) == 1
    assert returned_text.reward_error == "TypeError: reward function returned 'yes'; expected a finite float"


def test_prepare_into_an_unwritable_place_is_one_line(tmp_path):
    (tmp_path / "afile").write_text("")
    out = tmp_path / "afile/model"
    with pytest.raises(PrepareError) as info:
        prepare_smollm2(out)
    assert str(info.value).startswith(f"--out {out}: cannot write in {tmp_path / 'afile'} (")


def test_the_cli_prints_the_line_without_a_traceback(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "rlrun", "config", "validate", "configs/data/addition_verl.parquet"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert done.stderr.startswith("configs/data/addition_verl.parquet:1: not UTF-8 text (byte ")


@pytest.mark.parametrize("local_rank, printed", [("0", True), ("1", False)])
def test_under_torchrun_a_config_mistake_is_printed_once_per_node(tmp_path, local_rank, printed):
    """Every rank finds the same mistake; N interleaved copies above torchrun's own report hid it."""
    done = subprocess.run(
        [sys.executable, "-m", "rlrun", "train", "configs/quickstart.yaml", "--set", "train.num_stpes=1"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "LOCAL_RANK": local_rank},
    )
    assert done.returncode == 1 and "Traceback" not in done.stderr
    message = "--set train.num_stpes=1: unknown key 'train.num_stpes' (did you mean 'num_steps'?)\n"
    assert done.stderr == (message if printed else "")
