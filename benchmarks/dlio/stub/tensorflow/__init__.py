"""A stand-in for TensorFlow, for DLIO runs only (never installed, never on the tests' path).

dlio-benchmark 2.0.0 imports ``tensorflow`` at module level in its profiler factory
(``profiler/tf_profiler.py``), which every run imports, even with ``framework: pytorch``.
TensorFlow is a multi-GB install that the PyTorch workloads run here never call, so
benchmarks/dlio/run.py puts this directory first on DLIO's ``PYTHONPATH``: the import
succeeds, and any real use of TensorFlow fails at once with a clear error.
"""

__version__ = "0.0.0+shardio-dlio-stub"


def __getattr__(name: str) -> object:
    raise RuntimeError(
        f"tensorflow.{name}: this is shardio's DLIO stub (benchmarks/dlio/stub); "
        "run DLIO with framework=pytorch"
    )
