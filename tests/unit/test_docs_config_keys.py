"""What README.md and docs/ tell a user to type exists: every dotted config key they name resolves in the schema and
takes the value they give it, every ``rlrun`` command names registered subcommands and options, every script or
module a command runs is in the repository; and every config the repository ships loads.

Keys are read from inline code spans, fenced blocks and YAML examples; a key whose first part is not a config section
(``cfg.rollout``, ``sample.prompt``) is not a key. The schema is walked through ``rlrun.tools.config_reference``, the
generator of docs/config.md, so a key that passes here has its entry on that page.
"""

from __future__ import annotations

import importlib.util
import re
import shlex
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import pytest
import typer.main
import yaml
from pydantic import BaseModel, TypeAdapter, ValidationError
from pydantic.fields import FieldInfo

from rlrun.cli import app
from rlrun.config import load_config
from rlrun.config.load import BASE_KEY
from rlrun.config.schema import RunConfig
from rlrun.preflight.critic import load_critic_config
from rlrun.tools import config_reference

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md"] + sorted(p for p in (ROOT / "docs").glob("*.md") if p.name != "config.md")
SECTIONS: dict[str, type[BaseModel]] = {
    "": RunConfig,
    **{s.key.replace("[i]", ""): s.model for s in config_reference.sections()},
}
ENTRY_NAMES: dict[str, set[str]] = {}
for _entry in config_reference.algorithm_entries():
    ENTRY_NAMES.setdefault(_entry.key, set()).add(_entry.name)
ENTRY_SETTINGS = {f"{e.key}.{name}" for e in config_reference.algorithm_entries() for name in e.settings.model_fields}

FOREIGN = {
    "porting-from-verl.md": {"data.train_batch_size", "data.max_response_length", "algorithm.adv_estimator"},
}
"""Another framework's keys, named beside their rlrun equivalents; each must still appear and must not resolve."""

KEY = re.compile(
    r"(?<![\w./$-])((?:%s)(?:\[\w*\])?(?:\.[a-z_][a-z0-9_]*(?:\[\w*\])?)+)(?![\w(/-]|\.\w)"
    % "|".join(RunConfig.model_fields)
)
SUFFIXES = {"py", "md", "yaml", "yml", "json", "jsonl", "sh", "sbatch", "parquet", "txt", "toml", "pt", "safetensors"}
PLACEHOLDER = re.compile(r"^[A-Z][A-Z_]*$|\.\.\.|<|\|")
COMMAND = re.compile(r"^(?:[A-Z_][A-Z0-9_]*=\S*\s+)*(?:\.venv/bin/)?(?:rlrun|python3?|torchrun|bash|sbatch|\$\w+)\s")
CHECKED_SUFFIXES = (".py", ".yaml", ".yml", ".sh", ".sbatch")


@dataclass(frozen=True)
class Code:
    """A piece of code a doc shows: an inline span, a fenced block's body (``lang`` its info string), or an indented
    line."""

    where: str
    text: str
    kind: str  # "span", "fence" or "indented"
    lang: str = ""


def _code(path: Path) -> Iterator[Code]:
    text = path.read_text()
    name = path.relative_to(ROOT)
    prose = text
    for m in re.finditer(r"^ *```(\w*)\n(.*?)^ *```", text, flags=re.S | re.M):
        line = text.count("\n", 0, m.start()) + 1
        yield Code(f"{name}:{line}", m.group(2), "fence", m.group(1))
        prose = prose[: m.start()] + re.sub(r"[^\n]", " ", m.group(0)) + prose[m.end() :]
    for m in re.finditer(r"(?<!`)`([^`]+)`(?!`)", prose):
        yield Code(f"{name}:{prose.count(chr(10), 0, m.start()) + 1}", m.group(1).replace("\n", " "), "span")
    for n, line in enumerate(prose.splitlines(), 1):
        if line.startswith("    ") and COMMAND.match(line.strip() + " "):
            yield Code(f"{name}:{n}", line.strip(), "indented")


