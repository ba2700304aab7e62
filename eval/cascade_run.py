"""``triage eval``'s run, prepared: the labeled rows read, and each chosen tier's answers on them
(computed once, cached under ``out/cache``), as :class:`eval.cascade_eval.TierSpec` s.

What only the gateway can do is passed in: a policy's live model tiers (:class:`LiveTiers`, the
gateway's runtime: ``gateway/cli/live_tier.py``), and how progress is shown (:class:`Progress`).
A problem with the input raises :class:`RunError`, which the CLI prints and exits with.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from eval.cascade_eval import TierSpec
from eval.tier_outputs import Row, TierCache
from eval.tier_runs import Compute
from policies.schema import Policy
from policies.tiers import EncoderTier, ModelTier, ScorerTier, Tier

if TYPE_CHECKING:
    from classifiers.service import Classifier


class RunError(Exception):
    """What stops a run before it measures anything: the message, and the exit code it asks for."""

    def __init__(self, message: str, code: int = 2) -> None:
        super().__init__(message)
        self.code = code


class LiveTiers(Protocol):
    """A policy's model tiers asked for real (the gateway's runtime, built by the CLI)."""

    def compute(self, tier: ModelTier) -> Compute: ...

    def close(self) -> None: ...


class Progress(Protocol):
    """How a long step is shown: a tier's answers filled row by row, a step without a count."""

    def fill(self, cache: TierCache, rows: list[Row], compute: Compute, name: str) -> dict[str, Any]: ...

    def status(self, text: str) -> AbstractContextManager[Any]: ...


class Quiet:
    """:class:`Progress` that shows nothing (tests, scripts)."""

    def fill(self, cache: TierCache, rows: list[Row], compute: Compute, name: str) -> dict[str, Any]:
        return cache.fill(rows, compute, lambda: None)

    @contextmanager
    def status(self, text: str) -> Iterator[None]:
        yield


LiveFactory = Callable[[Policy, Path], LiveTiers]


@dataclass
class Rows:
    dev: list[Row]
    test: list[Row]
    problems: list[str]  # the lines skipped, each once


def load_rows(
    pol: Policy, policy: Path, data: Sequence[Path], dev_cap: int, test_cap: int, tasks: Sequence[str] = ()
) -> Rows:
    """The typed files' dev and test rows (a seeded sample of at most the caps each), then each
    task's intent rows as choice questions."""
    from eval.tier_outputs import typed_rows

    missing = [str(p) for p in data if not p.is_file()]
    if missing:
        raise RunError(f"no such file: {', '.join(missing)}")
    problems: list[str] = []
    dev = [r for p in data for r in typed_rows(p, "dev", dev_cap, problems)]
    test = [r for p in data for r in typed_rows(p, "test", test_cap, problems)]
    for name in tasks:
        task_dev, task_test = task_rows(pol, policy, name, dev_cap, test_cap)
        dev, test = dev + task_dev, test + task_test
    return Rows(dev, test, list(dict.fromkeys(problems)))  # a file's bad lines are met once per split read


def task_rows(pol: Policy, policy: Path, name: str, dev_cap: int, test_cap: int) -> tuple[list[Row], list[Row]]:
    from classifiers.service import data_dir
    from eval.tier_outputs import intent_rows

    if pol.classifier is None or name not in pol.classifier.tasks:
        known = ", ".join(pol.classifier.tasks) if pol.classifier is not None else "none"
        raise RunError(f"--task {name}: not a task of the policy's classifier (it has: {known or 'none'})")
    spec = pol.classifier.tasks[name]
    path = data_dir(pol.classifier, policy.resolve().parent) / spec.data
    if not path.is_file():
        raise RunError(f"--task {name}: no such file: {path}")
    dev, test = (
        intent_rows(path, name, split, cap, 5, spec.text_field, spec.label_field)
        for split, cap in (("dev", dev_cap), ("test", test_cap))
    )
    return dev, test


