"""`mlight-app`: the Textual terminal app (Machine → Model → Prompts → Plan → Run → Results). Every call into
`core` lives in `backend.py`; blocking work runs in thread workers that post typed messages; the screens only
render. `core` never imports this package."""
