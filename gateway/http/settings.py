"""Process settings of the gateway (where the policy is, how to watch it). Read by the CLI."""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict


class Settings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    policy_path: Path
    watch_policy: bool = True  # reload when the file changes
    handle_sighup: bool = True  # reload on SIGHUP (main thread only)
    configure_logging: bool = True  # apply the policy's logging section to structlog
    freeze_gc: bool = False  # after start-up, move every object to the permanent GC generation
    workers: int = 1  # processes serving the port (`triage serve --workers`): checks what the policy shares
