"""The guardrails' pure parts: who gets which guardrails, verdicts to a refusal, reversible
masking (whole and streamed), the PII finder on values each library checks, and the policy
section's validation with places."""

from __future__ import annotations

from pathlib import Path

import pytest

from classifiers.pii import PiiFinder
from policies import loader
from policies.errors import PolicyInvalid
from policies.guardrails import Span, StreamRestorer, Vault, Verdict, applicable, mask, refusal, restore
from policies.schema_guardrails import GuardrailsSpec

SPEC = GuardrailsSpec.model_validate(
    {
        "checks": {"pii": {"type": "pii"}, "jb": {"type": "jailbreak"}, "hook": {"type": "hook", "url": "http://h"}},
        "default": ["pii", "jb"],
        "keys": {"trusted": []},
        "teams": {"red": ["hook"]},
    }
)


def test_a_keys_entry_wins_over_its_teams_and_the_default() -> None:
    assert applicable(SPEC, "trusted", "red") == ()
    assert applicable(SPEC, "other", "red") == ("hook",)
    assert applicable(SPEC, None, None) == ("pii", "jb")
    everything = SPEC.model_copy(update={"default": None})
    assert applicable(everything, None, None) == ("pii", "jb", "hook")


def test_a_refusal_names_its_guardrail_and_on_error_decides_a_failed_check() -> None:
    hit = Verdict("jb", "jailbreak", "refuse", "allow", hit=True, reason="P(attack) 0.97")
    logged = Verdict("pii", "pii", "log", "refuse", hit=True)
    failed_open = Verdict("hook", "hook", "refuse", "allow", error="deadline passed")
    failed_shut = Verdict("hook", "hook", "refuse", "refuse", error="deadline passed")
    assert refusal([logged, failed_open], "request") is None
    err = refusal([logged, hit], "request")
    assert err is not None and err.guardrail == "jb" and err.status == 400
    assert err.body()["error"]["guardrail"] == "jb" and err.body()["error"]["code"] == "guardrail_refused"
    shut = refusal([failed_shut], "request")
    assert shut is not None and shut.guardrail == "hook" and "could not check" in shut.message
    assert [v.outcome for v in (hit, logged, failed_open, failed_shut)] == [
        "refuse",
        "log",
        "error_allow",
        "error_refuse",
    ]


def test_masking_is_reversible_and_the_same_value_gets_the_same_placeholder() -> None:
    vault = Vault()
    text = "mail a@b.io and a@b.io, call 555"
    spans = [Span(5, 11, "email"), Span(16, 22, "email"), Span(29, 32, "phone"), Span(29, 31, "phone")]
    masked = mask(text, spans, vault)
    assert masked == "mail [EMAIL_1] and [EMAIL_1], call [PHONE_1]"
    assert restore("Sure: [EMAIL_1] / [PHONE_1] / [EMAIL_9]", vault) == "Sure: a@b.io / 555 / [EMAIL_9]"


@pytest.mark.parametrize("cuts", [[1], [3, 9], [6, 7, 8], list(range(1, 30))])
def test_a_placeholder_cut_between_chunks_is_restored_whole(cuts: list[int]) -> None:
    vault = Vault()
    mask("x a@b.io", [Span(2, 8, "email")], vault)
    answer = "Write to [EMAIL_1] [today]."
    pieces = [answer[a:b] for a, b in zip([0, *cuts], [*cuts, len(answer)], strict=True)]
    r = StreamRestorer(vault)
    assert "".join(r.feed(p) for p in pieces) + r.flush() == "Write to a@b.io [today]."


def test_the_pii_finder_keeps_only_values_their_libraries_accept() -> None:
    finder = PiiFinder(regions=["US", "GB", "FR"])
    text = (
        "Mail jane.doe@example.com or +1 415-555-2671 or 020 7946 0958. Card 4111 1111 1111 1111 "
        "(not 4111 1111 1111 1112), IBAN DE89 3704 0044 0532 0130 00 (not DE89 3704 0044 0532 0130 01), "
        "SSN 123-45-6789, host 10.0.0.12, in 2024 order 1234567."
    )
    found = {(text[s.start : s.end], s.entity) for s in finder.find(text)}
    assert found == {
        ("jane.doe@example.com", "email"),
        ("+1 415-555-2671", "phone"),
        ("020 7946 0958", "phone"),
        ("4111 1111 1111 1111", "credit_card"),
        ("DE89 3704 0044 0532 0130 00", "iban"),
        ("123-45-6789", "national_id"),
        ("10.0.0.12", "ip_address"),
    }
    assert PiiFinder(["email"]).find("call +1 415-555-2671") == []
    assert finder.find("What is the capital of France?") == []


BASE = """version: 1
backends:
  s: {type: scripted}
models:
  m: {backend: s}
"""


def test_the_section_is_validated_with_places(tmp_path: Path) -> None:
    path = tmp_path / "p.yaml"
    path.write_text(
        BASE
        + """guardrails:
  checks:
    jb: {type: jailbreak, action: mask}
    pii: {type: pii, action: refuse, restore: true}
    hook: {type: hook}
    fine: {type: pii}
  default: [fine, nope]
  teams: {red: [fine, fine]}
"""
    )
    with pytest.raises(PolicyInvalid) as err:
        loader.load(path)
    text = "\n".join(err.value.problems)
    assert "guardrails.checks.jb" in text and "nothing to mask" in text
    assert "restore is for action: mask" in text and "exactly one of url and entry_point" in text
    assert ":11:" in text or ":10:" in text  # file:line:col of the places


def test_cross_references_are_checked_with_places(tmp_path: Path) -> None:
    path = tmp_path / "p.yaml"
    path.write_text(
        BASE
        + """guardrails:
  checks:
    jb: {type: jailbreak}
    fine: {type: pii}
  default: [fine, nope]
  teams: {red: [fine, fine]}
"""
    )
    with pytest.raises(PolicyInvalid) as err:
        loader.load(path)
    text = "\n".join(err.value.problems)
    assert "guardrails.default[1]" in text and "'nope' is not defined" in text
    assert "guardrails.teams.red" in text and "named twice" in text
    assert "guardrails.checks.jb" in text and "needs `classifier`" in text
    assert f"{path}:10:" in text  # default's second item: its line
