"""What the app keeps between requests."""

from __future__ import annotations

from dataclasses import dataclass, field

from gateway.exchange import Gate
from gateway.metrics import Metrics
from gateway.runtime import RuntimeHolder


@dataclass
class GatewayState:
    holder: RuntimeHolder
    metrics: Metrics
    gate: Gate = field(default_factory=Gate)
