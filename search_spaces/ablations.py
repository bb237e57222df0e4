"""Ablation studies: each variant is a set of named arms (bundles of flat overrides) trained side by
side; the report compares every arm to the first (or the named baseline) with a paired bootstrap.

The arms switch explicit config fields, never model names (STYLE: no behaviour on name substrings).
The fields below are the ones the BERT models are specified to expose; until a model is registered its
study fails up front with "model '...' is not registered", and ``tests/test_search_spaces.py`` checks
every key against the real config class as soon as it is.
"""

from search_spaces.spec import SearchSpace

STUDY = "ablations"

SPACES = {
    # BERT-JAM M0–M3 (Table 7): each ablation is a registered model whose config is defined by its
    # fields (M1 glu=weighted_sum, M2 bert_layers=last without the GLU phase, M3 no warm-up phase).
    "bert_jam": SearchSpace(
        STUDY, "bert_jam", "bert_jam",
        arms={
            "M0_full": {"model.name": "bert_jam"},
            "M1_weighted_sum": {"model.name": "bert_jam_m1"},
            "M2_last_layer": {"model.name": "bert_jam_m2"},
            "M3_no_warmup": {"model.name": "bert_jam_m3"},
        },
        baseline="M0_full", citation="Zhang et al. 2020, BERT-JAM, Table 7 (M0-M3)",
        description="BERT-JAM ablation: GLU layer fusion, all BERT layers, three-phase optimisation"),
    # Mask fusion M0–M3: masking (θ > 0) and the fusion gate, each on and off.
    "mask_fusion": SearchSpace(
        STUDY, "mask_fusion", "mask_fusion",
        arms={
            "M0_full": {"model.mask_threshold": 0.01, "model.fusion_gate": True},
            "M1_no_mask": {"model.mask_threshold": 0.0, "model.fusion_gate": True},
            "M2_no_gate": {"model.mask_threshold": 0.01, "model.fusion_gate": False},
            "M3_no_mask_no_gate": {"model.mask_threshold": 0.0, "model.fusion_gate": False},
        },
        baseline="M0_full", description="mask-fusion ablation: masking threshold and fusion gate"),
    # PLM-sponsored: which loss terms the PLM contributes.
    "plm_sponsored_loss": SearchSpace(
        STUDY, "plm_sponsored_loss", "plm_sponsored",
        arms={
            "nmt_only": {"train.kd_alpha": 1.0},
            "nmt_plus_kd": {"train.kd_alpha": 0.5},
            "kd_only": {"train.kd_alpha": 0.0},
        },
        baseline="nmt_only", description="PLM-sponsored loss ablation: NMT loss, KD loss, both"),
    # Document context: where the context enters the model...
    "doc_context_integration": SearchSpace(
        STUDY, "doc_context_integration", "doc_context",
        arms={
            "sentence_level": {"model.context_integration": "none"},
            "encoder": {"model.context_integration": "encoder"},
            "decoder": {"model.context_integration": "decoder"},
            "encoder_decoder": {"model.context_integration": "both"},
        },
        baseline="sentence_level", description="document-context integration: none, encoder, decoder, both"),
    # ...and which context it is.
    "doc_context_type": SearchSpace(
        STUDY, "doc_context_type", "doc_context",
        arms={
            "none": {"model.context_type": "none"},
            "previous_source": {"model.context_type": "previous_source"},
            "previous_target": {"model.context_type": "previous_target"},
            "previous_both": {"model.context_type": "previous_both"},
        },
        baseline="none", description="document-context type: previous source / target / both sentences"),
}
DEFAULT = "bert_jam"
