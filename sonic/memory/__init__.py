"""Activation-memory measurement (docs/design.md §3): what a forward pass keeps for backward."""

from sonic.memory.profile import ActivationMemoryReport, SavedTensor, profile_activation_memory

__all__ = ["ActivationMemoryReport", "SavedTensor", "profile_activation_memory"]
