"""Names for a CPU speed measured now (HardwareSpec.cpu_speed). A calibration is no longer stamped with one, so
nothing asks for a measurement: core.plan.hardware.with_speed finds no stamp and leaves the machine as it is."""


def key(math: str, threads: int | None) -> str:
    return f"{math}@{threads or 0}"


def measure(math: str, threads: int | None = None) -> float:
    return 0.0  # unknown: CpuCosts.at_speed leaves the costs as calibrated
