"""`mlight run --graphs auto|on|off` reaches `Engine.load(graphs=...)`: the flag's value goes to the load
(the default leaves load's own "auto"), the engine loaded runs with it, and other values are refused."""

from __future__ import annotations

from pathlib import Path

import pytest

from app.cli import build_parser, main
from app.commands import run
from core.runtime.engine import Engine

PROMPTS = Path(__file__).parent / "data" / "io" / "prompts.tsv"


def _load_kwargs(monkeypatch, *extra: str) -> dict:
    seen = []
    monkeypatch.setattr(Engine, "load", classmethod(lambda cls, path, **kw: seen.append(kw)))
    argv = ["run", "--model", "m", "--prompts", "p.txt", "--out", "o.jsonl", *extra]
    run._load_engine(build_parser(argv)[0].parse_args(argv), "m", progress=None)
    return seen[0]


def test_graphs_flag_is_passed_to_engine_load(monkeypatch):
    assert _load_kwargs(monkeypatch, "--graphs", "on")["graphs"] == "on"
    assert _load_kwargs(monkeypatch, "--graphs", "off")["graphs"] == "off"
    assert _load_kwargs(monkeypatch).get("graphs", "auto") == "auto"


def test_graphs_flag_refuses_other_values(monkeypatch, capsys):
    with pytest.raises(SystemExit) as e:
        _load_kwargs(monkeypatch, "--graphs", "always")
    assert e.value.code == 2 and "--graphs" in capsys.readouterr().err


@pytest.mark.slow
def test_run_loads_the_engine_with_the_flags_graphs(tmp_path, capsys, monkeypatch, demo_model):
    seen = []
    real = Engine.load.__func__

    def load(cls, model_dir, **kw):
        engine = real(cls, model_dir, **kw)
        seen.append(engine.config.graphs)
        return engine

    monkeypatch.setattr(Engine, "load", classmethod(load))
    code = main(["run", "--prompts", str(PROMPTS), "--max-new-tokens", "2", "--out", str(tmp_path / "o.jsonl"),
                 "--graphs", "off"])
    assert code == 0, capsys.readouterr().err
    assert seen == ["off"]
