"""Model definitions: plain ``nn.Module``s, free of paging and sharding code."""

from __future__ import annotations

from typing import Any

from torch import nn

from angel_ptm.errors import ConfigValueError
from angel_ptm.models.gpt import GPT, GPTConfig, estimate_activation_bytes

__all__ = ["GPT", "GPTConfig", "build_model", "estimate_activation_bytes"]


def build_model(model_cfg: Any) -> nn.Module:
    """Build the model named by ``model_cfg.name`` (a dict or an object; a missing name means "gpt")."""
    name = model_cfg.get("name", "gpt") if isinstance(model_cfg, dict) else getattr(model_cfg, "name", "gpt")
    if name == "gpt":
        return GPT(GPTConfig.from_mapping(model_cfg))
    raise ConfigValueError(f"model.name {name!r} is not a known model (known: 'gpt')")
