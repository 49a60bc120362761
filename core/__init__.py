"""mlight core: model description, weights, planner and engine. Headless: it never imports `app` or `textual`,
never prints, and reports progress and telemetry through callbacks and typed events.
"""

__version__ = "0.1.0"
