"""Decoding: one batched beam/greedy search for every model (:mod:`~nmtcore.decoding.beam_search`), and
translating splits and raw input (:mod:`~nmtcore.decoding.translator`)."""

from nmtcore.decoding.beam_search import Hypothesis
from nmtcore.decoding.translator import Translator, load_translator, translate_split

__all__ = ["Hypothesis", "Translator", "load_translator", "translate_split"]
