"""Names for a CPU speed measured now (HardwareSpec.cpu_speed). Calibrations carry no speed stamp any more, so
core.plan.hardware.with_speed measures nothing and CpuCosts.at_speed leaves the costs as calibrated."""


def key(math: str, threads: int | None) -> str:
    return f"{math}@{threads or 0}"


def measure(math: str, threads: int | None = None) -> float:
    return 0.0
