"""Build an `EngineConfig` from flat settings: a YAML file, keyword overrides and CLI flags."""
from __future__ import annotations

import argparse
import json
import types
import typing
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import ValidationError

from raylm.configs.engine_config import SECTIONS, EngineConfig, SpeculativeConfig
from raylm.configs.pooler_config import PoolerConfig

# field name -> section name, e.g. "max_num_seqs" -> "scheduler_config"
FIELD_SECTION: dict[str, str] = {
    name: section for section, cls in SECTIONS.items() for name in cls.model_fields
}
# Sections given whole under their own name (a mapping in YAML and keywords, JSON on the command line), because their
# field names repeat other sections' (speculative_config's `model` is the draft's), or because vLLM gives them so.
NESTED_SECTIONS: dict[str, type] = {"speculative_config": SpeculativeConfig, "pooler_config": PoolerConfig}
CONFIGS_DIR = Path(__file__).resolve().parent


def load_yaml(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.exists() and (CONFIGS_DIR / path.name).exists():
        path = CONFIGS_DIR / path.name
    if not path.exists():
        raise FileNotFoundError(f"config file {path} does not exist")
    data = yaml.safe_load(path.read_text()) or {}
    if not isinstance(data, dict):
        raise ValueError(f"config file {path}: expected a mapping of setting names to values")
    return data


def make_engine_config(config_file: str | Path | None = None, **overrides: Any) -> EngineConfig:
    """Settings from `config_file` (flat YAML keys), then `overrides` on top; None values are unset."""
    settings = load_yaml(config_file) if config_file else {}
    settings.update({k: v for k, v in overrides.items() if v is not None})
    # vLLM's nested form: kv_transfer_config={"kv_connector": ..., "kv_role": ...}.
    nested = settings.pop("kv_transfer_config", None)
    if nested is not None:
        if not isinstance(nested, dict):
            raise ValueError(f"kv_transfer_config: expected a mapping of settings, got {nested!r}")
        settings.update(nested)
    unknown = sorted(set(settings) - set(FIELD_SECTION) - set(NESTED_SECTIONS))
    if unknown:
        raise ValueError(f"unknown setting(s) {unknown}; known settings: {sorted([*FIELD_SECTION, *NESTED_SECTIONS])}")
    sections: dict[str, Any] = {name: _nested_section(name, settings.pop(name))
                                 for name in NESTED_SECTIONS if name in settings}
    grouped: dict[str, dict[str, Any]] = {section: {} for section in SECTIONS}
    for name, value in settings.items():
        grouped[FIELD_SECTION[name]][name] = value
    for section, values in grouped.items():
        try:
            sections[section] = SECTIONS[section](**values)
        except ValidationError as err:
            raise ValueError(_describe(err)) from None
    return EngineConfig(**sections)


def _nested_section(name: str, value: Any) -> Any:
    """A whole section from a mapping, a JSON object (the CLI's form) or an instance."""
    cls = NESTED_SECTIONS[name]
    if isinstance(value, cls):
        return value
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as err:
            raise ValueError(f"{name}: not valid JSON ({err}): {value!r}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{name}: expected a mapping of its fields, got {value!r}")
    try:
        return cls(**value)
    except ValidationError as err:
        raise ValueError(_describe(err, name)) from None


def _describe(err: ValidationError, section: str | None = None) -> str:
    prefix = f"{section}." if section else ""
    lines = [f"{prefix}{'.'.join(str(p) for p in e['loc'])}: {e['msg']} (got {e.get('input')!r})"
             for e in err.errors()]
    return "invalid setting: " + "; ".join(lines)


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """One `--flag-name` per config field; unset flags stay None so YAML values survive."""
    for name, section in FIELD_SECTION.items():
        field = SECTIONS[section].model_fields[name]
        flag = "--" + name.replace("_", "-")
        kind = _base_type(field.annotation)
        if kind is bool:
            parser.add_argument(flag, dest=name, action=argparse.BooleanOptionalAction, default=None,
                                help=field.description)
        elif typing.get_origin(kind) is Literal:
            parser.add_argument(flag, dest=name, choices=typing.get_args(kind), default=None,
                                help=field.description)
        elif typing.get_origin(kind) is list:
            item = typing.get_args(kind)[0]
            parser.add_argument(flag, dest=name, type=item, nargs="+", default=None, help=field.description)
        else:
            parser.add_argument(flag, dest=name, type=kind, default=None, help=field.description)
    for name in NESTED_SECTIONS:  # parsed (JSON) when the config is made, so the error names the section
        parser.add_argument("--" + name.replace("_", "-"), dest=name, default=None,
                            help=f"{name} as a JSON object, e.g. {_NESTED_EXAMPLES[name]}")


_NESTED_EXAMPLES = {"speculative_config": '\'{"method": "ngram", "num_speculative_tokens": 3}\'',
                    "pooler_config": '\'{"pooling_type": "MEAN", "normalize": false}\''}


def engine_args_from(namespace: argparse.Namespace) -> dict[str, Any]:
    return {name: getattr(namespace, name) for name in [*FIELD_SECTION, *NESTED_SECTIONS]
            if getattr(namespace, name, None) is not None}


def _base_type(annotation: Any) -> Any:
    """`int | None` -> int; `Literal[...] | None` -> the Literal."""
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        return args[0]
    return annotation
