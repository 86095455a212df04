"""YAML recipes mapped 1:1 onto pydantic models, with ``--set a.b=c`` overrides.

Every job (extract, train, evaluate, sweep) loads its recipe through :func:`load_recipe`, so
unknown keys, wrong types and bad overrides are reported the same way everywhere: with the dotted
key and the file.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ConfigDict, ValidationError

from hsstore.errors import RecipeError

RecipeT = TypeVar("RecipeT", bound=BaseModel)


class RecipeModel(BaseModel):
    """Base class of recipe models: unknown keys are refused, values validated on assignment."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, protected_namespaces=())


def add_recipe_arguments(parser: Any, example_recipe: str, example_overrides: str) -> None:
    """The positional RECIPE and the repeatable ``--set KEY=VALUE`` every job's subcommand takes."""
    parser.add_argument("recipe", help=f"YAML recipe (see {example_recipe})")
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help=f"override a recipe key, dotted, YAML value ({example_overrides})",
    )


def parse_override(text: str) -> tuple[list[str], Any]:
    """Split ``a.b=value`` into its key path and its YAML-parsed value (``[x,y]``, ``3``, ``true``)."""
    if "=" not in text:
        raise RecipeError(f"override {text!r} is not KEY=VALUE (e.g. --set limit=100)")
    key, raw = text.split("=", 1)
    key = key.strip()
    if not key or any(not part for part in key.split(".")):
        raise RecipeError(f"override {text!r} has an empty key part")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as err:
        raise RecipeError(f"override {key}: value {raw!r} is not valid YAML: {err}") from err
    return key.split("."), value


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply ``--set`` overrides to a raw recipe dict, creating nested dicts as needed."""
    for text in overrides:
        path, value = parse_override(text)
        node = data
        for i, part in enumerate(path[:-1]):
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            if not isinstance(child, dict):
                dotted = ".".join(path[: i + 1])
                raise RecipeError(f"override {'.'.join(path)}: {dotted} is not a mapping")
            node = child
        node[path[-1]] = value
    return data


def format_validation_error(err: ValidationError, source: str) -> str:
    """One line per problem, each naming the dotted key."""
    lines = [f"invalid recipe {source}:"]
    for problem in err.errors():
        dotted = ".".join(str(p) for p in problem["loc"]) or "<root>"
        if problem["type"] == "extra_forbidden":
            lines.append(f"  {dotted}: unknown key")
        else:
            lines.append(f"  {dotted}: {problem['msg']}")
    return "\n".join(lines)


def read_yaml(path: str | Path) -> dict[str, Any]:
    """Read a YAML mapping with the safe loader; errors name the file."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError as err:
        raise RecipeError(f"recipe file {path} does not exist") from err
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise RecipeError(f"recipe file {path} is not valid YAML: {err}") from err
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise RecipeError(f"recipe file {path} must hold a mapping, found {type(data).__name__}")
    return data


def build_recipe(
    model: type[RecipeT], data: dict[str, Any], overrides: list[str] | None = None, source: str = "<dict>"
) -> RecipeT:
    """Validate a raw dict (plus overrides) into ``model``; raises :class:`RecipeError`."""
    data = apply_overrides(dict(data), list(overrides or []))
    try:
        return model.model_validate(data)
    except ValidationError as err:
        raise RecipeError(format_validation_error(err, source)) from err


def load_recipe(
    model: type[RecipeT], path: str | Path, overrides: list[str] | None = None
) -> RecipeT:
    """Load a YAML recipe file into ``model``, applying ``--set`` overrides first."""
    return build_recipe(model, read_yaml(path), overrides, source=str(path))


def dump_recipe(recipe: BaseModel, path: str | Path) -> None:
    """Write the fully resolved recipe next to a job's outputs, for the record."""
    Path(path).write_text(yaml.safe_dump(recipe.model_dump(mode="json"), sort_keys=False))
