"""kvbridge.bindings (populated by later work)."""

__all__: list[str] = []
