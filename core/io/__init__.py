"""Batch I/O: what goes into a run and what comes out (README's module table).
Imports: anything in `core`, never `app`; nothing in `core` imports it (tests/test_layering.py checks both).
"""
