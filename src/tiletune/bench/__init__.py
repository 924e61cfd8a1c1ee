"""Ablation benchmarks of training-step time, throughput and memory (`tiletune bench`)."""
