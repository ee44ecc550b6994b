"""The served base models and their engine handles (treadle.server.engines.client)."""

from __future__ import annotations

from treadle.errors import InvalidRequestError
from treadle.protocol.facts import EngineFacts
from treadle.server.engines.client import EngineClient


class Engines:
    def __init__(self) -> None:
        self._by_name: dict[str, EngineClient] = {}

    def add(self, engine: EngineClient) -> None:
        self._by_name[engine.name] = engine

    def names(self) -> list[str]:
        return list(self._by_name)

    def __contains__(self, name: object) -> bool:
        return name in self._by_name

    def get(self, name: str) -> EngineClient | None:
        return self._by_name.get(name)

    def require(self, name: str | None, field: str = "base_model") -> EngineClient:
        """The engine serving `name`; InvalidRequestError naming `field` otherwise."""
        engine = self._by_name.get(name) if name is not None else None
        if engine is None:
            raise InvalidRequestError(
                f"{field}: model {name!r} is not served here; served: {sorted(self._by_name)}"
            )
        return engine

    def facts(self, name: str) -> EngineFacts:
        return self.require(name).facts

    def all(self) -> list[EngineClient]:
        return list(self._by_name.values())
