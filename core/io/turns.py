"""Multi-turn conversations (MT-Bench): each later turn runs with the model's own earlier answers in context.

A question's turns are the entries `Q:1`, `Q:2`, ... (`core.io.prompts`). Turn k can be asked only once
turn k-1 has its answer, so a run goes in waves — every question's first turn, then every second turn,
and so on — the way FastChat generates MT-Bench answers. The answers come from the finished records
(the run file's, on a resume), so a turn is built the same way whether its earlier turns ran a minute
ago or in an interrupted session.

Boundary: entries, finished records and prepared requests in; the next wave's requests out. The run
loop that saves each result is `core.io.runstore.run_pending`; the CLI and the app both call it.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from core.io.prompts import PromptEntry, PromptSet, Reject, reject_orphan_turns
from core.telemetry import EventSink, WarningEvent, ignore


def waves(entries: list[PromptEntry]) -> list[list[PromptEntry]]:
    """The entries by turn, in file order within a turn: single-turn entries all go in the first wave."""
    by_turn: dict[int, list[PromptEntry]] = {}
    for e in entries:
        by_turn.setdefault(e.turn or 1, []).append(e)
    return [by_turn[k] for k in sorted(by_turn)]


def placeholder_answers(entry: PromptEntry) -> tuple[str, ...]:
    """Empty answers to the earlier turns: the shortest this turn's conversation can be, for checking
    before the run that it can fit the context at all (`runstore.prepare_requests`)."""
    return ("",) * len(entry.earlier)


def with_answers(entry: PromptEntry, request: Any, done: dict[str, dict]) -> Any | None:
    """`request` with the model's finished answers to the entry's earlier turns in its messages; None
    when an earlier turn has no answer yet."""
    if not entry.earlier:
        return request
    if any(i not in done for i in entry.earlier):
        return None
    answers = [str(done[i]["output"]) for i in entry.earlier]
    return dataclasses.replace(request, messages=entry.request_kwargs(answers=answers)["messages"])


def wave_requests(engine, prompts: PromptSet, wave: list[PromptEntry], requests: dict[str, Any],
                  done: dict[str, dict], on_event: EventSink = ignore) -> list[Any]:
    """The requests of a wave's pending entries, its later turns built from `done`. A later turn whose
    conversation, answers included, leaves no room in the context (or whose earlier turn has no answer)
    moves to `prompts.rejects` with a warning, and so do the question's turns after it."""
    out, before = [], set(map(id, prompts.rejects))
    for e in wave:
        req = with_answers(e, requests[e.id], done)
        if req is None:
            reason = f"turn {e.turn} cannot run: an earlier turn of the same question has no answer"
        elif e.earlier and (n := len(engine.prompt_token_ids(req))) >= engine.context_length:
            reason = (f"turn {e.turn} with the earlier answers is {n} tokens (after the chat template); "
                      f"the model's context is {engine.context_length} tokens")
        else:
            out.append(req)
            continue
        prompts.entries.remove(e)
        prompts.rejects.append(Reject(prompts.source, e.line, reason, e.id, json.dumps(list(e.messages or ()))))
    reject_orphan_turns(prompts)
    for r in prompts.rejects:
        if id(r) not in before:
            on_event(WarningEvent(f"{r}; set aside"))
    return out


def record(result_dict: dict, entry: PromptEntry) -> dict:
    """The output record of one turn: the engine's fields, plus `turn` for a multi-turn question."""
    if entry.turn is not None:
        result_dict["turn"] = entry.turn
    return result_dict
