"""hsstore's benchmark suite: run each script from the repository root as a module,
``python -m benchmarks.bench_store --help`` (benchmarks/README.md lists them)."""
