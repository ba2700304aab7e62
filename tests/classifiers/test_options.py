"""The generic option scorer (tier 0 for typed questions without a task head): features, artifacts,
probabilities on synthetic vectors (seeded numpy), and a real fit on a small seeded sample of the
shared dev data with the real encoder, measured on held-out test rows."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from classifiers.artifacts import locate
from classifiers.encoder import Encoder, EncoderSettings
from classifiers.options import DEFAULT_FEATURES, OPTIONS, OptionHead, feature_width, pair_features, question_text
from classifiers.service import Classifier
from classifiers.training.embedding_cache import EmbeddingCache
from classifiers.training.export import ensure_exported
from classifiers.training.options_training import MEASURE_SETS, C, embed_items, fit_type, load_items, measure_set
from classifiers.training.train_all import TrainReport, train
from policies import loader
from policies.errors import NotReady
from policies.paths import cache_dir
from tests import lanes
from tests.conftest import SHARED_DATA

DATA = SHARED_DATA
DIM = 384


def unit(rng: np.random.Generator, *shape: int) -> np.ndarray:
    x = rng.normal(size=(*shape, DIM)).astype(np.float32)
    return x / np.linalg.norm(x, axis=-1, keepdims=True)


def toy_head(seed: int = 0) -> OptionHead:
    rng = np.random.default_rng(seed)
    width = feature_width(DEFAULT_FEATURES, DIM)
    weights = {t: rng.normal(size=width).astype(np.float32) * 0.3 for t in ("choice", "yes_no")}
    return OptionHead(weights, {"choice": 1.7, "yes_no": 0.8}, DEFAULT_FEATURES, DIM, {"note": "toy"})


def test_question_text_puts_the_question_after_its_context() -> None:
    assert question_text(" Is it? ", None) == "Is it?"
    assert question_text("Is it?", "  ") == "Is it?"
    assert question_text("is the sky blue", "The sky is blue.") == "The sky is blue.\n\nis the sky blue"


def test_features_have_one_row_per_option_and_the_declared_width() -> None:
    rng = np.random.default_rng(0)
    q, o = unit(rng), unit(rng, 5)
    assert pair_features(q, o).shape == (5, feature_width(DEFAULT_FEATURES, DIM))
    every = ("prod", "absdiff", "option", "dot", "dot_z", "typicality")
    x = pair_features(q, o, every)
    assert x.shape == (5, feature_width(every, DIM)) == (5, 3 * DIM + 3)
    assert x.dtype == np.float32
    np.testing.assert_allclose(x[:, :DIM], o * q, rtol=1e-6)
    np.testing.assert_allclose(x[:, DIM : 2 * DIM], np.abs(q - o), rtol=1e-6)
    np.testing.assert_allclose(x[:, 2 * DIM : 3 * DIM], o, rtol=1e-6)
    np.testing.assert_allclose(x[:, 3 * DIM], o @ q, rtol=1e-5)
    assert x[:, 3 * DIM + 1].mean() == pytest.approx(0.0, abs=1e-5)  # similarity standardised per question
    lone = pair_features(q, o[:1], every)  # one option: the per-question blocks are defined (zero), not NaN
    assert lone.shape == (1, 3 * DIM + 3) and np.isfinite(lone).all()
    with pytest.raises(ValueError, match="384-d but options are 10-d"):
        pair_features(q, o[:, :10])


def test_save_load_round_trip_gives_identical_probabilities(tmp_path: Path) -> None:
    head = toy_head()
    head.save(tmp_path)
    assert {p.name for p in tmp_path.iterdir()} == {f"{OPTIONS}.npz", f"{OPTIONS}.json"}
    again = OptionHead.load(tmp_path, "triage train --policy p.yaml")
    assert again.types == ("choice", "yes_no") and again.features == DEFAULT_FEATURES and again.meta == head.meta
    rng = np.random.default_rng(1)
    for qtype, n in (("choice", 7), ("yes_no", 2)):
        q, o = unit(rng), unit(rng, n)
        assert again.temperature(qtype) == head.temperature(qtype)
        np.testing.assert_array_equal(again.proba(qtype, q, o), head.proba(qtype, q, o))


def test_an_unknown_question_type_raises_key_error() -> None:
    rng = np.random.default_rng(2)
    head = toy_head()
    with pytest.raises(KeyError, match="no weights for question type 'score'"):
        head.logits("score", unit(rng), unit(rng, 3))
    with pytest.raises(KeyError):
        head.temperature("open")


def test_a_missing_artifact_names_the_file_and_the_command(tmp_path: Path) -> None:
    with pytest.raises(NotReady, match=r"options.json is missing: build it with `triage train --policy p.yaml`"):
        OptionHead.load(tmp_path, "triage train --policy p.yaml")
    toy_head().save(tmp_path)
    (tmp_path / f"{OPTIONS}.npz").unlink()
    with pytest.raises(NotReady, match=r"options.npz is missing: build it with `triage train --policy p.yaml`"):
        OptionHead.load(tmp_path, "triage train --policy p.yaml")


def test_temperature_changes_confidence_but_not_the_answer() -> None:
    rng = np.random.default_rng(3)
    head = toy_head()
    for _ in range(20):
        q, o = unit(rng), unit(rng, int(rng.integers(2, 11)))
        p = head.proba("choice", q, o)
        assert p.shape == (len(o),) and p.sum() == pytest.approx(1.0) and (p > 0).all()
        raw = head.logits("choice", q, o)
        np.testing.assert_allclose(p, np.exp(raw / 1.7) / np.exp(raw / 1.7).sum(), rtol=1e-5)
        sharp, flat = head.proba("choice", q, o, temperature=0.5), head.proba("choice", q, o, temperature=5.0)
        assert sharp.argmax() == p.argmax() == flat.argmax()
        assert sharp.max() > p.max() > flat.max()


# --- real encoder, real data -------------------------------------------------------------------------------------

POLICY = """version: 1
classifier:
  data_dir: {data}
  artifacts: {artifacts}
  heads: {heads}
