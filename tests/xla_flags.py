"""The XLA flags of every test process. conftest sets them before jax starts; a test that starts its own
processes with another device count passes `xla_flags(devices)`, so that they compile at the same
optimisation level as the test itself (across levels, results agree only to float rounding: FMA
contraction and vectorised loops differ).

The suite compiles far more than it runs (hundreds of programs, most run for a few steps): XLA:CPU's
LLVM backend at -O0 compiles them faster (tests/test_continuous.py's refilled-slot test alone: 27.6 s ->
20.4 s; the whole suite on 2 cores: README, "Guarantees and how they are tested"). Benchmarks, the demo
and every user run keep XLA's default level.
"""

FAST_COMPILE = "--xla_backend_optimization_level=0"


def xla_flags(devices: int | None = None) -> str:
    """XLA_FLAGS for a test process: `devices` fake host devices (None: jax's one CPU device) and the
    suite's fast-compile level."""
    device_flag = [] if devices is None else [f"--xla_force_host_platform_device_count={devices}"]
    return " ".join([*device_flag, FAST_COMPILE])
