"""kvpilot: a paged-attention LLM inference engine and the Kubernetes operator that tunes it."""

__version__ = "0.1.0"
