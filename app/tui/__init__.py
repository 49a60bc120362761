"""`mlight-app`: the Textual terminal app (Machine → Model → Prompts → Plan → Run → Results).

A thin layer of screens, widgets and messages over `core`'s public API. Everything that calls `core`
lives in `backend.py`; blocking work runs in thread workers that post typed messages
(`messages.py`); the screens only render. `core` never imports this package.
"""
