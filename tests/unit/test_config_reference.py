"""docs/config.md is the schema's reference, regenerated and compared; the docs' relative links resolve."""

import re
from pathlib import Path

from pydantic import BaseModel

from rlrun.config.schema import RunConfig
from rlrun.tools import config_reference

ROOT = Path(__file__).resolve().parents[2]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def test_config_md_is_the_generated_reference():
    written = (ROOT / "docs" / "config.md").read_text()
    assert written == config_reference.render(), (
        "docs/config.md is stale: run `python -m rlrun.tools.config_reference --write` and commit it"
    )


def _dotted_keys(model: type[BaseModel], prefix: str = "") -> list[tuple[str, str]]:
    """(section key, field name) of every leaf field, walked from the models' field tables directly."""
    keys = []
    for name, field in model.model_fields.items():
        annotation = field.annotation
        inner = [a for a in getattr(annotation, "__args__", ()) if isinstance(a, type) and issubclass(a, BaseModel)]
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            inner = [annotation]
        if inner:
            listed = getattr(annotation, "__origin__", None) is list
            keys += _dotted_keys(inner[0], f"{prefix}{name}{'[i]' if listed else ''}.")
        else:
            keys.append((prefix.rstrip("."), name))
    return keys


def test_every_field_is_listed_under_its_section_with_its_docstring():
    page = config_reference.render()
    bodies = dict(re.findall(r"^## (\S+)\n(.*?)(?=^## |\Z)", page, flags=re.S | re.M))
    keys = _dotted_keys(RunConfig)
    assert len(keys) > 150
    for section, name in keys:
        assert f"* **`{name}`**" in bodies[section], f"{section}.{name} is missing from docs/config.md"
    description = RunConfig.model_fields["model"].annotation.model_fields["path"].description
    assert description and description.splitlines()[0] in bodies["model"]


def test_every_algorithm_entry_is_listed_with_its_settings():
    page = config_reference.render()
    for entry in config_reference.algorithm_entries():
        body = page.split(f"### {entry.key}: {entry.name}\n", 1)[1].split("\n### ", 1)[0]
        for name in entry.settings.model_fields:
            assert f"* **`{name}`**" in body, f"{entry.key}: {entry.name}'s setting {name} is missing"


def test_type_and_default_text():
    field = RunConfig.model_fields["model"].annotation.model_fields["lm_head"]
    assert config_reference.type_text(field.annotation) == '"chunked" | "chunked_kept" | "logits"'
    assert config_reference.default_text(field) == '"chunked"'
    assert config_reference.type_text(int | None) == "int | null"
    assert config_reference.type_text(tuple[int, ...]) == "tuple[int, ...]"


def _relative_links(path: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    links = [m.group(1) for m in LINK.finditer(text)]
    return [link for link in links if not re.match(r"[a-z]+:", link) and not link.startswith("#")]


def test_relative_links_in_readme_and_docs_point_at_files():
    pages = [ROOT / "README.md", ROOT / "rlrun" / "kernels" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    broken = []
    for page in pages:
        for link in _relative_links(page):
            target = (page.parent / link.split("#")[0]).resolve()
            if not target.exists() or ROOT not in target.parents:
                broken.append(f"{page.relative_to(ROOT)}: {link}")
    assert not broken, "links to missing files: " + ", ".join(broken)


def test_architecture_names_every_package_and_only_paths_that_exist():
    text = (ROOT / "docs" / "architecture.md").read_text()
    named = set(re.findall(r"`(rlrun/[\w/]+(?:\.py)?)`", text))
    assert "rlrun/trainer/loop.py" in named
    assert [path for path in sorted(named) if not (ROOT / path).exists()] == []
    packages = {f"rlrun/{p.parent.name}/" for p in (ROOT / "rlrun").glob("*/__init__.py")}
    assert sorted(packages - named) == [], "packages missing from docs/architecture.md's package map"
