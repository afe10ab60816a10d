"""The transformers model behind any wrapper the trainer puts around it.

peft wraps the causal LM in a ``PeftModel`` whose ``get_base_model()`` returns it; the
head, the embeddings, the decoder layers and the config are found on that inner model.
Every module that looks inside a model goes through `unwrap` (and `output_head`), so a new
wrapper means one change here."""
from __future__ import annotations

from torch import nn


def unwrap(model: nn.Module) -> nn.Module:
    """The model itself, or the base model a peft wrapper holds."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def output_head(model: nn.Module) -> nn.Module | None:
    """The LM head (output embeddings) of ``model``, whatever wraps it; None if it has none."""
    inner = unwrap(model)
    return inner.get_output_embeddings() if hasattr(inner, "get_output_embeddings") else None
