"""An experiment's whole configuration, how it is built, and the one override engine.

:class:`ExperimentConfig` holds the sections of :mod:`nmtcore.config.sections`; its ``model`` section is
polymorphic: ``model.name`` picks the family's config class from :data:`~nmtcore.config.families.MODEL_CONFIGS`,
so a BERT-fused run validates BERT-fused fields. Configs are built from nested dicts, YAML files or flat
dotted keys (``"train.lr": 1e-3``). :meth:`ExperimentConfig.with_overrides` is the only way overrides are
applied, by the CLI, the sweeps, the benches and the tests alike: a run is the same whoever starts it.
"""

from __future__ import annotations

import dataclasses
import os
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import yaml

from nmtcore.config.families import MODEL_CONFIGS
from nmtcore.config.sections import (ConfigError, DataConfig, DecodeConfig, ModelConfig, TrainConfig, check)


# Flat keys that change how fast a run goes or how much memory it takes, never its numbers (beyond the last bits,
# as another thread count may): a resumed sweep takes them from its command (nmtcore.sweep.driver), a re-attached
# MLflow run records a change of them instead of refusing it (nmtcore.tracking.store), and reuse keys leave them
# out (nmtcore.sweep.reuse).
SPEED_ONLY_KEYS = ("model.bert.activation_checkpointing", "model.tgt_bert.activation_checkpointing",
                   "train.num_threads", "train.log_interval", "data.prefetch_batches")


@dataclass(frozen=True)
class ExperimentConfig:
    """One experiment: what to train on, which model, how to train and decode, where to write."""

    name: str = "nmtcore"
    output_dir: str = "runs/nmtcore"
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    decode: DecodeConfig = field(default_factory=DecodeConfig)

    def __post_init__(self) -> None:
        check(bool(self.name), "name", "must not be empty")
        check(bool(self.output_dir), "output_dir", "must not be empty")

    # ------------------------------------------------------------------ builders
    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "ExperimentConfig":
        """Build from a nested dict; unknown keys raise."""
        return _build(cls, d, "")

    @classmethod
    def from_yaml(cls, path: str | os.PathLike) -> "ExperimentConfig":
        """Build from a YAML file with data/model/train/decode sections; one-line errors naming the file.

        Strict, so that a file never trains something other than what it says: a key given twice, an empty or
        comment-only document (it would train every default), a document that is not a mapping and a
        directory are each refused."""
        if Path(path).is_dir():
            raise ConfigError(f"{path}: is a directory, not a YAML file")
        try:
            with open(path, encoding="utf-8") as f:
                d = yaml.load(f, Loader=_StrictLoader)  # noqa: S506 - a SafeLoader that refuses repeated keys
        except FileNotFoundError:
            raise ConfigError(f"{path}: no such file") from None
        except UnicodeDecodeError:
            raise ConfigError(f"{path}: not valid UTF-8") from None
        except yaml.YAMLError as e:  # its message spans lines; the position and the problem fit in one
            mark = getattr(e, "problem_mark", None)
            where = f" line {mark.line + 1}, column {mark.column + 1}:" if mark is not None else ""
            what = e.problem if isinstance(e, _RepeatedKey) else f"not valid YAML ({getattr(e, 'problem', None) or e})"
            raise ConfigError(f"{path}:{where} {what}") from None
        if d is None:
            raise ConfigError(f"{path}: empty (no data/model/train/decode sections); an empty file would train "
                              "every default, so it is refused")
        if not isinstance(d, dict):
            raise ConfigError(f"{path}: top level must be a mapping")
        return cls.from_dict(d)

    def to_dict(self) -> dict[str, Any]:
        """Nested plain dict (tuples as lists), the form checkpoints and YAML files carry."""
        return _to_plain(self)

    def flat(self) -> dict[str, Any]:
        """Flat dotted view (``{"train.lr": 5e-4, ...}``), as logged to MLflow and used by sweeps."""
        return flatten(self.to_dict())

    def with_overrides(self, overrides: Mapping[str, Any]) -> "ExperimentConfig":
        """A copy with flat dotted keys replaced, validated once at the end.

        Values may be Python values or strings as the CLI passes them; a string is read against the
        field's type (``"1e-3"`` for a float, ``"true"`` for a bool, ``"a,b"`` or ``"[a, b]"`` for a tuple), and
        a string field keeps its text as given. An unknown key raises :class:`ConfigError` naming it. A ``model.name`` change re-types the model section first
        (see below), so the new family's own keys (``model.p_net``) can be set in the same call.
        """
        d = self.to_dict()
        # A model.name change re-types the model section: a field every family shares (the
        # Transformer's dims, the BERT choice) keeps its value when it was set (differs from the old
        # family's default); everything else starts at the new family's defaults, e.g. the source BERT
        # plm_sponsored needs, and can be overridden in the same call.
        if "model.name" in overrides and overrides["model.name"] != d["model"]["name"]:
            shared = {f.name for f in dataclasses.fields(ModelConfig)}
            name = _parse_scalar(overrides["model.name"])
            old = d["model"]
            old_defaults = _field_defaults(_model_config_class(str(old["name"]), "model.name"))
            new_defaults = _field_defaults(_model_config_class(str(name), "model.name"))
            d["model"] = {k: _keep_set(old[k], old_defaults.get(k), v) if k in shared else v
                          for k, v in new_defaults.items()}
            d["model"]["name"] = name
        for key, value in overrides.items():
            parts = key.split(".")
            node = d
            for i, p in enumerate(parts[:-1]):
                if not isinstance(node.get(p), dict):
                    raise ConfigError(f"{key}: unknown key ({'.'.join(parts[: i + 1])} is not a section)")
                node = node[p]
            if parts[-1] not in node:
                raise ConfigError(f"{key}: unknown key")
            node[parts[-1]] = value
        return ExperimentConfig.from_dict(d)

    def to_yaml(self) -> str:
        """The config as YAML (what ``--config`` reads back)."""
        return yaml.safe_dump(self.to_dict(), sort_keys=False)


