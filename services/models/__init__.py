"""Model definitions and weight loading."""

from services.models.loader import load_model, resolve_model_path

__all__ = ["load_model", "resolve_model_path"]
