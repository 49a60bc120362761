"""Multi-turn conversations (MT-Bench): turn k needs turn k-1's answer, so a run goes in waves of one turn each,
as FastChat does. Answers come from the finished records, so a resumed run builds a turn as an uninterrupted one.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from core.io.prompts import PromptEntry, PromptSet, Reject, reject_orphan_turns
from core.telemetry import EventSink, WarningEvent, ignore


def waves(entries: list[PromptEntry]) -> list[list[PromptEntry]]:
    """File order within a turn; single-turn entries go in the first wave."""
    by_turn: dict[int, list[PromptEntry]] = {}
    for e in entries:
        by_turn.setdefault(e.turn or 1, []).append(e)
    return [by_turn[k] for k in sorted(by_turn)]


def wave_requests(engine, prompts: PromptSet, wave: list[PromptEntry], requests: dict[str, Any],
                  done: dict[str, dict], on_event: EventSink = ignore) -> list[Any]:
    """The requests of a wave's pending entries, later turns built from `done`. A later turn that no longer fits the
    context (or lacks an earlier answer) moves to `prompts.rejects`, and so do the question's turns after it."""
    out, before = [], set(map(id, prompts.rejects))
    for e in wave:
        req, answered = requests[e.id], all(i in done for i in e.earlier)
        if e.earlier and answered:  # the model's answers go between the user turns
            answers = [str(done[i]["output"]) for i in e.earlier]
            req = dataclasses.replace(req, messages=e.request_kwargs(answers=answers)["messages"])
        if not answered:
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
