"""The CPU as a compute device: its instruction set (`isa`), the dtype it computes in (`compute`), and the C and
torch kernels chosen from them; every fast path has a fallback with the same numbers, tested by faking the ISA.
"""
