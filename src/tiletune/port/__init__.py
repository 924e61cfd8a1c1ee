"""Port CUDA kernels to HIP: translation engines, a migration lint, reports and a hipcc compile check.

`hipify.run_hipify` ties them together for `tiletune hipify`; each module is usable on its own
(`lint.lint_file` needs no translator, no torch and no compiler).
"""
