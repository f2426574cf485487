"""The request_args patch, against Request shapes of releases and nightlies."""

from __future__ import annotations

import pytest

from specshim._base import SpecShimError
from specshim._types import NotNeeded
from specshim.patches.main import request_args

from ._main_patch_helpers import _applied, _vllm_config


class RequestNightly:
    """The 0.16 nightly shape: no eos_token_id."""

    def __init__(
        self,
        request_id,
        prompt_token_ids,
        sampling_params,
        pooling_params,
        arrival_time=None,
        block_hasher=None,
    ):
        self.__dict__.update(locals())


class Request016:
    def __init__(
        self,
        request_id,
        prompt_token_ids,
        sampling_params,
        pooling_params,
        eos_token_id,
        arrival_time=None,
        block_hasher=None,
    ):
        self.__dict__.update(locals())


class Request011:
    def __init__(
        self,
        request_id,
        prompt_token_ids,
        sampling_params,
        pooling_params,
        eos_token_id,
        arrival_time=None,
    ):
        pass


SPECULATORS_REQUEST_KWARGS = dict(
    request_id="req_0_0",
    prompt_token_ids=[1],
    sampling_params=None,
    pooling_params=None,
    eos_token_id=2,
    arrival_time=0.0,
)


def test_request_without_eos_token_id_nightly():
    make = _applied(request_args, RequestNightly)
    req = make(**SPECULATORS_REQUEST_KWARGS)
    assert req.block_hasher is None and not hasattr(req, "eos_token_id")


def test_request_release_keeps_eos_and_gets_hasher_when_caching_is_on():
    make = _applied(request_args, Request016)
    assert make(**SPECULATORS_REQUEST_KWARGS).eos_token_id == 2
    hasher = object()
    request_args.set_block_hasher(hasher)
    try:
        assert make(**SPECULATORS_REQUEST_KWARGS).block_hasher is hasher
    finally:
        request_args.set_block_hasher(None)
    assert request_args.block_hasher_for(_vllm_config(caching=False)) is None


def test_request_not_needed_on_011():
    with pytest.raises(NotNeeded):
        request_args.PATCH.probe(Request011)


class RequestSalted:
    """A release shape with cache_salt (vLLM 0.16 and later)."""

    def __init__(
        self,
        request_id,
        prompt_token_ids,
        sampling_params,
        pooling_params,
        eos_token_id,
        arrival_time=None,
        block_hasher=None,
        cache_salt=None,
    ):
        self.__dict__.update(locals())


def test_salted_positions_get_a_salt_of_their_own_and_only_with_caching_on():
    make = _applied(request_args, RequestSalted)
    kwargs = dict(SPECULATORS_REQUEST_KWARGS)
    request_args.set_salted({1})
    try:
        assert make(**kwargs).cache_salt is None  # caching off: no hasher, no salt
        request_args.set_block_hasher(object())
        salts = [
            make(**(kwargs | {"request_id": f"req_7_{i}"})).cache_salt for i in range(3)
        ]
        again = make(**(kwargs | {"request_id": "req_8_1"})).cache_salt
    finally:
        request_args.set_block_hasher(None)
        request_args.set_salted(None)
    assert salts[0] is None and salts[2] is None
    assert salts[1] and again and salts[1] != again  # unique: never shared
    assert make(**(kwargs | {"request_id": "req_9_1"})).cache_salt is None


@pytest.mark.parametrize(
    ("shape", "request_id", "why"),
    [
        (Request016, "req_7_1", "takes no cache_salt"),  # a release without salts
        (
            RequestSalted,
            "custom-id",
            "names no position",
        ),  # ids speculators no longer makes
    ],
)
def test_a_salt_that_cannot_be_given_is_refused_not_skipped(shape, request_id, why):
    """A sequence to compute whole that went unsalted could be served from
    the cache and its joined rows read as whole: the request is refused."""
    make = _applied(request_args, shape)
    request_args.set_salted({1})
    request_args.set_block_hasher(object())
    try:
        with pytest.raises(SpecShimError, match=why):
            make(**(dict(SPECULATORS_REQUEST_KWARGS) | {"request_id": request_id}))
    finally:
        request_args.set_block_hasher(None)
        request_args.set_salted(None)
