"""The jailbreak and prompt-injection head at run time: P(attack) of a prompt from the encoder's
reading of it, the reading the router takes for the same text (no second model on the path).

The head is a calibrated logistic regression (:class:`~classifiers.heads.LinearHead`, classes
``benign`` and ``attack``) fitted by ``python -m classifiers.training.jailbreak_training`` on
public labeled sets (their dev rows; docs/guardrails.md names each and its licence). Its
``meta.threshold`` is the cut fitted to a stated false-positive rate on benign prompts
(``meta.target_fpr``). It ships with the embedded
default's heads (``policies/examples/heads/jailbreak.*``); a policy's own classifier artifacts
may hold another of the same name, which is then read first.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

import policies
from classifiers.heads import LinearHead
from policies.errors import NotReady

if TYPE_CHECKING:
    from classifiers.encoder import Reading

JAILBREAK = "jailbreak"
ATTACK, BENIGN = "attack", "benign"
SHIPPED_HEADS = Path(policies.__file__).resolve().parent / "examples" / "heads"
TRAIN_COMMAND = "python -m classifiers.training.jailbreak_training --sets SETS --out DIR"


def features(reading: Reading) -> np.ndarray:
    """What the head reads: the prompt's embedding (the router's) beside the guard layer's pooled
    states of the whole prompt (the same forward's earlier layer)."""
    shallow = reading.shallow if reading.shallow is not None else reading.vector
    return np.concatenate([reading.vector, shallow]).astype(np.float32)


def jailbreak_probability(head: LinearHead, reading: Reading) -> float:
    return float(head.proba(features(reading)[None, :])[0, head.classes.index(ATTACK)])


def load_head(roots: Sequence[Path], name: str = JAILBREAK) -> LinearHead:
    """The head ``name`` from the first of ``roots`` that holds it (NotReady naming the command)."""
    for root in roots:
        if (root / f"{name}.json").is_file():
            head = LinearHead.load(root, name, TRAIN_COMMAND)
            if ATTACK not in head.classes or "threshold" not in head.meta:
                raise NotReady(f"head {name} in {root} is not a jailbreak head: rebuild it with `{TRAIN_COMMAND}`")
            return head
    raise NotReady(f"no jailbreak head '{name}' in {', '.join(map(str, roots))}: build it with `{TRAIN_COMMAND}`")
