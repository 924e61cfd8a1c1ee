"""tiletune: LLaMA-Factory-compatible fine-tuning with verified TileLang kernels on NVIDIA and AMD GPUs."""

__version__ = "0.1.0"


def __getattr__(name: str):
    """Lazy exports, so `import tiletune` stays light (no torch, no transformers)."""
    if name == "apply_kernels":
        from tiletune.patch import apply_kernels

        return apply_kernels
    raise AttributeError(f"module 'tiletune' has no attribute {name!r}")
