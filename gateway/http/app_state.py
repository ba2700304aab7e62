"""What the app keeps between requests."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from gateway.http.exchange import ConcurrencyGate
from gateway.obs.metrics import Metrics
from gateway.service.runtime import RuntimeHolder
from gateway.state.responses import ResponseStore

if TYPE_CHECKING:
    from gateway.batch.runner import BatchRunner


@dataclass
class GatewayState:
    holder: RuntimeHolder
    metrics: Metrics
    gate: ConcurrencyGate = field(default_factory=ConcurrencyGate)
    batches: BatchRunner | None = None
    responses: ResponseStore = field(default_factory=ResponseStore)  # stored /v1/responses, this process
