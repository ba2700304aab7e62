"""The ``gguf_probe`` backend: the learned router's difficulty probe, a small GGUF model's reading
of a prompt (its final hidden state, mean-pooled; :mod:`backends.hidden`) for a routed model's
second quality head (``probe`` on a routed model, docs/router.md). One prefill, no generation, in
the file's worker process (``backends.engine_host``): a fault there costs the probe, which the
router then does without, never the gateway. It serves no chat (``backends.local_engine``).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from backends.engine_host import EngineSpec
from backends.local_engine import LocalEngineBackend
from backends.registry import register
from policies.errors import UpstreamError


class ProbeBackend(LocalEngineBackend):
    what = "reads prompts for the router"
    label = "probe"

    def engine_spec(self) -> EngineSpec:
        s = self.spec
        return EngineSpec("hidden", s.n_ctx, s.n_threads, s.n_ctx)

    async def read(self, text: str, timeout_s: float) -> tuple[np.ndarray, int]:
        """The prompt's unit vector and the tokens read (a longer prompt is cut at ``n_ctx``)."""
        got = await self.call("read", {"text": text}, timeout_s)
        try:
            return np.asarray(got["vector"], dtype=np.float32), int(got["tokens"])
        except (KeyError, TypeError, ValueError) as exc:
            raise UpstreamError(f"probe {self.name} answered no vector: {exc!r}") from None


@register("gguf_probe")
def _build(name: str, spec: Any) -> ProbeBackend:
    return ProbeBackend(name, spec)
