"""Per-layer precision validation of kernel-patched models (`tiletune verify`)."""
