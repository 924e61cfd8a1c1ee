"""tiletune: LLaMA-Factory-compatible fine-tuning with verified TileLang kernels on NVIDIA and AMD GPUs."""

__version__ = "0.1.0"
