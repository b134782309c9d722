"""kvbridge: KV-cache transfer engine and tiered cache store."""

__version__ = "0.1.0"

__all__ = ["__version__"]
