"""The probe protocol's contract: every method optional, one list of describe() fields, the docs in step."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from sleuth.probes.experiments import EXPERIMENTS
from sleuth.probes.protocol import (
    DESCRIBE_FIELDS,
    PROBE_NEEDS,
    PROTOCOL_METHODS,
    NotProvided,
    PartialSubject,
    ProbeSubject,
    check_description,
)

# The protocol is documented in the site's guide (it was the README before the docs moved there).
PROTOCOL_DOC = Path(__file__).resolve().parents[2] / "docs" / "guides" / "your-trainer.md"


def test_every_experiment_says_which_methods_it_needs():
    assert set(PROBE_NEEDS) == set(EXPERIMENTS)
    assert {m for needs in PROBE_NEEDS.values() for m in needs} <= set(PROTOCOL_METHODS)
    assert all(hasattr(ProbeSubject, m) for m in PROTOCOL_METHODS)


def test_the_docs_list_exactly_the_describe_fields():
    text = PROTOCOL_DOC.read_text()
    section = text[text.index("**`describe()` fields**"):]
    section = section[section.index("| field |"):]
    section = section[: section.index("\n\n")]
    listed = re.findall(r"^\| `([a-z_]+)` \|", section, re.M)
    assert listed == list(DESCRIBE_FIELDS)
    required = {name for name, (req, _doc) in DESCRIBE_FIELDS.items() if req}
    assert {name for name in listed if re.search(rf"^\| `{name}` \| yes", section, re.M)} == required


class _Half:
    def describe(self):
        return {"block_size": 4, "num_target_layers": 8}

    def loss(self, batch, hooks):
        raise NotImplementedError("TODO(sleuth): the loss is inline in main() (train.py:88)")


def test_a_partial_subject_raises_not_provided_for_what_it_lacks():
    subject = PartialSubject(_Half())
    assert subject.describe()["block_size"] == 4
    assert "draft_logits" in subject.missing() and "describe" not in subject.missing()
    with pytest.raises(NotProvided) as missing:
        subject.draft_logits(None, None)
    assert missing.value.reason == "not provided by the entry: draft_logits()"
    with pytest.raises(NotProvided) as todo:  # a scaffold's TODO is "not provided" too, with its message
        subject.loss(None, None)
    assert todo.value.reason == "not provided by the entry: loss() (TODO(sleuth): the loss is inline in main() (train.py:88))"


@pytest.mark.parametrize(("info", "message"), [
    ([], "describe() returned a list, not a dict"),
    ({"block_size": 4}, "describe() lacks num_target_layers"),
    ({"block_size": 0, "num_target_layers": 8}, "describe()['block_size'] must be a positive int, got 0"),
    ({"block_size": 4, "num_target_layers": 8, "layer_id_convention": "hf"},
     "describe()['layer_id_convention'] must be one of zlab, vllm, external, got 'hf'"),
])
def test_describe_answers_are_checked(info, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        check_description(info)