def _field_defaults(cls: type) -> dict[str, Any]:
    """A config dataclass's fields that have defaults, as plain values."""
    return {f.name: _to_plain(f.default if f.default_factory is dataclasses.MISSING else f.default_factory())
            for f in dataclasses.fields(cls)
            if f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING}


def _keep_set(value: Any, old_default: Any, new_default: Any) -> Any:
    """``value`` where it differs from ``old_default`` (it was set), else ``new_default``; per key in sections."""
    if isinstance(value, dict) and isinstance(old_default, dict) and isinstance(new_default, dict):
        return {k: _keep_set(value[k], old_default.get(k), v) if k in value else v for k, v in new_default.items()}
    return value if value != old_default else new_default


def flatten(d: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested mapping → flat dotted keys."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, Mapping):
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out


def nest(flat: Mapping[str, Any]) -> dict[str, Any]:
    """Flat dotted keys → nested dicts (the inverse of :func:`flatten`)."""
    out: dict[str, Any] = {}
    for key, value in flat.items():
        node = out
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return out


def parse_overrides(items: list[str]) -> dict[str, Any]:
    """``["train.lr=1e-3", ...]`` → ``{"train.lr": "1e-3"}`` (values parsed later, against field types)."""
    out: dict[str, Any] = {}
    for item in items:
        if "=" not in item:
            raise ConfigError(f"{item}: expected key=value")
        k, v = item.split("=", 1)
        out[k.strip()] = v
    return out


def _model_config_class(name: str, key: str) -> type[ModelConfig]:
    if name not in MODEL_CONFIGS:
        raise ConfigError(f"{key}: unknown model {name!r} (registered: {', '.join(sorted(MODEL_CONFIGS))})")
    return MODEL_CONFIGS[name]


def _build(cls: type, d: Any, prefix: str) -> Any:
    if isinstance(d, cls):
        return d
    if not isinstance(d, Mapping):
        raise ConfigError(f"{prefix.rstrip('.') or 'config'}: expected a mapping, got {type(d).__name__}")
    if cls is ModelConfig:
        cls = _model_config_class(str(d.get("name", "transformer")), f"{prefix}name")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    kwargs: dict[str, Any] = {}
    for k, v in d.items():
        if k not in fields:
            raise ConfigError(f"{prefix}{k}: unknown key")
        kwargs[k] = _coerce(v, hints[k], f"{prefix}{k}")
    return cls(**kwargs)


def _parse_scalar(v: Any) -> Any:
    """A YAML scalar, list or mapping written as text; the text itself if it does not parse."""
    if isinstance(v, str):
        try:
            return yaml.safe_load(v) if v.strip() else v
        except yaml.YAMLError:
            return v
    return v


def _coerce(v: Any, tp: Any, key: str) -> Any:
    """``v`` as a value of type ``tp`` (strings are read against the type); one-line error naming ``key``."""
    if dataclasses.is_dataclass(tp):
        return _build(tp, _parse_scalar(v) if isinstance(v, str) else v, key + ".")
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if v is None and type(None) in args:
            return None
        for a in args:
            if a is type(None):
                continue
            try:
                return _coerce(v, a, key)
            except ConfigError:
                continue
        raise ConfigError(f"{key}: expected {tp}, got {v!r}")
    if origin is tuple:
        if isinstance(v, str) and v.strip().startswith("["):
            v = _parse_scalar(v)  # a YAML flow list, e.g. "[0.9, 0.98]" (how MLflow params show tuples)
        elif isinstance(v, str):
            v = [s.strip() for s in v.split(",") if s.strip()]
        if not isinstance(v, (list, tuple)):
            raise ConfigError(f"{key}: expected a list, got {v!r}")
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_coerce(x, args[0], key) for x in v)
        if len(v) != len(args):
            raise ConfigError(f"{key}: expected {len(args)} values, got {len(v)}")
        return tuple(_coerce(x, a, key) for x, a in zip(v, args))
    if tp is bool:
        if isinstance(v, bool):
            return v
        if isinstance(v, str) and v.lower() in ("true", "false"):
            return v.lower() == "true"
        raise ConfigError(f"{key}: expected true/false, got {v!r}")
    if tp is int:
        if isinstance(v, bool):
            raise ConfigError(f"{key}: expected an integer, got {v!r}")
        if isinstance(v, int):
            return v
        if isinstance(v, float) and v.is_integer():
            return int(v)
        if isinstance(v, str):
            try:
                return int(v)
            except ValueError:
                pass
        raise ConfigError(f"{key}: expected an integer, got {v!r}")
    if tp is float:
        if isinstance(v, bool):
            raise ConfigError(f"{key}: expected a number, got {v!r}")
        if isinstance(v, (int, float)):
            return float(v)
        if isinstance(v, str):
            try:
                return float(v)
            except ValueError:
                pass
        raise ConfigError(f"{key}: expected a number, got {v!r}")
    if tp is str:
        if isinstance(v, (str, int, float)) and not isinstance(v, bool):
            return str(v)
        raise ConfigError(f"{key}: expected a string, got {v!r}")
    return v


def _to_plain(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj):
        return {f.name: _to_plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, tuple):
        return [_to_plain(x) for x in obj]
    return obj


class _RepeatedKey(yaml.constructor.ConstructorError):
    """A mapping gives one key twice."""


class _StrictLoader(yaml.SafeLoader):
    """PyYAML's safe loader, refusing a mapping that gives one key twice (plain PyYAML keeps the last value)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: set = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise _RepeatedKey(None, None, f"key {key!r} given twice (the second would silently win)",
                                   key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep=deep)
