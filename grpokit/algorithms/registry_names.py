"""The names in a registry (losses, advantage estimators) as a sequence read at each use, so that an entry registered
later (from user code) is a valid choice too."""

from __future__ import annotations

from collections.abc import Sequence


class LiveNames(Sequence):
    def __init__(self, registry: dict):
        self.registry = registry

    def __getitem__(self, i):
        return tuple(self.registry)[i]

    def __len__(self) -> int:
        return len(self.registry)

    def __contains__(self, name) -> bool:
        return name in self.registry

    def __repr__(self) -> str:
        return repr(tuple(self.registry))
