"""BERT as a second source encoder, in the order the data moves: which BERT (:mod:`~nmtcore.bert.resolve`,
:mod:`~nmtcore.bert.made_here`), its token stream (:mod:`~nmtcore.bert.wordpiece`), its hidden states and
their cache (:mod:`~nmtcore.bert.layer`, :mod:`~nmtcore.bert.features`), and how a missing BERT is made
here (:mod:`~nmtcore.bert.pretrain`, :mod:`~nmtcore.bert.ensure`)."""

from nmtcore.bert.ensure import ensure_bert
from nmtcore.bert.errors import BertError, BertNotFoundError, PretrainError
from nmtcore.bert.layer import (BertKD, BertLayer, BertOut, KDStates, bert_layers, pool_to_tokens, prepare_bert_inputs,
                                release_unusable_features)
from nmtcore.bert.resolve import (BertSpec, ResolvedBert, default_cache_dir, google_small_bert, network_allowed,
                                  resolve_bert)
from nmtcore.bert.wordpiece import WordPieceEncoder, nmt_word_index, word_start_table

__all__ = ["BertError", "BertKD", "BertLayer", "BertNotFoundError", "BertOut", "BertSpec", "KDStates", "PretrainError",
           "ResolvedBert", "WordPieceEncoder", "bert_layers", "default_cache_dir", "ensure_bert", "google_small_bert",
           "network_allowed", "nmt_word_index", "pool_to_tokens", "prepare_bert_inputs", "release_unusable_features",
           "resolve_bert", "word_start_table"]
