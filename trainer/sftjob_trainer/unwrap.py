"""The transformers model behind any wrapper the trainer puts around it.

peft wraps the causal LM in a ``PeftModel`` whose ``get_base_model()`` returns it; the
head, the embeddings, the decoder layers and the config are found on that inner model.
Every module that looks inside a model goes through `unwrap` (and `output_head`,
`model_config`), so a new wrapper means one change here."""
from __future__ import annotations

from typing import TYPE_CHECKING, cast

from torch import nn

if TYPE_CHECKING:
    from transformers import PretrainedConfig


def unwrap(model: nn.Module) -> nn.Module:
    """The model itself, or the base model a peft wrapper holds."""
    get_base_model = getattr(model, "get_base_model", None)  # nn.Module's __getattr__ says Tensor | Module
    return get_base_model() if get_base_model is not None else model


def output_head(model: nn.Module) -> nn.Module | None:
    """The LM head (output embeddings) of ``model``, whatever wraps it; None if it has none."""
    inner = unwrap(model)
    get_output_embeddings = getattr(inner, "get_output_embeddings", None)
    return get_output_embeddings() if get_output_embeddings is not None else None


def model_config(model: nn.Module) -> PretrainedConfig:
    """The transformers config of ``model``, whatever wraps it."""
    # A cast: nn.Module's __getattr__ types every attribute it does not know as Tensor | Module.
    return cast("PretrainedConfig", unwrap(model).config)
