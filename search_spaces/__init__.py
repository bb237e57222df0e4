"""Search spaces as data: one module per study, each a dict of named variants.

``get_space("bert_size_grid:demo")`` returns a :class:`~nmtcore.sweep.space.SearchSpace`; the study's
default variant is used when none is named. The registry below is explicit (no import side effects):
a new study is one module plus one line here.
"""

from __future__ import annotations

from types import ModuleType
from typing import Mapping

from search_spaces import ablations, bert_benefit, bert_size_grid, drop_net, kd_alpha, mask_threshold, transformer_grid
from nmtcore.sweep.space import (ARM_KEY, Choice, Curve, Grid, Heatmap, IntRange, LogUniform, SearchSpace, SpaceError,
                                Uniform, choice, grid, integer, loguniform, steps, uniform)

_MODULES: tuple[ModuleType, ...] = (bert_size_grid, bert_benefit, mask_threshold, drop_net, kd_alpha, ablations,
                                    transformer_grid)
MODULES: dict[str, ModuleType] = {m.STUDY: m for m in _MODULES}
STUDIES: dict[str, Mapping[str, SearchSpace]] = {m.STUDY: m.SPACES for m in _MODULES}
DEFAULT_VARIANT: dict[str, str] = {m.STUDY: m.DEFAULT for m in _MODULES}


def get_space(spec: str) -> SearchSpace:
    """``"study"`` (its default variant) or ``"study:variant"`` → the space; one-line error otherwise."""
    study, _, variant = spec.partition(":")
    if study not in STUDIES:
        raise SpaceError(f"unknown study {study!r} (studies: {', '.join(STUDIES)})")
    variant = variant or DEFAULT_VARIANT[study]
    if variant not in STUDIES[study]:
        raise SpaceError(f"study {study!r} has no variant {variant!r} (variants: {', '.join(STUDIES[study])})")
    return STUDIES[study][variant]


def all_spaces() -> list[SearchSpace]:
    """Every variant of every study."""
    return [space for spaces in STUDIES.values() for space in spaces.values()]


__all__ = ["ARM_KEY", "Choice", "Curve", "DEFAULT_VARIANT", "Grid", "Heatmap", "IntRange", "LogUniform", "STUDIES",
           "MODULES", "SearchSpace", "SpaceError", "Uniform", "all_spaces", "choice", "get_space", "grid", "integer",
           "loguniform", "steps", "uniform"]
