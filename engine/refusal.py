"""`Refusal`: why something cannot run, as a value — the one shape every refusal takes, from the engine's cost
functions, the lane's link and hooks, and every launch kind's `check()`. `reason` is in the user's words; `where`
names what was refused (a class and its rule, an op kind and its output), empty where the caller adds it."""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class Refusal:
    reason: str
    where: str = ""

    def __str__(self) -> str:
        return f"{self.where}: {self.reason}" if self.where else self.reason

    def at(self, where: str) -> "Refusal":
        """This refusal placed at `where` (kept where it already names a place)."""
        return self if self.where else replace(self, where=where)