def _annotation_is_mapping(field: FieldInfo) -> bool:
    return "dict" in config_reference.type_text(field.annotation)


def lookup(key: str) -> FieldInfo | None:
    """The schema field of a dotted key (list indices dropped), or None; a key inside a free mapping
    (``engine.server_args.x``) is its mapping's field, an entry's setting (``algorithm.policy_loss.eps_clip``) the
    entry key's."""
    parts = re.sub(r"\[\w*\]", "", key).split(".")
    model = RunConfig
    for i, part in enumerate(parts):
        prefix, field = ".".join(parts[:i]), model.model_fields.get(part)
        if field is None:
            return SECTIONS[prefix].model_fields.get("name") if key in ENTRY_SETTINGS else None
        if i == len(parts) - 1 or _annotation_is_mapping(field):
            return field
        model = SECTIONS.get(".".join(parts[: i + 1]))
        if model is None:
            return None
    return None


def value_problem(key: str, field: FieldInfo, text: str) -> str | None:
    """Why ``text`` (YAML, as ``--set`` reads it) is not a valid value of ``key`` on its own (cross-field checks need
    a whole config), or None; a placeholder (``N``, ``DIR``, ``...``) is not a value."""
    if PLACEHOLDER.search(text) or _annotation_is_mapping(field):
        return None
    raw = yaml.safe_load(text)
    if key in ENTRY_NAMES and raw is not None:  # policy_loss: null is the estimator's loss
        name, settings = (raw.get("name"), raw) if isinstance(raw, dict) else (raw, {})
        if name not in ENTRY_NAMES[key]:
            return f"{key}: {name!r} is not one of {sorted(ENTRY_NAMES[key])}"
        entry = next(e for e in config_reference.algorithm_entries() if (e.key, e.name) == (key, name))
        try:
            entry.settings.model_validate({k: v for k, v in settings.items() if k != "name"})
        except ValidationError as err:
            return f"{key}: {name}'s settings {settings} are invalid: {err.errors()[0]['msg']}"
    try:
        annotation = Annotated[(field.annotation, *field.metadata)] if field.metadata else field.annotation
        TypeAdapter(annotation).validate_python(raw)
    except ValidationError as err:
        return f"{key}: {raw!r} is invalid: {err.errors()[0]['msg']}"
    return None


def key_problem(key: str, value: str | None = None) -> str | None:
    """Why ``key`` is not a config key, or ``value`` (YAML text; None: no value given) not one of its values."""
    field = lookup(key)
    if field is None:
        last = key.rsplit(".", 1)[-1]
        module = ROOT / "rlrun" / Path(*key.split("."))
        if last in SUFFIXES or module.with_suffix(".py").exists() or module.is_dir():
            return None  # a file name or an rlrun module, not a key
        return f"{key} is not a config key"
    return None if value is None else value_problem(key, field, value)


