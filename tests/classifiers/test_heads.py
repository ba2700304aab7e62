"""Heads, training and calibration on synthetic embeddings (seeded numpy: the one randomness)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from classifiers.calibration import auroc, ece, fit_temperature
from classifiers.heads import LinearHead
from classifiers.training.fit import fit_head, held_back
from classifiers.training.train_all import fit_oos_threshold
from policies.errors import NotReady


def blobs(n: int, k: int, dim: int = 16, spread: float = 0.6, seed: int = 0) -> tuple[np.ndarray, list[str]]:
    rng = np.random.default_rng(seed)
    centres = rng.normal(size=(k, dim)) * 2
    y = rng.integers(0, k, size=n)
    return (centres[y] + rng.normal(size=(n, dim)) * spread * 2).astype(np.float32), [f"c{i}" for i in y]


def test_fit_save_load_round_trip(tmp_path: Path) -> None:
    x, labels = blobs(600, 3)
    head, report = fit_head("toy", x, labels, [str(i) for i in range(600)])
    assert report.n_calibration + report.n_fit == 600 and report.calibration_accuracy > 0.8
    head.save(tmp_path)
    again = LinearHead.load(tmp_path, "toy")
    assert again.classes == ("c0", "c1", "c2") and again.temperature == pytest.approx(head.temperature)
    np.testing.assert_allclose(again.proba(x[:5]), head.proba(x[:5]), rtol=1e-5)
    assert [p.label for p in again.predict(x[:20])] == [head.classes[i] for i in head.proba(x[:20]).argmax(1)]


def test_binary_heads_get_one_row_per_class() -> None:
    x, labels = blobs(400, 2)
    head, _ = fit_head("bin", x, labels, [str(i) for i in range(400)])
    assert head.weight.shape == (2, 16)
    accuracy = np.mean([p.label == y for p, y in zip(head.predict(x), labels, strict=True)])
    assert accuracy > 0.9


def test_missing_artifact_names_the_command(tmp_path: Path) -> None:
    with pytest.raises(NotReady, match=r"toy.json is missing: build it with `triage train --policy"):
        LinearHead.load(tmp_path, "toy")


def test_temperature_undoes_overconfidence() -> None:
    rng = np.random.default_rng(1)
    y = rng.integers(0, 4, size=4000)
    logits = rng.normal(size=(4000, 4))
    logits[np.arange(4000), y] += 1.0
    t = fit_temperature(logits * 5, y)  # the same model, made 5x overconfident
    assert t == pytest.approx(5.0, rel=0.15)


def test_ece_and_auroc_on_known_cases() -> None:
    assert ece(np.array([0.9] * 10), np.array([1] * 9 + [0])) == pytest.approx(0.0)
    assert ece(np.array([1.0] * 4), np.array([1, 0, 1, 0])) == pytest.approx(0.5)
    assert auroc(np.array([0.1, 0.2, 0.8, 0.9]), np.array([0, 0, 1, 1])) == 1.0
    assert auroc(np.array([0.5, 0.5]), np.array([0, 1])) == 0.5


def test_held_back_rows_are_stable_and_about_the_asked_share() -> None:
    ids = [f"row-{i}" for i in range(5000)]
    mask = held_back(ids, 0.2)
    assert (mask == held_back(ids, 0.2)).all()
    assert 0.18 < mask.mean() < 0.22


def test_out_of_scope_cut_turns_doubtful_answers_into_oos() -> None:
    x, labels = blobs(900, 3, spread=0.3)
    head, _ = fit_head("intents", x, labels, [str(i) for i in range(900)], classes=("c0", "c1", "c2", "oos"))
    far = np.random.default_rng(2).normal(size=(60, 16)).astype(np.float32) * 0.2  # near no centre
    dev_x = np.vstack([x[:300], far])
    dev_y = labels[:300] + ["oos"] * 60
    cut = fit_oos_threshold(head, dev_x, dev_y, "oos")
    assert cut is not None
    head.meta.update(out_of_scope="oos", oos_threshold=cut)
    oos_share = np.mean([p.label == "oos" for p in head.predict(far)])
    in_scope = np.mean([p.label == y for p, y in zip(head.predict(x[300:]), labels[300:], strict=True)])
    assert oos_share > 0.5 and in_scope > 0.9
    # an answer the cut made out of scope is as sure as the top class is doubtful
    made = [p for p in head.predict(far) if p.label == "oos" and max(p.probabilities.values()) > p.probabilities["oos"]]
    assert made and all(p.confidence == pytest.approx(1 - max(p.probabilities.values())) for p in made)


def test_shaped_choice_keeps_the_answer_among_two_to_five_options_the_same_every_run() -> None:
    from classifiers.datasets import shaped_choice

    options = [f"option number {i}" for i in range(10)]
    shapes = set()
    for n in range(40):
        row = {"id": f"row-{n}", "question": "Which one?", "options": options, "answer": options[n % 10]}
        text = shaped_choice(row)
        assert text == shaped_choice(dict(row))
        assert text.startswith("Which one?") and options[n % 10] in text
        shown = [o for o in options if o in text]
        assert 2 <= len(shown) <= 5
        shapes.add((len(shown), "\n" in text.split("\n\n")[1]))
    assert len(shapes) >= 5  # option counts and layouts vary across rows


def test_shaped_rows_are_the_mmlu_pro_rows_the_cap_left_out(shared_data: Path) -> None:
    from classifiers import datasets

    root = shared_data
    plain = datasets.question_type(root, "dev", per_source_cap=50)
    shaped = datasets.question_type(root, "dev", per_source_cap=50, shaped=True)
    extra = [i for i in shaped.ids if i.startswith(datasets.SHAPED)]
    assert [i for i in shaped.ids if i not in extra] == plain.ids and len(extra) > 0
    kept = {i for i in plain.ids if i.startswith("mmlu_pro")}
    assert len(kept) == 50 and not {i.removeprefix(datasets.SHAPED) for i in extra} & kept
    assert all(y == "choice" for i, y in zip(shaped.ids, shaped.labels, strict=True) if i in extra)


def test_measure_by_source_splits_accuracy_and_answers() -> None:
    from classifiers.datasets import source_of
    from classifiers.training.train_all import measure

    x, labels = blobs(400, 3, seed=2)
    head, _ = fit_head("question_type", x, labels, [f"r{i}" for i in range(400)])
    ids = [f"piqa-test-{i}" if i % 2 else f"mt_bench-{i}" for i in range(400)]
    sources = [source_of(i) for i in ids]
    assert set(sources) == {"piqa", "open"} and source_of("shaped-mmlu_pro-dev-3") == "shaped-mmlu_pro"
    wrong = [labels[i] if i % 2 else "c0" for i in range(400)]  # the open half labeled c0 whatever it is
    result = measure(head, x, wrong, None, sources)
    piqa, open_ = result.by_source["piqa"], result.by_source["open"]
    assert (piqa.n, open_.n) == (200, 200) and piqa.accuracy > 0.9 > open_.accuracy
    assert sum(piqa.predicted.values()) == 200
    assert result.accuracy == pytest.approx((piqa.accuracy + open_.accuracy) / 2)


def test_synthetic_rows_are_fitted_on_never_calibrated_on() -> None:
    x, labels = blobs(400, 3, seed=3)
    ids = [f"r{i}" for i in range(400)]
    synthetic = [i < 200 for i in range(400)]
    _, plain = fit_head("h", x, labels, ids)
    _, report = fit_head("h", x, labels, ids, synthetic=synthetic)
    held = held_back(ids, 0.2)
    assert plain.n_calibration == int(held.sum())
    assert report.n_calibration == int(held[200:].sum()) and report.n_fit == 400 - report.n_calibration


@pytest.mark.parametrize(
    ("text", "run"),
    [
        ("Which is prime?\n\nA. 4\nB. 6\nC. 7\nD. 9", 4),
        ("Pick one: A) red B) green", 2),  # inline
        ("(a) x (b) y (c) z: which holds?", 3),
        ("A: yes\nB: no\nC: maybe", 3),
        ("Choose (A) x or (B) y", 2),
        ("A. x\nC. y", 1),  # letters out of order count only as far as they run
        ("a) Company X posted $3bn\nb) Company Y posted $6bn", 0),  # sub-items of an open request
        ("1. one\n2. two", 0),  # numbers: left to the embedding
        ("Q: what is this? A: a test", 1),
        ("I have a cat. A dog too.", 0),
        ("", 0),
        (" ".join(f"{chr(65 + i)}) o{i}" for i in range(14)), 10),  # capped at ten
        (b"A. x\nB. \xff", 2),
        ("A) x B) y " + "filler " * 5000 + "C) z", 3),  # head and tail of a long prompt
        ("A) x " + "filler " * 5000 + " B) y " + "filler " * 5000 + "C) z", 1),  # the middle is not read
    ],
)
def test_option_run_counts_lettered_options_in_order(text: str | bytes, run: int) -> None:
    from classifiers import layout

    assert layout.option_run(text) == run
    np.testing.assert_allclose(layout.features([text]), [[run / 10, float(run >= 2)]], rtol=1e-6)


def test_layout_fit_rows_repeat_the_shaped_rows_without_their_layout() -> None:
    from classifiers import layout

    x = np.eye(3, 4, dtype=np.float32)
    texts, labels = ["A. x\nB. y", "tell me a story", "A) p B) q C) r"], ["choice", "open", "choice"]
    fit_x, fit_labels, fit_ids, synthetic = layout.fit_rows(x, texts, labels, ["a", "b", "c"], [False, False, True])
    assert fit_x.shape == (4, 4 + layout.WIDTH)
    np.testing.assert_allclose(fit_x[:, 4:], [[0.2, 1.0], [0.0, 0.0], [0.3, 1.0], [0.0, 0.0]], rtol=1e-6)
    assert (fit_x[3, :4] == x[2]).all() and fit_labels[3] == "choice"
    assert fit_ids == ["a", "b", "c", "c#no-layout"] and synthetic == [False, False, True, True]
