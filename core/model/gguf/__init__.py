"""GGUF in: a llama.cpp / Ollama / LM Studio file read as an mlight checkpoint (its metadata one of our
families' configs, expert blocks the file's own bytes).
"""
