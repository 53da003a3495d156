"""The demo's plain-text timeline: one line an event, stamped with the seconds since the start,
coloured only on a terminal, and the failures it reported.

Apart from the walk because every part of the demo prints through it (the mesh as it starts,
the scenes as they run, the verdict at the end), and `run` decides from its failures."""

from __future__ import annotations

import time
from typing import TextIO


class StepFailed(Exception):
    """A step did not see what the loop promises; the text says what was missing."""


class Timeline:
    """Where the demo's lines go (`out`), and what FAILED so far."""

    def __init__(self, out: TextIO):
        self.out = out
        self.color = bool(getattr(out, "isatty", lambda: False)())
        self.t0 = time.monotonic()
        self.failures: list[str] = []

    def paint(self, text: str, code: str) -> str:
        return f"\033[{code}m{text}\033[0m" if self.color else text

    def say(self, text: str = "") -> None:
        print(text, file=self.out, flush=True)

    def event(self, label: str, text: str) -> None:
        elapsed = time.monotonic() - self.t0
        self.say(f"  {elapsed:6.2f}s  {label:<9} {text}")

    def ok(self, text: str) -> None:
        self.event("ok", self.paint(text, "32"))

    def failed(self, text: str) -> None:
        self.failures.append(text)
        self.event("FAILED", self.paint(text, "1;31"))

    def header(self, n: int, title: str, sentence: str) -> None:
        self.say()
        self.say(self.paint(f"Step {n}. {title}", "1"))
        self.say(f"  {sentence}")
