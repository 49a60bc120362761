"""Drag-in path parsing: what terminals paste when a file is dropped on them, turned into a path."""

from __future__ import annotations

import pytest

from app.tui.paths import parse_dropped_path

CASES = [
    # (pasted text, path) — POSIX terminals
    ("/home/me/prompts.jsonl", "/home/me/prompts.jsonl"),
    ("  /home/me/prompts.jsonl \n", "/home/me/prompts.jsonl"),
    ("/home/me/my prompts.jsonl", "/home/me/my prompts.jsonl"),  # typed, not escaped
    ("'/home/me/my prompts.jsonl'", "/home/me/my prompts.jsonl"),  # GNOME Terminal, Konsole
    ('"/home/me/my prompts.jsonl"', "/home/me/my prompts.jsonl"),
    ("/home/me/my\\ prompts.jsonl", "/home/me/my prompts.jsonl"),  # iTerm2, macOS Terminal
    ("/Users/me/Q\\&A\\ \\(v2\\).csv", "/Users/me/Q&A (v2).csv"),
    ("'/home/me/it'\\''s.txt'", "/home/me/it's.txt"),  # shell-quoted single quote
    ("'/home/me/a b.txt' '/home/me/c.txt'", "/home/me/a b.txt"),  # several files: the first
    ("/home/me/a.txt\n/home/me/b.txt", "/home/me/a.txt"),
    ("~/prompts.txt", "~/prompts.txt"),  # ~ is expanded when the path is used, not here
    # file:// URLs with percent-encoding (kitty, some file managers, browsers)
    ("file:///home/me/my%20prompts.jsonl", "/home/me/my prompts.jsonl"),
    ("file://localhost/home/me/a.txt", "/home/me/a.txt"),
    ("'file:///home/me/100%25.txt'", "/home/me/100%.txt"),
    # non-ASCII names
    ("file:///home/me/%C3%A9t%C3%A9/donn%C3%A9es.txt", "/home/me/été/données.txt"),
    ("'/home/me/日本語 プロンプト.txt'", "/home/me/日本語 プロンプト.txt"),
    ("/home/me/Ελληνικά\\ αρχείο.csv", "/home/me/Ελληνικά αρχείο.csv"),
    ("/home/me/emoji 🚀.jsonl", "/home/me/emoji 🚀.jsonl"),
    # Windows: backslashes are separators, never escapes
    ("C:\\Users\\me\\prompts.csv", "C:\\Users\\me\\prompts.csv"),
    ('"C:\\Users\\me\\My Files\\prompts.csv"', "C:\\Users\\me\\My Files\\prompts.csv"),  # Windows Terminal
    ("& 'C:\\Users\\me\\My Files\\p.csv'", "C:\\Users\\me\\My Files\\p.csv"),  # PowerShell
    ("C:/Users/me/p.csv", "C:/Users/me/p.csv"),
    ("\\\\server\\share\\p.txt", "\\\\server\\share\\p.txt"),  # UNC
    ("file:///C:/Users/me/My%20Files/p.csv", "C:/Users/me/My Files/p.csv"),
    ("file://server/share/p.txt", "\\\\server\\share\\p.txt"),
    ('"C:\\Users\\José\\données.txt"', "C:\\Users\\José\\données.txt"),
    # degenerate input
    ("", ""),
    ("   \n", ""),
    ("'/home/me/unbalanced.txt", "/home/me/unbalanced.txt"),
]


@pytest.mark.parametrize("pasted, expected", CASES)
def test_parse_dropped_path(pasted, expected):
    assert parse_dropped_path(pasted) == expected


def test_parsing_is_idempotent():
    for _, expected in CASES:
        if "\\" not in expected and not expected.startswith("'"):
            assert parse_dropped_path(expected) == expected
