"""What can go wrong with a BERT: each a one-line message saying what to change."""


class BertError(ValueError):
    """A BERT cannot be resolved, loaded or used as configured (one-line message saying what to change)."""


class BertNotFoundError(BertError):
    """No location answered a BERT spec; the message lists what was tried and what would work."""


class PretrainError(BertError):
    """A pretraining spec or corpus is unusable (one-line message)."""
