"""The engine's logger, and warnings said once a process (a fallback to the reference executor,
an option that does nothing here): a user loop calling a module must not repeat them."""

from __future__ import annotations

import logging

log = logging.getLogger("engine")
_said: set[str] = set()


def log_once(msg: str) -> None:
    if msg not in _said:
        _said.add(msg)
        log.warning(msg)
