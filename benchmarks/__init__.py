"""fshard's performance suite: ``python -m benchmarks`` from the repository root.

Each benchmark is one function registered with ``@harness.benchmark`` in a module
listed in ``benchmarks.__main__.MODULES``; JAX baselines live in
``benchmarks/jax_baselines.py`` and run in their own environment (``jax_env.py``).
See docs/performance.md for the results and how to read them.
"""
