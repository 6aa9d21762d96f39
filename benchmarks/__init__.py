"""tilevox benchmarks: run each as a module from the repository root, e.g. `python -m benchmarks.soak`.

Shared pieces (provenance of a result, a server started as a subprocess) live in `benchmarks.common`.
"""
