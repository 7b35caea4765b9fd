"""``hf://ORG/NAME[@REVISION]`` model references: parsing, and a malformed one is a spec error
(issue #30). Pure: no hub, no cluster."""

from __future__ import annotations

import doctest

import pytest
from pydantic import ValidationError

from posttrain.api import RolloutPoolSpec, TrainingRunSpec, modelref
from posttrain.api.modelref import HF_FORM, HfModelRef, parse_hf_ref

DOMAINS = [{"name": "a", "dataset": "builtin:arithmetic", "verifier": {"kind": "numeric"}}]


@pytest.mark.parametrize(
    ("ref", "repo_id", "revision"),
    [
        ("hf://HuggingFaceTB/SmolLM2-135M-Instruct", "HuggingFaceTB/SmolLM2-135M-Instruct", None),
        ("hf://Qwen/Qwen3-0.6B@main", "Qwen/Qwen3-0.6B", "main"),
        ("hf://org/model_v1.5@v1.0", "org/model_v1.5", "v1.0"),
        ("hf://org/m@refs/pr/12", "org/m", "refs/pr/12"),
        ("hf://org/m@" + "a" * 40, "org/m", "a" * 40),
    ],
)
def test_a_well_formed_reference_names_the_repository_and_revision(
    ref: str, repo_id: str, revision: str | None
) -> None:
    assert parse_hf_ref(ref) == HfModelRef(repo_id, revision)
    assert RolloutPoolSpec.model_validate({"model": ref}).model == ref
    assert TrainingRunSpec.model_validate({"model": ref, "domains": DOMAINS}).model == ref


@pytest.mark.parametrize(
    ("ref", "fault"),
    [
        ("hf://", "is not ORG/NAME"),
        ("hf://gpt2", "is not ORG/NAME"),  # no organisation: name it as the Hub does now
        ("hf://org/", "is not ORG/NAME"),  # missing name
        ("hf:///name", "is not ORG/NAME"),
        ("hf://org/a/b", "is not ORG/NAME"),
        ("hf://org/../etc", "is not ORG/NAME"),
        ("hf://org/a..b", "no '--' or '..'"),
        ("hf://org/a--b", "no '--' or '..'"),
        ("hf://org/my model", "is not a Hub repository name"),
        ("hf://org/-m", "is not a Hub repository name"),
        ("hf://org/m.", "is not a Hub repository name"),
        ("hf://Org$/m", "is not a Hub organisation"),
        ("hf://org/" + "m" * 97, "is not a Hub repository name"),
        ("hf://org/m.git", "ends in '.git'"),
        ("hf://org/m@", "the revision after '@' is empty"),
        ("hf://org/m@../main", "is not a revision"),
        ("hf://org/m@v1..2", "is not a revision"),
        ("hf://org/m@a@b", "is not a revision"),
        ("hf://org/m@my branch", "is not a revision"),
        ("hf://org/m@refs/pr/", "is not a revision"),
    ],
)
def test_a_malformed_reference_is_a_spec_error_naming_it_and_the_accepted_form(
    ref: str, fault: str
) -> None:
    with pytest.raises(ValueError, match=fault) as caught:
        parse_hf_ref(ref)
    assert str(caught.value).startswith(f"model {ref!r}: ")
    assert str(caught.value).endswith(f"; use {HF_FORM}")
    for build in (
        lambda: TrainingRunSpec.model_validate({"model": ref, "domains": DOMAINS}),
        lambda: RolloutPoolSpec.model_validate({"model": ref}),
    ):
        with pytest.raises(ValidationError) as invalid:
            build()
        assert repr(ref) in str(invalid.value) and HF_FORM in str(invalid.value)


def test_other_references_are_not_hub_references() -> None:
    for ref in ("smollm2-135m-instruct", "Qwen/Qwen3-0.6B", "s3://b/m", "pvc://c/m", "/m"):
        assert parse_hf_ref(ref) is None


def test_a_token_secret_goes_with_an_hf_model_only() -> None:
    secret = {"name": "hf-token"}
    pool = RolloutPoolSpec.model_validate({"model": "hf://org/private", "hfTokenSecret": secret})
    assert pool.hf_token_secret is not None
    assert (pool.hf_token_secret.name, pool.hf_token_secret.key) == ("hf-token", "HF_TOKEN")
    run = TrainingRunSpec.model_validate(
        {
            "model": "hf://org/private@v2",
            "domains": DOMAINS,
            "hfTokenSecret": {"name": "tokens", "key": "hub"},
        }
    )
    assert run.hf_token_secret is not None and run.hf_token_secret.key == "hub"
    assert run.to_wire()["hfTokenSecret"] == {"name": "tokens", "key": "hub"}
    with pytest.raises(ValidationError, match="hfTokenSecret is only read for an hf://"):
        RolloutPoolSpec.model_validate({"model": "s3://b/m", "hfTokenSecret": secret})
    with pytest.raises(ValidationError, match="hfTokenSecret is only read for an hf://"):
        TrainingRunSpec.model_validate(
            {"model": "smollm2-135m-instruct", "domains": DOMAINS, "hfTokenSecret": secret}
        )
    with pytest.raises(ValidationError, match="name"):
        RolloutPoolSpec.model_validate({"model": "hf://o/m", "hfTokenSecret": {"name": "Bad_N"}})


def test_docstring_examples_hold() -> None:
    result = doctest.testmod(modelref)
    assert result.attempted > 0 and result.failed == 0
