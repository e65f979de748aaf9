"""flce's input errors are catchable as torch's: every one is a ValueError or TypeError (flce's clearer
message) and a RuntimeError (what ``torch.nn.functional.linear_cross_entropy`` raises for the same mistake).

The cases are PyTorch's own error inputs of ``nn.functional.linear_cross_entropy`` (its OpInfo
``error_inputs_linear_cross_entropy``) and of ``nn.LinearCrossEntropyLoss`` (its ModuleInfo), run through
flce's functional form and module; the OpInfo database itself runs where it imports (it needs expecttest).
"""

from __future__ import annotations

import importlib.util
import re
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import flce
from flce.distributed import token_sharded_mean
from flce.integrations.trl import chunked_logprobs

TORCH_HAS_LCE = hasattr(F, "linear_cross_entropy")


def _randn(*shape: int) -> torch.Tensor:
    return torch.randn(*shape)


def _assert_flce_input_error(exc: BaseException, torch_type: type[BaseException] = RuntimeError) -> None:
    assert isinstance(exc, (flce.InputError, flce.InputTypeError)), f"{type(exc).__name__}: {exc}"
    assert isinstance(exc, RuntimeError) and isinstance(exc, torch_type)
    assert isinstance(exc, ValueError) != isinstance(exc, TypeError)


# PyTorch's error inputs of F.linear_cross_entropy: (input, linear_weight, target, keywords), float tensors
# throughout as in torch's OpInfo (whose targets there are probabilities or shape mistakes).
FUNCTIONAL_CASES: dict[str, Callable[[], tuple[tuple[torch.Tensor, ...], dict[str, Any]]]] = {
    "input_of_three_dims": lambda: ((_randn(2, 3, 3), _randn(2, 3), _randn(3, 2)), {}),
    "weight_of_one_dim": lambda: ((_randn(2, 3), _randn(2), _randn(2, 2)), {}),
    "in_features_differ": lambda: ((_randn(2, 3), _randn(2, 4), _randn(2, 2)), {}),
    "ignore_index_with_probabilities": lambda: ((_randn(2, 3), _randn(2, 3), _randn(2, 2)), {"ignore_index": 0}),
    "unbatched_input_of_a_k_dim_weight": lambda: ((_randn(3), _randn(2, 4, 3), _randn(2, 4)), {}),
    "bias_of_the_wrong_shape": lambda: ((_randn(2, 3), _randn(2, 3), _randn(2)), {"linear_bias": _randn(3)}),
}


@pytest.mark.parametrize("case", sorted(FUNCTIONAL_CASES))
def test_torchs_functional_error_inputs_are_runtime_errors(case: str) -> None:
    (hidden, weight, target), keywords = FUNCTIONAL_CASES[case]()
    if TORCH_HAS_LCE:
        with pytest.raises(RuntimeError):
            F.linear_cross_entropy(hidden, weight, target, **keywords)
    bias = keywords.pop("linear_bias", None)
    with pytest.raises(RuntimeError) as caught:
        flce.linear_cross_entropy(hidden, weight, target, bias, **keywords)
    _assert_flce_input_error(caught.value)


# PyTorch's error inputs of nn.LinearCrossEntropyLoss(in_features=3, num_classes=2, ...): the constructor's
# options, the forward's (input, target) and the type torch raises; flce's module takes the head's [2, 3]
# weight in the forward.
MODULE_CASES: dict[str, tuple[Callable[[], dict[str, Any]], Callable[[], tuple[torch.Tensor, torch.Tensor]],
                              type[BaseException]]] = {
    "integer_target_of_probabilities_shape": (dict, lambda: (_randn(4, 3), torch.zeros(4, 2, dtype=torch.long)),
                                              RuntimeError),
    "batch_sizes_differ": (dict, lambda: (_randn(4, 3), _randn(5, 2)), ValueError),
    "in_features_differ": (dict, lambda: (_randn(4, 5), _randn(4, 2)), RuntimeError),
    "class_weight_of_the_wrong_shape": (lambda: {"class_weight": torch.ones(3)},
                                        lambda: (_randn(4, 3), torch.zeros(4, dtype=torch.long)), RuntimeError),
    "label_smoothing_above_one": (lambda: {"label_smoothing": 2.0},
                                  lambda: (_randn(4, 3), torch.zeros(4, dtype=torch.long)), RuntimeError),
}


@pytest.mark.parametrize("case", sorted(MODULE_CASES))
def test_torchs_module_error_inputs_are_runtime_errors(case: str) -> None:
    options, forward_inputs, torch_type = MODULE_CASES[case]
    with pytest.raises(RuntimeError) as caught:
        hidden, target = forward_inputs()
        flce.get_impl("cpu")(**options())(hidden, _randn(2, 3), target)
    _assert_flce_input_error(caught.value, torch_type)


@pytest.mark.skipif(importlib.util.find_spec("expecttest") is None,
                    reason="torch's OpInfo database imports expecttest, which is not installed")