backends:
  echo: {{type: scripted, echo: true}}
models:
  plain: {{backend: echo}}
"""


@pytest.fixture(scope="module")
@lanes.model
def cache() -> Iterator[EmbeddingCache]:
    """The int8 encoder (the policy default) and the on-disk embedding cache ``triage train`` uses
    for the option head, so that a re-run embeds nothing (a first run embeds ~12k short texts)."""
    ensure_exported()
    art = locate()
    encoder = Encoder.load(EncoderSettings(intra_op_threads=2), artifacts=art)
    emb = EmbeddingCache(encoder, cache_dir() / "embeddings" / f"{art.key}-int8-256-options.npz")
    yield emb
    emb.save()


def test_a_head_fitted_on_a_small_dev_sample_beats_chance_on_held_out_test_rows(cache: EmbeddingCache) -> None:
    dev = embed_items(cache, load_items(DATA, "mmlu_pro", "dev", 700))
    weights, fit, held = fit_type("choice", dev, c=C["choice"])
    assert fit.n_fit + fit.n_calibration == 700 and held.sum() == fit.n_calibration
    head = OptionHead({"choice": weights}, {"choice": fit.temperature}, DEFAULT_FEATURES, DIM)
    test = embed_items(cache, load_items(DATA, "mmlu_pro", "test", 400))
    assert not {it.id for it in test.items} & {it.id for it in dev.items}
    result = measure_set(head, "mmlu_pro", test)
    assert result is not None and result.n == 400 and result.chance == pytest.approx(0.113, abs=0.005)
    # measured: 0.165 against chance 0.113 (the whole dev set: 0.196 on 1,000 test rows)
    assert result.accuracy >= result.chance + 0.025
    assert result.ece < 0.1


@pytest.fixture(scope="module")
@lanes.model
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, TrainReport]:
    ensure_exported()
    out = tmp_path_factory.mktemp("options")
    pol = loader.parse(POLICY.format(data=DATA, artifacts=out, heads="[options]"))
    assert pol.classifier is not None
    report = train(pol.classifier, out, threads=2, say=lambda _: None, limit=40)
    return out, report


def test_triage_train_fits_saves_and_measures_the_option_head(trained: tuple[Path, TrainReport]) -> None:
    out, report = trained
    assert (out / f"{OPTIONS}.npz").is_file() and (out / f"{OPTIONS}.json").is_file()
    rows = {h.name: h for h in report.heads}
    assert set(rows) == {f"options/{name}" for name in MEASURE_SETS}
    for name, row in rows.items():
        assert row.test_rows == 40 and 0.0 <= row.accuracy <= 1.0 and 0.0 < row.extra["chance"] <= 0.5
        assert ("majority" in row.extra) == (name in ("options/boolq", "options/strategyqa"))
    assert rows["options/piqa"].extra["chance"] == 0.5 and rows["options/mmlu_pro"].fit_rows == 32


def test_the_classifier_loads_the_option_head_apart_from_the_linear_heads(
    trained: tuple[Path, TrainReport], tmp_path: Path
) -> None:
    out, _ = trained
    pol = loader.parse(POLICY.format(data=DATA, artifacts=out, heads="[options]"))
    assert pol.classifier is not None
    clf = Classifier.load(pol.classifier, out, "p.yaml")
    assert clf.heads == {} and clf.options is not None and clf.options.types == ("choice", "yes_no")
    q = clf.encoder.embed([question_text("Which gas do plants absorb from the air?", None)])[0]
    o = clf.encoder.embed(["oxygen", "carbon dioxide", "helium", "neon"])
    p = clf.options.proba("choice", q, o)
    assert p.shape == (4,) and p.sum() == pytest.approx(1.0)
    yes_no = clf.options.proba("yes_no", clf.encoder.embed(["is water wet"])[0], clf.encoder.embed(["yes", "no"]))
    assert yes_no.shape == (2,) and yes_no.sum() == pytest.approx(1.0)
    for name in ("reference.json", "reference.npz"):  # everything but the option head
        shutil.copy(out / name, tmp_path / name)
    pol = loader.parse(POLICY.format(data=DATA, artifacts=tmp_path, heads="[options]"))
    assert pol.classifier is not None
    with pytest.raises(NotReady, match=r"options.json is missing: build it with `triage train --policy p.yaml`"):
        Classifier.load(pol.classifier, tmp_path, "p.yaml")
