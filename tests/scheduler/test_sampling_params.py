"""`SamplingParams` validates itself, and its error names the field as data."""

from __future__ import annotations

import copy
import dataclasses
import math
import pickle
from typing import Any

import numpy as np
import pytest

from scheduler import RequestOutputKind, SamplingParams, SamplingParamsError

# (keyword arguments, the field the error names, a word of the message)
BAD: list[tuple[dict[str, Any], str, str]] = [
    (dict(max_tokens=0), "max_tokens", "positive integer"),
    (dict(max_tokens=2.5), "max_tokens", "positive integer"),
    (dict(max_tokens=True), "max_tokens", "positive integer"),
    (dict(min_tokens=-1), "min_tokens", "min_tokens"),
    (dict(max_tokens=5, min_tokens=9), "min_tokens", "max_tokens=5"),
    (dict(temperature=-0.1), "temperature", ">= 0"),
    (dict(temperature=math.inf), "temperature", "finite"),
    (dict(temperature=math.nan), "temperature", "finite"),
    (dict(temperature="hot"), "temperature", "temperature"),
    (dict(top_p=0.0), "top_p", r"\(0, 1\]"),
    (dict(top_p=1.5), "top_p", "top_p"),
    (dict(top_p=math.nan), "top_p", "top_p"),
    (dict(min_p=2.0), "min_p", r"\[0, 1\]"),
    (dict(min_p=math.inf), "min_p", "min_p"),
    (dict(top_k=-3), "top_k", "-1 or 0"),
    (dict(top_k=1.5), "top_k", "top_k"),
    (dict(seed=2**63), "seed", "int64"),
    (dict(seed=-(2**63) - 1), "seed", "int64"),
    (dict(seed="7"), "seed", "seed"),
    (dict(logprobs=-1), "logprobs", ">= 0"),
    (dict(prompt_logprobs=-2), "prompt_logprobs", ">= 0"),
    (dict(prompt_logprobs=1.5), "prompt_logprobs", ">= 0"),
    (dict(stop=[""]), "stop", "non-empty"),
    (dict(stop=["ok", 3]), "stop", "non-empty strings"),
    (dict(stop_token_ids=[1, -2]), "stop_token_ids", "token ids"),
    (dict(stop_token_ids=[1.0]), "stop_token_ids", "token ids"),
    (dict(stop_token_ids=7), "stop_token_ids", "a list"),
    (dict(ignore_eos="yes"), "ignore_eos", "True or False"),
    (dict(include_stop_str_in_output=1), "include_stop_str_in_output", "True or False"),
    (dict(skip_special_tokens=None), "skip_special_tokens", "True or False"),
    (dict(output_kind="final_only"), "output_kind", "RequestOutputKind"),
    (dict(output_kind=1), "output_kind", "CUMULATIVE or FINAL_ONLY"),  # vLLM's DELTA
    (dict(output_kind=True), "output_kind", "RequestOutputKind"),
    (dict(presence_penalty=2.5), "presence_penalty", r"\[-2, 2\]"),
    (dict(presence_penalty=math.nan), "presence_penalty", "presence_penalty"),
    (dict(frequency_penalty=-2.01), "frequency_penalty", r"\[-2, 2\]"),
    (dict(frequency_penalty="1"), "frequency_penalty", "frequency_penalty"),
    (dict(repetition_penalty=0.0), "repetition_penalty", "> 0"),
    (dict(repetition_penalty=math.inf), "repetition_penalty", "finite"),
    (dict(logit_bias=[(1, 2.0)]), "logit_bias", "dict"),
    (dict(logit_bias={"5": 1.0}), "logit_bias", "string keys"),
    (dict(logit_bias={-1: 1.0}), "logit_bias", ">= 0"),
    (dict(logit_bias={3: math.nan}), "logit_bias", "finite"),
    (dict(allowed_token_ids=[]), "allowed_token_ids", "not be empty"),
    (dict(allowed_token_ids=[1, -1]), "allowed_token_ids", "token ids"),
    (dict(allowed_token_ids=5), "allowed_token_ids", "a list"),
    (dict(bad_words=["ok", " "]), "bad_words", "non-blank"),
    (dict(bad_words=[3]), "bad_words", "non-blank"),
]


@pytest.mark.parametrize(("kwargs", "param", "message"), BAD,
                         ids=[f"{p}-{i}" for i, (_, p, _) in enumerate(BAD)])
def test_a_bad_value_names_its_field(kwargs: dict[str, Any], param: str, message: str) -> None:
    with pytest.raises(SamplingParamsError, match=message) as info:
        SamplingParams(**kwargs)
    assert info.value.param == param
    assert isinstance(info.value, ValueError)  # callers that catch ValueError still do


def test_the_error_keeps_the_offending_value() -> None:
    with pytest.raises(SamplingParamsError) as info:
        SamplingParams(stop_token_ids=[4, -2])
    assert info.value.value == -2


def test_replace_validates_again() -> None:
    sp = SamplingParams(temperature=0.5)
    with pytest.raises(SamplingParamsError) as info:
        dataclasses.replace(sp, top_p=0.0)
    assert info.value.param == "top_p"


