"""The judge's reply parsing (evals/judge.py extract_json): the first JSON object, whatever prose,
fences or braces inside its strings surround it."""

import pytest
from evals.judge import extract_json


@pytest.mark.parametrize("reply, expected", [
    ('{"winner": "A"}', {"winner": "A"}),
    ('Sure! ```json\n{"winner": "B", "rationale": "ok"}\n```', {"winner": "B", "rationale": "ok"}),
    # a brace inside a string is text, not structure
    ('{"winner": "A", "rationale": "B writes f\'{x}\' where } closes nothing"}',
     {"winner": "A", "rationale": "B writes f'{x}' where } closes nothing"}),
    ('The set {1, 2} is not JSON; the verdict: {"score": 4}', {"score": 4}),
    ('[{"score": 2}] then {"score": 5}', {"score": 2}),  # the first object, even inside a list
])
def test_the_first_json_object_is_read(reply, expected):
    assert extract_json(reply) == expected


def test_no_object_is_a_value_error_quoting_the_reply():
    with pytest.raises(ValueError, match=r"no JSON object in judge reply: 'I cannot judge {this'"):
        extract_json("I cannot judge {this")
