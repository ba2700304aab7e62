"""The routed models' probes read offline (``triage train``, ``triage eval --router``): per
``gguf_probe`` backend, a :class:`backends.hidden.HiddenCache` of its file (``reading: letters``:
:class:`backends.letters.LetterCache`; ``answer``: :class:`backends.answer.AnswerCache`), opened on
first use, each prompt's reading kept on disk so that a second run reads none again. A row the probe
cannot read (an empty prompt; letters: one that is not lettered) reads as zeros: the served router
does not probe it."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from backends import gguf
from backends.answer import AnswerCache
from backends.hidden import HiddenCache
from backends.letters import LetterCache
from policies.schema import GGUFProbeBackendSpec, Policy


class ProbeReaders:
    """``readers(backend)(texts)``: the readings of these prompts by that probe backend, (rows, width)."""

    def __init__(self, policy: Policy, say: Callable[[str], None] = print) -> None:
        self.policy = policy
        self.say = say
        self.caches: dict[str, HiddenCache] = {}

    def __call__(self, backend: str) -> Callable[[list[str]], np.ndarray]:
        if backend not in self.caches:
            spec = self.policy.backends[backend]
            assert isinstance(spec, GGUFProbeBackendSpec), "validation: a probe names a gguf_probe backend"
            path = gguf.model_file(spec.gguf.package, spec.gguf.path)
            self.say(
                f"probe {backend}: reading prompts ({spec.reading}) with {path.name} (n_ctx {spec.n_ctx}, "
                f"{spec.n_threads} threads)"
            )
            kind = {"letters": LetterCache, "answer": AnswerCache}.get(spec.reading, HiddenCache)
            self.caches[backend] = kind(path, spec.n_ctx, spec.n_threads, say=self.say)
        return self.caches[backend]

    def close(self) -> None:
        for cache in self.caches.values():
            cache.close()
