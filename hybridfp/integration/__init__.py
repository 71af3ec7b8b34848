"""Integration with the rest of the training stack (activation recompute so far)."""

from .recompute import checkpoint

__all__ = ["checkpoint"]