def test_edges_of_the_ranges_are_accepted() -> None:
    for kwargs in (dict(max_tokens=None), dict(max_tokens=1, min_tokens=1),
                   dict(max_tokens=None, min_tokens=10**6), dict(temperature=0),
                   dict(top_p=1), dict(top_p=1e-9), dict(min_p=0), dict(min_p=1),
                   dict(top_k=-1), dict(top_k=0), dict(top_k=10**12), dict(seed=-(2**63)),
                   dict(seed=2**63 - 1), dict(logprobs=0), dict(stop_token_ids=[0]),
                   dict(presence_penalty=-2), dict(presence_penalty=2),
                   dict(frequency_penalty=-2.0), dict(frequency_penalty=2.0),
                   dict(repetition_penalty=1e-3), dict(repetition_penalty=50.0),
                   dict(logit_bias={}), dict(allowed_token_ids=[0])):
        assert SamplingParams(**kwargs) is not None


def test_numpy_numbers_are_accepted() -> None:
    sp = SamplingParams(max_tokens=np.int64(4), temperature=np.float32(0.5), top_k=np.int32(3),
                        seed=np.uint32(7), stop_token_ids=np.array([1, 2]))
    assert sp.stop_token_ids == (1, 2)


def test_lists_become_tuples_and_a_single_stop_string_a_tuple() -> None:
    sp = SamplingParams(stop="end", stop_token_ids=[3, 4])
    assert sp.stop == ("end",) and sp.stop_token_ids == (3, 4)
    none = SamplingParams(stop=None, stop_token_ids=None)
    assert none.stop == () and none.stop_token_ids == ()
    assert hash(sp) == hash(SamplingParams(stop=["end"], stop_token_ids=(3, 4)))


def test_output_kind_is_cumulative_unless_asked_and_its_value_is_read_back() -> None:
    assert SamplingParams().output_kind is RequestOutputKind.CUMULATIVE
    final = SamplingParams(output_kind=RequestOutputKind.FINAL_ONLY)
    assert SamplingParams(output_kind=2).output_kind is RequestOutputKind.FINAL_ONLY  # JSON's
    assert pickle.loads(pickle.dumps(final)) == final


def test_vllm_defaults() -> None:
    sp = SamplingParams()
    assert (sp.max_tokens, sp.temperature, sp.top_p, sp.top_k, sp.min_p) == (16, 1.0, 1.0, 0, 0.0)
    assert sp.include_stop_str_in_output is False and sp.skip_special_tokens is True


def test_penalty_defaults_are_vllms_and_off() -> None:
    sp = SamplingParams()
    assert (sp.presence_penalty, sp.frequency_penalty, sp.repetition_penalty) == (0.0, 0.0, 1.0)
    assert sp.logit_bias is None and sp.allowed_token_ids is None and sp.bad_words == ()


def test_logit_bias_is_clamped_read_only_and_compared() -> None:
    sp = SamplingParams(logit_bias={np.int64(3): 250, 4: -1e9, 5: 0.5})
    assert dict(sp.logit_bias) == {3: 100.0, 4: -100.0, 5: 0.5}
    with pytest.raises(TypeError):
        sp.logit_bias[3] = 1.0  # type: ignore[index]
    assert sp == SamplingParams(logit_bias={3: 100.0, 4: -100.0, 5: 0.5})
    assert sp != SamplingParams(logit_bias={3: 100.0})
    assert hash(sp) == hash(SamplingParams(logit_bias={3: 1.0}))  # hashable; bias left out


def test_allowed_token_ids_and_bad_words_become_tuples() -> None:
    sp = SamplingParams(allowed_token_ids=np.array([4, 2]), bad_words=["a b", "c"])
    assert sp.allowed_token_ids == (4, 2) and sp.bad_words == ("a b", "c")
    assert SamplingParams(bad_words="word").bad_words == ("word",)
    assert SamplingParams(bad_words=None).bad_words == ()


def test_pickles_and_copies_with_a_logit_bias() -> None:
    sp = SamplingParams(logit_bias={3: 2.0}, allowed_token_ids=[1, 3], bad_words=["x"],
                        presence_penalty=0.5, stop=["end"])
    for again in (pickle.loads(pickle.dumps(sp)), copy.deepcopy(sp), copy.copy(sp)):
        assert again == sp and dict(again.logit_bias) == {3: 2.0}


def test_extra_args_are_a_read_only_copy_with_string_keys_and_survive_pickling() -> None:
    given = {"kv_transfer_params": {"do_remote_decode": True}}
    sp = SamplingParams(extra_args=given)
    given["other"] = 1
    assert dict(sp.extra_args) == {"kv_transfer_params": {"do_remote_decode": True}}
    with pytest.raises(TypeError):
        sp.extra_args["x"] = 1  # type: ignore[index]
    assert pickle.loads(pickle.dumps(sp)) == sp
    with pytest.raises(SamplingParamsError, match="extra_args must be a dict with string keys"):
        SamplingParams(extra_args={1: "a"})
