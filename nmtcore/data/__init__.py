"""Parallel text from files on disk to padded batches: corpus → vocab → dataset → batching."""

from nmtcore.data.batching import (Batch, batch_indices, collate, collate_bert, inference_batches, iterate_batches,
                                   restore_order)
from nmtcore.data.corpus import (CORPORA, DOC_MARKER, Corpus, DataError, ParallelText, corpus_file, decode_lines,
                                 get_corpus, load_split, read_lines, split_documents)
from nmtcore.data.dataset import (BertInputs, DocumentIndex, EncodedSplit, FeatureSource, PreparedData, encode_split,
                                  length_filter, prepare_data)
from nmtcore.data.prefetch import prefetch
from nmtcore.data.vocab import SubwordVocab, VocabError

__all__ = ["Batch", "BertInputs", "CORPORA", "Corpus", "DOC_MARKER", "DataError", "DocumentIndex", "EncodedSplit",
           "FeatureSource", "ParallelText", "PreparedData", "SubwordVocab", "VocabError", "batch_indices", "collate",
           "collate_bert", "corpus_file", "decode_lines", "encode_split", "get_corpus", "inference_batches",
           "iterate_batches", "length_filter", "load_split", "prefetch", "prepare_data", "read_lines", "restore_order",
           "split_documents"]
