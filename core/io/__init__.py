"""Batch I/O: what goes into a run and what comes out.

Prompt readers (txt, jsonl, OpenAI Batch, csv/tsv), result writers (JSONL, CSV), the run store
(manifest, fsynced results, resume, lock), model downloads and the benchmark workloads.
Imports: anything in `core` — never `app` (tests/test_layering.py checks it); nothing in `core`
imports it.
"""