@dataclass
class Tiers:
    """How the tiers are built: the policy (and its folder), the cache folder, the tiers chosen."""

    pol: Policy
    base: Path  # the policy's folder
    out: Path  # the run's folder: the caches go under out/cache
    only: list[str] | None = None  # the policy's tiers to run (None: all)
    progress: Progress = field(default_factory=Quiet)
    live: LiveFactory | None = None  # how the policy's model tiers are asked (None: a model tier is an error)

    def specs(self, rows: Rows) -> list[TierSpec]:
        """Each chosen tier's answers on every row, as a spec the fitting and the report read.
        With a classifier, ``rows`` get their question embeddings (for learned gates) first."""
        assert self.pol.cascade is not None
        chosen = [t for t in self.pol.cascade.tiers if self.only is None or t.name in self.only]
        unknown = sorted(set(self.only or ()) - {t.name for t in self.pol.cascade.tiers})
        if unknown or not chosen:
            raise RunError(f"--tiers: no tier named {', '.join(unknown) or 'any of them'} in the policy's cascade")
        clf = None
        if self.pol.classifier is not None:  # loaded once: the embeddings of the rows and the encoder tier
            from classifiers.service import Classifier

            clf = Classifier.load(self.pol.classifier, self.base)
            self._embed(rows, clf)
        everyone, live, specs = rows.dev + rows.test, None, []
        for tier in chosen:
            if isinstance(tier, ModelTier):
                if live is None:
                    live = self._live()
                compute, key = live.compute(tier), f"model-{tier.model}-{self.pol.upstream_name(tier.model)}"
            else:
                compute, key = self._local(tier, clf)
            cache = TierCache(self.out / "cache" / f"{key}.jsonl")
            specs.append(spec_of(tier, self.progress.fill(cache, everyone, compute, tier.name)))
        if live is not None:
            live.close()
        return specs

    def _live(self) -> LiveTiers:
        if self.live is None:
            raise RunError("a model tier is asked live: no live runtime was given")
        return self.live(self.pol, self.base)

    def _local(self, tier: Tier, clf: Classifier | None) -> tuple[Compute, str]:
        """An encoder or scorer tier's answers, and its cache key (what changes its answers)."""
        from eval import tier_runs

        if isinstance(tier, EncoderTier):
            assert self.pol.classifier is not None  # validation: an encoder tier needs a classifier
            compute, fingerprint = tier_runs.encoder(self.pol, self.base, clf)
            return compute, f"encoder-{self.pol.classifier.encoder.precision}-{fingerprint}"
        assert isinstance(tier, ScorerTier)
        return tier_runs.scorer(self.pol, tier), scorer_key(self.pol, tier)

    def _embed(self, rows: Rows, clf: Classifier) -> None:
        """The rows with their question embeddings (for learned gates), cached beside the tier outputs."""
        from eval.tier_outputs import with_embeddings

        assert self.pol.classifier is not None
        enc = self.pol.classifier.encoder
        path = self.out / "cache" / f"embeddings-{enc.precision}-l{enc.layers}-t{enc.max_tokens}.npz"
        with self.progress.status("embedding the questions"):
            rows.dev = with_embeddings(rows.dev, path, clf.encoder.embed)
            rows.test = with_embeddings(rows.test, path, clf.encoder.embed)


def scorer_key(pol: Policy, tier: ScorerTier) -> str:
    """A scorer tier's cache key: its model file, and its prompt's mode and version."""
    b = pol.backends[tier.backend]
    model = b.gguf.package or Path(b.gguf.path or "").name  # type: ignore[union-attr]
    if tier.mode == "lettered":
        from backends.lettered import PROMPT_VERSION

        key = f"scorer-{model}-lettered-v{PROMPT_VERSION}"
    elif tier.mode == "reasoned":
        from backends.lettered import REASONED_VERSION

        key = f"scorer-{model}-reasoned{tier.reason_tokens}-v{REASONED_VERSION}"
    else:
        key = f"scorer-{model}-t{tier.templates.version}-{tier.length_norm}"
    return key + (f"-orders{tier.orders}" if tier.orders > 1 else "")


def spec_of(tier: Tier, outputs: dict[str, Any]) -> TierSpec:
    return TierSpec(
        tier.name,
        tier.type,
        outputs,
        per_call=tier.prices.per_call,
        per_1k_tokens=tier.prices.per_1k_tokens,
        gate_kind=tier.gate,
        escalation_margin=tier.escalation_margin,
        thresholds=dict(tier.thresholds.items()),
        task_thresholds=dict(tier.task_thresholds),
        orders=tier.orders if isinstance(tier, ScorerTier) else 1,
        accuracy=dict(tier.accuracy.items()),
        agreement={k: v.rule() for k, v in tier.agreement.items()},
    )


def recorded_top(data: Sequence[Path], rows: Rows, names: Sequence[str], price: float) -> TierSpec:
    """Recorded models (``model_labels``, beside the typed files' folder) as one top tier: on each
    set, the first model given that has answers for it."""
    from eval import tier_runs

    where = data[0].resolve().parents[1] if data else Path(".")
    computes: dict[str, Compute] = {}
    for name in names:
        for source, compute in tier_runs.recorded(where, name).items():
            computes.setdefault(source, compute)
    outputs = {r.id: computes[r.source](r) for r in rows.dev + rows.test if r.source in computes}
    return TierSpec(names[0] if len(names) == 1 else "top", "recorded", outputs, per_call=price)
