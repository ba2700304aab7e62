"""``triage route "prompt"``: what the encoder tier decides for one prompt, and how fast: the
Python API's :meth:`gateway.Gateway.route` on the policy, opened without its engines."""

from __future__ import annotations

import json
from dataclasses import asdict
from importlib.resources import files
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.console import Console

from policies.errors import NotReady, PolicyInvalid
from policies.schema import RoutedModel, SemanticModel

if TYPE_CHECKING:
    from gateway.embedded import Routing

DEFAULT_POLICY = "default.yaml"  # the served default: its `routed` model reads the shipped heads


def route(
    prompt: Annotated[str, typer.Argument(help="The prompt to classify.")],
    policy: Annotated[
        Path | None,
        typer.Option(
            help="Policy YAML with a `classifier` section (default: the served default, "
            "policies/examples/default.yaml, whose heads ship with it).",
            envvar="TRIAGE_POLICY",
        ),
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
    top: Annotated[int, typer.Option(help="Classes shown per head.")] = 3,
    model: Annotated[
        str | None,
        typer.Option(
            help="The semantic or routed virtual model whose decision to "
            "show (default: the policy's first semantic one, else its first routed one)."
        ),
    ] = None,
) -> None:
    """Print the decision of a semantic or routed virtual model (the policy's first semantic one, or
    --model; a routed model's decision lists every candidate's predicted P(right) and expected cost),
    every head's top classes and probabilities (the injection head's is P(router) of the prompt or
    its most router-like sentence), the familiarity guard and the latency. The policy's engines are
    not started."""
    from gateway.embedded import Gateway

    policy = policy or Path(str(files("policies").joinpath("examples", DEFAULT_POLICY)))
    try:
        gw = Gateway(policy, engines=False)
        pol = gw.policy
        if pol.classifier is None:
            raise PolicyInvalid([f"{policy}: the policy has no `classifier` section"])
        semantic = [n for n, vm in pol.virtual_models.items() if isinstance(vm, SemanticModel | RoutedModel)]
        if model is not None and model not in semantic:
            has = ", ".join(semantic) or "none"
            raise PolicyInvalid([f"{policy}: no semantic or routed virtual model '{model}' (has: {has})"])
        with gw:
            gw.route(prompt, model)  # warm-up: the first run pays for ONNX Runtime's allocations
            routing = gw.route(prompt, model)
    except (PolicyInvalid, NotReady) as exc:
        typer.echo(str(exc.message if isinstance(exc, NotReady) else "\n".join(exc.problems)), err=True)
        raise typer.Exit(2) from None
    doc = _doc(routing, top)
    if as_json:
        typer.echo(json.dumps(doc))
        return
    console = Console(highlight=False)
    if "decision" in doc:
        d = doc["decision"]
        rule = d["rule"]
        by = f", rule {rule['index']}: {rule['head']} {rule['label']} ({rule['confidence']:.2f})" if rule else ""
        console.print(
            f"{'route':>14}: {d['virtual_model']} -> [bold]{d['model']}[/bold] ({d['reason']}), "
            f"reasoning {'on' if d['reasoning'] else 'off'}, category {d['category']} "
            f"({d['confidence']:.2f}){by}"
        )
        for c in d.get("candidates", ()):
            mark = "*" if c["chosen"] else " "
            console.print(
                f"{mark:>14} {c['candidate']}: P(right) {c['quality']:.3f}, expected cost {c['expected_cost']:.6g}"
            )
        console.print(f"{'routed in':>14}: {d['route_ms']:.3f} ms, the encoder's pass included")
    for name, head in doc["heads"].items():
        tops = ", ".join(f"{c} {v:.2f}" for c, v in head["top"])
        console.print(f"{name:>14}: [bold]{head['label']}[/bold] ({head['confidence']:.2f})   {tops}")
    fam = doc["familiarity"]
    verdict = "in distribution" if fam["in_distribution"] else "OUT OF DISTRIBUTION"
    console.print(
        f"{'familiarity':>14}: similarity {fam['similarity']:.3f} (at least {fam['threshold']:.3f}), "
        f"foreign pieces {fam['foreign']:.3f} (at most {fam['foreign_threshold']:.3f}), "
        f"language {fam['language']}: {verdict}"
    )
    console.print(
        f"{'latency':>14}: {doc['latency_ms']:.2f} ms for {doc['tokens']} tokens"
        + (" (truncated)" if doc["truncated"] else "")
    )


def _doc(routing: Routing, top: int) -> dict[str, Any]:
    """The routing as ``--json`` prints it: the decision (a routed model's: every candidate's
    predicted P(right) and expected cost), every head's top classes, the guard, the latency."""
    out = routing.reading
    assert out is not None, "checked: the policy has a classifier"
    doc: dict[str, Any] = {
        "heads": {
            name: {
                "label": p.label,
                "confidence": round(p.confidence, 4),
                "top": [[c, round(v, 4)] for c, v in p.top(top)],
            }
            for name, p in out.heads.items()
        },
        "familiarity": {
            "similarity": round(out.familiarity.similarity, 4),
            "threshold": round(out.familiarity.threshold, 4),
            "foreign": round(out.familiarity.foreign, 4),
            "foreign_threshold": round(out.familiarity.foreign_threshold, 4),
            "language": out.familiarity.language,
            "in_distribution": out.familiarity.in_distribution,
        },
        "tokens": out.tokens,
        "truncated": out.truncated,
        "latency_ms": round(out.latency_ms, 3),
    }
    r = routing.route
    if r is None:
        return doc
    decision: dict[str, Any] = {
        "virtual_model": routing.requested,
        **asdict(r),
        "route_ms": round(routing.latency_ms, 3),
    }
    if (q := r.quality) is not None:  # the learned router's choice: every candidate's prediction
        decision["quality"] = round(q.quality, 4)
        decision["candidates"] = [
            {"candidate": label, "quality": round(p, 4), "expected_cost": cost, "chosen": i == q.candidate}
            for i, (label, p, cost) in enumerate(q.predictions)
        ]
    return {"decision": decision, **doc}
