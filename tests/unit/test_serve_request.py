"""The demo Serve ingress's request check, without Serve running: bounded prompts, token
ids that fit int32 (and the model's vocabulary), clear errors naming what was wrong."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("ray.serve")

from raykv.demo.serve_app import (  # noqa: E402
    MAX_NEW_TOKENS_LIMIT,
    MAX_PROMPT_TOKENS,
    _check_request,
)
from raykv.errors import InvalidInputError  # noqa: E402


def test_a_good_request_passes_unchanged() -> None:
    tokens = [0, 5, 2**31 - 1]
    assert _check_request(tokens, 4) == (tokens, 4)
    assert _check_request([1] * MAX_PROMPT_TOKENS, 1)[0] == [1] * MAX_PROMPT_TOKENS


def test_a_prompt_longer_than_the_limit_is_refused_naming_its_length() -> None:
    with pytest.raises(InvalidInputError, match=rf"{MAX_PROMPT_TOKENS + 1} tokens; at most"):
        _check_request([1] * (MAX_PROMPT_TOKENS + 1), 4)


@pytest.mark.parametrize(
    ("tokens", "match"),
    [
        ([1, 2**31], r'"tokens"\[1\] is 2147483648'),
        ([2**63], r'"tokens"\[0\] is 9223372036854775808'),
        ([3, -1], r'"tokens"\[1\] is -1'),
        ([1, "x"], r"\"tokens\"\[1\] is 'x'"),
        ([1, 2.0], r'"tokens"\[1\] is 2.0'),
        ([True], r'"tokens"\[0\] is True'),
        ([1, None], r'"tokens"\[1\] is None'),
    ],
)
def test_token_ids_must_be_ints_that_fit_int32(tokens: list[Any], match: str) -> None:
    with pytest.raises(InvalidInputError, match=match) as err:
        _check_request(tokens, 4)
    assert "[0, 2**31=2147483648)" in str(err.value)


def test_token_ids_must_be_below_the_models_vocab_size_when_known() -> None:
    assert _check_request([1023], 4, vocab_size=1024) == ([1023], 4)
    with pytest.raises(InvalidInputError, match=r'"tokens"\[1\] is 1024.*vocab_size=1024'):
        _check_request([0, 1024], 4, vocab_size=1024)


def test_prompt_plus_new_tokens_must_fit_the_models_context() -> None:
    assert _check_request([1] * 12, 4, context=16) == ([1] * 12, 4)
    with pytest.raises(InvalidInputError, match="13 prompt tokens \\+ 4 new tokens exceed.* 16"):
        _check_request([1] * 13, 4, context=16)


@pytest.mark.parametrize("tokens", [[], None, "abc", {"a": 1}, (1, 2)])
def test_tokens_must_be_a_non_empty_list(tokens: Any) -> None:
    with pytest.raises(InvalidInputError, match="non-empty list"):
        _check_request(tokens, 4)


@pytest.mark.parametrize("n", [0, -1, MAX_NEW_TOKENS_LIMIT + 1, 2.0, True, None, "4"])
def test_max_new_tokens_must_be_an_int_in_range(n: Any) -> None:
    with pytest.raises(InvalidInputError, match="max_new_tokens"):
        _check_request([1, 2], n)