def test_every_opinfo_error_input_of_torch() -> None:
    """Every error input of the three OpInfos of nn.functional.linear_cross_entropy (plain, chunked,
    chunked_none), as the torch installed here defines them, raises the type torch's OpInfo expects."""
    from torch.testing._internal.common_methods_invocations import op_db

    ops = [op for op in op_db if op.name == "nn.functional.linear_cross_entropy"]
    assert ops, "torch has no OpInfo for nn.functional.linear_cross_entropy"
    seen = 0
    for op in ops:
        for error_input in op.error_inputs("cpu"):
            sample = error_input.sample_input
            keywords = dict(sample.kwargs)
            bias = keywords.pop("linear_bias", None)
            keywords.pop("options", None)
            with pytest.raises(error_input.error_type) as caught:
                flce.linear_cross_entropy(sample.input, *sample.args, bias, **keywords)
            _assert_flce_input_error(caught.value, error_input.error_type)
            seen += 1
    assert seen >= len(FUNCTIONAL_CASES)


def _sharded_mean_of_a_matrix() -> None:
    token_sharded_mean(torch.ones(2, 2), torch.zeros(2, dtype=torch.long), None)


# One call per kind of check flce makes on its own inputs and options, beyond torch's cases.
FLCE_CASES: dict[str, Callable[[], object]] = {
    "reduction": lambda: flce.get_impl("cpu")(reduction="avg"),
    "softcap": lambda: flce.get_impl("cpu")(softcap=-1.0),
    "an_unknown_option": lambda: flce.get_impl("cpu")(label_smothing=0.1),
    "a_bool_option": lambda: flce.get_impl("cpu")(return_z_loss=1),
    "torchs_weight_keyword": lambda: flce.linear_cross_entropy(_randn(2, 3), _randn(4, 3), torch.zeros(2).long(),
                                                               weight=torch.ones(4)),
    "an_out_of_range_target": lambda: flce.linear_cross_entropy(_randn(2, 3), _randn(4, 3),
                                                                torch.tensor([0, 4])),
    "hidden_not_a_tensor": lambda: flce.linear_cross_entropy([1.0], _randn(4, 3), torch.zeros(1).long()),
    "dtypes_differ": lambda: flce.linear_cross_entropy(_randn(2, 3).double(), _randn(4, 3), torch.zeros(2).long()),
    "selected_ids": lambda: flce.linear_cross_entropy(_randn(2, 3), _randn(4, 3), torch.zeros(2).long(),
                                                      selected_ids=torch.full((2, 1), 9)),
    "token_weights": lambda: flce.linear_cross_entropy(_randn(2, 3), _randn(4, 3), torch.zeros(2).long(),
                                                       token_weights=torch.ones(3)),
    "variant": lambda: flce.get_impl("cpu", variant="fastest"),
    "device": lambda: flce.get_impl("nosuchdevice"),
    "backend": lambda: flce.get_impl("cpu", backend="nosuchbackend"),
    "token_sharded_mean": _sharded_mean_of_a_matrix,
}


@pytest.mark.parametrize("case", sorted(FLCE_CASES))
def test_flces_own_checks_raise_both_types(case: str) -> None:
    with pytest.raises(RuntimeError) as caught:
        FLCE_CASES[case]()
    _assert_flce_input_error(caught.value)


def test_the_messages_are_flces() -> None:
    """The types changed, the words did not: the error still names the argument and what was expected."""
    with pytest.raises(ValueError, match=r"label_smoothing=2.0: expected a value in \[0, 1\]"):
        flce.get_impl("cpu")(label_smoothing=2.0)
    with pytest.raises(TypeError, match="target: expected an integer tensor of class ids, got dtype torch.float32"):
        flce.linear_cross_entropy(_randn(2, 3), _randn(4, 3), _randn(2))


# The one finite-number check (flce.config.check_finite_real) as the front ends that take a real number ask it:
# the options, the policy loss's options, TRL's drop-in.
REAL_NUMBER_ARGUMENTS: dict[str, Callable[[Any], object]] = {
    "temperature": lambda value: flce.get_impl("cpu")(temperature=value),
    "entropy_weight": lambda value: flce.get_policy_impl("cpu")(entropy_weight=value),
    "logit_scale": lambda value: chunked_logprobs(_randn(2, 3), _randn(4, 3), None, torch.zeros(2).long(), 1.0, 4,
                                                  logit_scale=value),
}


@pytest.mark.parametrize("value", [float("nan"), float("-inf"), "0.5", True], ids=["nan", "-inf", "str", "bool"])
@pytest.mark.parametrize("name", sorted(REAL_NUMBER_ARGUMENTS))
def test_every_front_end_refuses_a_non_finite_number_alike(name: str, value: Any) -> None:
    with pytest.raises(flce.InputTypeError, match=re.escape(f"{name}={value!r}: expected a finite real number")):
        REAL_NUMBER_ARGUMENTS[name](value)