def _flatten(data: dict, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """(dotted key, value) of a YAML example's leaves, descending into sections and lists of sections."""
    for name, value in data.items():
        key = f"{prefix}{name}"
        if isinstance(value, dict) and key in SECTIONS and key not in ENTRY_NAMES:
            yield from _flatten(value, key + ".")
        elif isinstance(value, list) and key in SECTIONS and all(isinstance(v, dict) for v in value):
            for item in value:
                yield from _flatten(item, key + ".")
        else:
            yield key, value


def _yaml_problems(code: Code) -> Iterator[str]:
    try:
        data = yaml.safe_load(code.text)
    except yaml.YAMLError:
        return  # a sketch with placeholders, not a file
    if not isinstance(data, dict) or not set(data) & set(RunConfig.model_fields):
        return  # not a run config (a critic file, a verl config)
    for key, value in _flatten({k: v for k, v in data.items() if k != BASE_KEY}):
        problem = key_problem(key, yaml.safe_dump(value, default_flow_style=True).removesuffix("\n...\n").strip())
        if problem:
            yield f"{code.where}: {problem}"


def _span_problems(code: Code) -> Iterator[str]:
    for m in KEY.finditer(code.text):
        key, rest = m.group(1), code.text[m.end() :]
        value = re.match(r"=(\S+)|: (.+)$" if code.kind == "span" else r"=(\S+)", rest)
        if any(key in keys for doc, keys in FOREIGN.items() if code.where.split(":")[0].endswith(doc)):
            continue
        problem = key_problem(key, None if value is None else (value.group(1) or value.group(2)))
        if problem:
            yield f"{code.where}: {problem}"


def all_code() -> list[Code]:
    return [code for path in DOCS for code in _code(path)]


def test_every_config_key_the_docs_name_exists_with_a_valid_value():
    problems = []
    for code in all_code():
        if code.kind == "fence" and code.lang in ("yaml", "yml"):
            problems += _yaml_problems(code)
        else:
            problems += _span_problems(code)
    assert not problems, "docs name config keys or values the schema does not have:\n" + "\n".join(problems)


def test_foreign_keys_are_named_and_are_not_ours():
    for doc, keys in FOREIGN.items():
        text = (ROOT / "docs" / doc).read_text()
        for key in keys:
            assert f"`{key}" in text, f"{key} is no longer in {doc}: drop it from FOREIGN"
            assert lookup(key) is None, f"{key} is an rlrun key: drop it from FOREIGN"


@pytest.mark.parametrize(
    "key, value, expected",
    [
        ("rollout.max_staleness", "2", None),
        ("rollout.max_staleness", "N", None),
        ("engine.server_args.enable_return_routed_experts", "true", None),
        ("eval.datasets[0].path", "x.jsonl", None),
        ("algorithm.policy_loss", "{name: gspo, eps_clip: 3.0e-4}", None),
        ("algorithm.policy_loss.eps_clip", None, None),
        ("rollout.max_stalenes", None, "is not a config key"),
        ("algorithm.policy_loss.eps_clipp", None, "is not a config key"),
        ("model.dtype", "float16", "is invalid"),
        ("rollout.max_staleness", "-1", "is invalid"),
        ("algorithm.policy_loss", "null", None),
        ("algorithm.policy_loss", "gspoo", "is not one of"),
        ("algorithm.policy_loss", "{name: opsm, delta: 1.0e-4, eps_clipp: 0.2}", "settings"),
    ],
)
def test_key_check_fails_on_a_made_up_key_or_value(key, value, expected):
    problem = key_problem(key, value)
    assert (problem is None) if expected is None else (expected in problem)


# Commands


def _click_tree() -> Any:
    return typer.main.get_command(app)


def _options(command: Any) -> set[str]:
    return {"--help"} | {o for p in command.params for o in (*p.opts, *p.secondary_opts) if o.startswith("-")}


def rlrun_problem(args: list[str]) -> str | None:
    """Why ``rlrun ARGS`` names a subcommand or option the app does not register, or None."""
    command = _click_tree()
    words = list(args)
    while hasattr(command, "commands") and words and not words[0].startswith("-"):
        name = words.pop(0)
        if name not in command.commands:
            return f"rlrun has no subcommand {name!r} here (has {sorted(command.commands)})"
        command = command.commands[name]
    if hasattr(command, "commands") and words and not {"--help", "--version"} & set(words):
        return f"a subcommand is missing (one of {sorted(command.commands)})"
    options = _options(command)
    for word in words:
        option = word.split("=", 1)[0]
        if option.startswith("--") and option not in options:
            return f"{option} is not an option of this command (has {sorted(options)})"
    return None


def _mode_problem(source: Path, words: list[str]) -> str | None:
    """Why a leading mode word (``faults.py quickstart``; ``profile_tiny`` for a ``profile_*)`` case) is not in the
    script's source, or None."""
    mode = words[0] if words and re.fullmatch(r"[a-z][\w.-]*", words[0]) else None
    if mode is None or mode.endswith(CHECKED_SUFFIXES):
        return None
    text = source.read_text()
    if re.search(rf"\b{re.escape(mode)}\b", text) or f"{mode.split('_')[0]}_*" in text:
        return None
    return f"{mode!r} is not a mode of {source.relative_to(ROOT)}"


def _source_problem(source: Path, words: list[str]) -> str | None:
    """Why the options or the mode word of a command running the Python file ``source`` are not in its source."""
    text = source.read_text()
    for word in words:
        option = word.split("=", 1)[0]
        if option.startswith("--") and option != "--help" and f'"{option}"' not in text and f"'{option}'" not in text:
            return f"{option} is not an option of {source.relative_to(ROOT)}"
    return _mode_problem(source, words)


def _shell_problem(script: Path, words: list[str]) -> str | None:
    """A launch script hands its arguments after the config to ``rlrun train`` (itself or through the script it
    execs): check them as that command's; another script's mode word as for a Python file."""
    if not script.exists():
        return f"{script.relative_to(ROOT)} is not in the repository"
    text = script.read_text()
    execs = re.search(r"exec bash (\S+\.sh)", text)
    if execs:
        text += (ROOT / execs.group(1)).read_text()
    if re.search(r"-m rlrun train \S+ \"\$@\"", text):
        return rlrun_problem(["train", *words])
    return _mode_problem(script, words)


def command_problem(words: list[str]) -> str | None:
    """Why a shell command (env assignments dropped, ``[...]`` brackets of optional parts removed) names a
    subcommand, option, module or file that does not exist, or None."""
    words = [w.strip("[]") for w in words]
    while words and re.match(r"^[A-Z_][A-Z0-9_]*=", words[0]):
        words.pop(0)
    words = [w for w in words if w]
    if not words:
        return None
    program, rest = words[0].removeprefix(".venv/bin/"), words[1:]
    for word in rest:
        if word.endswith(CHECKED_SUFFIXES) and "/" in word and not word.startswith(("/", "$", "~")):
            if not (ROOT / word.split("=")[-1]).exists():
                return f"{word} is not in the repository"
    if program == "rlrun":
        return rlrun_problem(rest)
    if program in ("bash", "sbatch"):
        scripts = [w for w in rest if w.endswith((".sh", ".sbatch"))]
        return _shell_problem(ROOT / scripts[0], rest[rest.index(scripts[0]) + 1 :]) if scripts else None
    if program == "torchrun":
        if "-m" in rest:
            return command_problem(["python", *rest[rest.index("-m") :]])
        return None
    if program in ("python", "python3") and rest:
        if rest[0] == "-m":
            module = rest[1]
            if module == "rlrun":
                return rlrun_problem(rest[2:])
            if not module.startswith("rlrun"):
                return None  # pytest, pip: not ours
            spec = importlib.util.find_spec(module)
            if spec is None or spec.origin is None:
                return f"module {module} does not exist"
            return _source_problem(Path(spec.origin), rest[2:])
        if rest[0].endswith(".py") and not rest[0].startswith("/"):
            return _source_problem(ROOT / rest[0], rest[1:]) if (ROOT / rest[0]).exists() else None
    return None


def _commands(code: Code) -> Iterator[list[str]]:
    """The shell commands of a code piece, continuation lines joined and ``$VAR`` of earlier ``VAR=...`` lines
    expanded."""
    if code.kind == "span":
        if COMMAND.match(code.text + " "):
            yield shlex.split(code.text, comments=True)
        return
    if code.lang not in ("", "bash", "sh", "shell"):
        return
    variables: dict[str, str] = {}
    for line in code.text.replace("\\\n", " ").splitlines():
        try:
            words = shlex.split(line, comments=True)
        except ValueError:
            continue  # not shell (an ASCII picture)
        assignment = re.match(r"^([A-Z_][A-Z0-9_]*)=(.*)$", words[0]) if len(words) == 1 else None
        if assignment:
            variables[assignment.group(1)] = assignment.group(2)
            continue
        line = re.sub(r"\$(\w+)", lambda m: variables.get(m.group(1), m.group(0)), line)
        if COMMAND.match(line.strip() + " "):
            yield shlex.split(line, comments=True)


def test_every_command_the_docs_show_exists():
    problems = []
    for code in all_code():
        for words in _commands(code):
            problem = command_problem(words)
            if problem:
                problems.append(f"{code.where}: `{shlex.join(words)}`: {problem}")
            for i, word in enumerate(words[:-1]):
                if word == "--set":
                    key, _, value = words[i + 1].strip("[]").partition("=")
                    problem = key_problem(key, value or None)
                    if problem and key != "...":
                        problems.append(f"{code.where}: `--set {words[i + 1]}`: {problem}")
    assert not problems, "docs show commands that do not run as written:\n" + "\n".join(problems)


@pytest.mark.parametrize(
    "command, expected",
    [
        ("rlrun config validate configs/quickstart.yaml --set rollout.temperature=0.7", None),
        ("rlrun bench step --shape qwen3-4b --lora-rank 16", None),
        ("torchrun --nproc-per-node 2 -m rlrun train configs/quickstart.yaml", None),
        ("python -m rlrun.tools.config_reference --write", None),
        ("rlrun config check configs/quickstart.yaml", "no subcommand 'check'"),
        ("rlrun bench step --shapes qwen3-4b", "--shapes is not an option"),
        ("rlrun train configs/quickstrat.yaml", "is not in the repository"),
        ("python -m rlrun.tools.config_reference --rewrite", "--rewrite is not an option"),
        ("python -m rlrun.tools.no_such_tool", "does not exist"),
        ("rlrun convert --tp 2", "a subcommand is missing"),
    ],
)
def test_command_check_fails_on_a_made_up_command(command, expected):
    problem = command_problem(shlex.split(command))
    assert (problem is None) if expected is None else (expected in problem), problem


REPO_PATH = re.compile(r"(?:rlrun|docs|configs|examples|scripts|benchmarks|launch|tests)/[\w./{},-]*[\w}]")


def _expand_braces(text: str) -> list[str]:
    """The shell's ``a{b,c}d`` -> ``abd``, ``acd``, innermost group first."""
    m = re.search(r"\{([^{}]*)\}", text)
    if m is None:
        return [text]
    return [x for alt in m.group(1).split(",") for x in _expand_braces(text[: m.start()] + alt + text[m.end() :])]


def test_every_repository_path_the_docs_name_exists():
    missing = []
    for code in all_code():
        if code.kind != "span":
            continue
        for m in REPO_PATH.finditer(code.text):
            if m.start() == 0 or code.text[m.start() - 1] in " (":
                missing += [f"{code.where}: {p}" for p in _expand_braces(m.group(0)) if not (ROOT / p).exists()]
    assert not missing, "docs name files that are not in the repository:\n" + "\n".join(missing)


# Configs the repository ships (configs/*.yaml loads in test_launch_configs.py)


@pytest.mark.parametrize(
    "path",
    sorted(
        str(p.relative_to(ROOT))
        for p in [*ROOT.glob("configs/*/*.yaml"), *ROOT.glob("examples/**/*.yaml")]
        if p.parent.name != "critic"
    ),
)
def test_nested_config_loads(path):
    load_config(ROOT / path, [])


def test_critic_config_applies_to_the_ppo_quickstart():
    cfg = load_config(ROOT / "configs" / "quickstart_ppo.yaml", [])
    assert cfg.critic.config == "configs/critic/smollm2.yaml"
    critic = load_critic_config(
        cfg.model_copy(update={"critic": cfg.critic.model_copy(update={"config": str(ROOT / cfg.critic.config)})})
    )
    assert critic.optimizer.lr != cfg.optimizer.lr and critic.parallel == cfg.parallel
