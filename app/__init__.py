"""mlight's user-facing layer: the `mlight` command line and the `mlight-app` terminal UI. Calls only `core`'s
public API; holds no engine logic of its own."""
