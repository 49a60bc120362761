"""Turn what a terminal pastes when a file is dragged onto it (shell-quoted, backslash-escaped, a file:// URL,
or on Windows double-quoted, maybe after PowerShell's `& `) into a plain path string; testable on any OS."""

from __future__ import annotations

import re
import shlex
from urllib.parse import unquote, urlparse

from core import platform

# C:\ or C:/ (drive letter) or \\server\share (UNC): backslashes there are separators, not escapes.
_WINDOWS = re.compile(r"^(?:[A-Za-z]:[\\/]|\\\\[^\\])")
_QUOTES = ("'", '"')


def _from_file_url(url: str) -> str:
    parsed = urlparse(url)
    path = unquote(parsed.path, encoding="utf-8", errors="strict")
    if re.match(r"^/[A-Za-z]:/", path):  # file:///C:/Users/x -> C:/Users/x
        path = path[1:]
    if parsed.netloc and parsed.netloc != "localhost":  # file://server/share/x -> \\server\share\x
        return "\\\\" + parsed.netloc + path.replace("/", "\\")
    return path


def parse_dropped_path(text: str) -> str:
    """The path in `text` as pasted by a terminal; the first one when several files were dropped."""
    text = text.strip().strip("\r\n")
    if not text:
        return ""
    text = text.splitlines()[0].strip()  # one file per line in some terminals: take the first
    if text.startswith("& "):  # PowerShell's drag-and-drop: & 'C:\path'
        text = text[2:].lstrip()
    unquoted = text[1:-1] if len(text) >= 2 and text[0] == text[-1] and text[0] in _QUOTES else text
    if unquoted.lower().startswith("file://"):
        return _from_file_url(unquoted)
    if platform.is_windows():  # no shell escapes: the first (quoted) path as it stands
        if text[:1] in _QUOTES:
            end = text.find(text[0], 1)
            return text[1:end] if end > 0 else text[1:]
        return text
    if _WINDOWS.match(unquoted):
        return unquoted
    if "\\" not in text and text[:1] not in _QUOTES:
        return text  # a plain path, spaces and all
    try:
        parts = shlex.split(text)
    except ValueError:  # unbalanced quote: keep what is there, minus the stray quote
        return unquoted.strip("'\"")
    if len(parts) == 1 or text[:1] in _QUOTES:
        first = parts[0] if parts else ""
        return _from_file_url(first) if first.lower().startswith("file://") else first
    return text
