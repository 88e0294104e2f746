import pytest

from specdec.sampling import SamplingParams


def test_defaults_match_public_api():
    sp = SamplingParams()
    assert (sp.max_tokens, sp.temperature, sp.top_p, sp.top_k, sp.seed, sp.stop_token_ids, sp.ignore_eos) == (
        16, 0.0, 1.0, 0, None, None, False)
    assert sp.greedy and not SamplingParams(temperature=0.5).greedy


def test_stop_token_ids_become_a_tuple():
    assert SamplingParams(stop_token_ids=[3, 4]).stop_token_ids == (3, 4)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": 2.0}, "max_tokens"),
        ({"max_tokens": True}, "max_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"temperature": "1"}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -1}, "top_k"),
        ({"top_k": 1.5}, "top_k"),
        ({"seed": 1.0}, "seed"),
        ({"seed": 2**64}, "seed"),
        ({"stop_token_ids": "12"}, "stop_token_ids"),
        ({"stop_token_ids": [1, -2]}, "stop_token_ids"),
        ({"ignore_eos": 1}, "ignore_eos"),
    ],
)
def test_bad_values_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)
