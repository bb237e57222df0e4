"""The model zoo: the declared interface (:mod:`~nmtcore.models.base`), one file per family, the registry."""

from nmtcore.models.base import KDStates, MemoryTraits, ModelOutput, NMTModel
from nmtcore.models.registry import MODEL_CLASSES, build_model, model_class, prepare_model_resources

__all__ = ["KDStates", "MODEL_CLASSES", "MemoryTraits", "ModelOutput", "NMTModel", "build_model", "model_class",
           "prepare_model_resources"]
