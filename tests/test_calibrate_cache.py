"""The cache a run can count on (core.runtime.calibrate_cache): measured by re-reading buffers, not the OS's figure."""

from __future__ import annotations

from core.runtime import calibrate_cache as cc

MiB = 1 << 20


def machine(cached: int, fast: float = 50e9, ram: float = 25e9, seen: list | None = None):
    """rate(nbytes) of a machine whose cache holds `cached` bytes for this process."""

    def rate(n: int) -> float:
        if seen is not None:
            seen.append(n)
        return fast if n <= cached else ram

    return rate


def test_a_vm_reporting_its_hosts_l3_gets_what_stays_cached():
    got = cc.effective_cache_bytes(480 * MiB, machine(64 * MiB), top=960 * MiB)
    assert 45 * MiB < got <= 64 * MiB  # the sizes step by √2
    assert cc.effective_cache_bytes(480 * MiB, machine(100 * MiB), top=960 * MiB) > 64 * MiB


def test_never_more_than_reported_nor_less_than_the_smallest_size():
    assert cc.effective_cache_bytes(32 * MiB, machine(10 ** 12), top=64 * MiB) <= 32 * MiB
    assert cc.effective_cache_bytes(480 * MiB, machine(0), top=960 * MiB) == cc.SMALLEST
    # a cache only somewhat faster than RAM does not count: the blend would price weights as cached that are not
    assert cc.effective_cache_bytes(480 * MiB, machine(64 * MiB, fast=30e9), top=960 * MiB) == cc.SMALLEST


def test_the_ram_reference_is_the_top_buffer_and_the_sweep_stops_at_the_first_miss():
    seen = []
    cc.effective_cache_bytes(480 * MiB, machine(8 * MiB, seen=seen), top=960 * MiB)
    sweep = seen[:seen.index(960 * MiB, 1)] if seen.count(960 * MiB) > 1 else seen
    assert sweep[0] == 960 * MiB and max(sweep[1:]) < 16 * MiB  # nothing read past the first size that missed


def test_the_median_of_the_sweeps_stands_against_one_noisy_sweep():
    calls = {"n": 0}

    def noisy(n: int) -> float:  # the second sweep sees a 128 MiB cache, the others 32 MiB
        if n == 960 * MiB:
            calls["n"] += 1
        cached = 128 * MiB if calls["n"] == 2 else 32 * MiB
        return 50e9 if n <= cached else 25e9

    got = cc.effective_cache_bytes(480 * MiB, noisy, top=960 * MiB)
    assert 22 * MiB < got <= 32 * MiB


def test_it_measures_this_machine_within_its_bounds():
    got = cc.effective_cache_bytes(16 * MiB, top=32 * MiB)
    assert cc.SMALLEST <= got <= 16 * MiB
