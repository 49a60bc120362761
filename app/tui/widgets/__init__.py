"""Small display widgets shared by the screens (no core calls, no workers)."""
