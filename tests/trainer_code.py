"""The RL trainers' own loss code, loaded on the CPU without their dependency trees, for the policy-loss adapter
tests (tests/test_policy_trainers.py).

- verl 0.9.1: ``verl/trainer/ppo/core_algos.py`` (its policy losses, ``agg_loss``, ``kl_penalty``) and
  ``verl/utils/torch_functional.py`` (``masked_sum`` / ``masked_mean``), executed as files. What they import
  from the rest of verl and from ray, omegaconf and tensordict (configs, a decorator, device helpers, unused
  functions) is stubbed; every line of the functions the tests call is verl's.
- TRL 1.16.0: ``GRPOTrainer._compute_loss`` taken out of ``trl/trainer/grpo_trainer.py`` by its source (the module
  imports pandas, accelerate, datasets) and run as a method of a stand-in trainer that has the attributes it
  reads; its ``nanmin`` / ``nanmax`` come from ``trl/trainer/utils.py`` the same way. ``GKDTrainer.compute_loss``
  and ``generalized_jsd_loss`` from ``trl/experimental/gkd/gkd_trainer.py`` likewise, as a class of those two
  methods (its ``empty_cache`` a no-op) for the distillation mixin's tests (tests/test_distillation_trainers.py);
  ``_chunked_divergence_loss`` from ``trl/trainer/distillation_trainer.py`` over TRL's own kernel module, and
  that trainer's ``compute_loss`` with the two methods it runs (tools/benchmarks/distillation_step.py).

CI installs the packages without their dependencies (``pip install --no-deps verl==0.9.1 trl==1.16.0``);
without them these tests skip.
"""

from __future__ import annotations

import ast
import contextlib
import importlib
import importlib.util
import sys
import types
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import torch

INSTALL_HINT = "pip install --no-deps verl==0.9.1 trl==1.16.0"


def _package_dir(package: str) -> Path:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        pytest.skip(f"{package} is not installed ({INSTALL_HINT})")
    return Path(next(iter(spec.submodule_search_locations)))


class VerlConfig(dict):
    """verl's ActorConfig as its loss functions read it: attributes, ``.get`` and ``global_batch_info``."""

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError as exc:
            raise AttributeError(name) from exc


@cache
def verl_core_algos() -> types.ModuleType:
    """verl's core_algos module, with its imports outside torch stubbed (module docstring)."""
    root = _package_dir("verl")
    stubs: dict[str, types.ModuleType] = {}

    def stub(name: str, **attrs: Any) -> types.ModuleType:
        module = types.ModuleType(name)
        module.__dict__.update(attrs)
        stubs[name] = module
        return module

    stub("omegaconf", DictConfig=dict)
    stub("tensordict", TensorDict=dict)
    stub("verl", __path__=[str(root)])
    stub("verl.utils", __path__=[str(root / "utils")], as_torch_index=None, group_mean_std=None)
    stub("verl.utils.device", get_device_name=lambda: "cpu", get_torch_device=lambda: torch.cpu)
    stub("verl.utils.import_utils", deprecated=lambda *a, **k: (lambda fn: fn))
    stub("verl.trainer", __path__=[str(root / "trainer")])
    stub("verl.trainer.config", AlgoConfig=type("AlgoConfig", (), {}))
    stub("verl.workers", __path__=[str(root / "workers")])
    stub("verl.workers.config", ActorConfig=VerlConfig)
    saved = {name: sys.modules.get(name) for name in (*stubs, "verl.utils.torch_functional")}
    sys.modules.update(stubs)
    try:
        functional = _exec_file("verl.utils.torch_functional", root / "utils" / "torch_functional.py")
        sys.modules["verl.utils.torch_functional"] = functional
        stubs["verl.utils"].torch_functional = functional
        return _exec_file("_verl_core_algos", root / "trainer" / "ppo" / "core_algos.py")
    finally:
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module


def _exec_file(name: str, path: Path) -> types.ModuleType:
    if not path.is_file():
        pytest.skip(f"{path} is missing (expected the version of {INSTALL_HINT})")
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def verl_ppo_loss(config: VerlConfig, log_prob: torch.Tensor, entropy: torch.Tensor | None, *,
                  old_log_prob: torch.Tensor, advantages: torch.Tensor, response_mask: torch.Tensor,
                  rollout_is_weights: torch.Tensor | None, ref_log_prob: torch.Tensor | None
                  ) -> tuple[torch.Tensor, dict[str, Any]]:
    """``verl.workers.utils.losses.ppo_loss``'s combination (that file needs tensordict): verl's policy loss of
    the config's mode, its agg_loss of the entropy and of its kl_penalty."""
    algos = verl_core_algos()
    mask = response_mask.bool()
    pg_loss, metrics = algos.get_policy_loss_fn(config.policy_loss["loss_mode"])(
        old_log_prob=old_log_prob, log_prob=log_prob, advantages=advantages, response_mask=mask,
        loss_agg_mode=config.loss_agg_mode, config=config, rollout_is_weights=rollout_is_weights)
    metrics = dict(metrics, **{"actor/pg_loss": pg_loss.detach()})
    loss = pg_loss
    if entropy is not None:
        entropy_loss = algos.agg_loss(entropy, mask, config.loss_agg_mode, **config.global_batch_info)
        loss = loss - config.entropy_coeff * entropy_loss
        metrics["actor/entropy_loss"] = entropy_loss.detach()
    if config.use_kl_loss:
        kld = algos.kl_penalty(log_prob, ref_log_prob, config.kl_loss_type)
        kl_loss = algos.agg_loss(kld, mask, config.loss_agg_mode, **config.global_batch_info)
        loss = loss + kl_loss * config.kl_loss_coef
        metrics["kl_loss"] = kl_loss.detach()
        metrics["kl_coef"] = config.kl_loss_coef
    return loss, metrics


@cache
def trl_compute_loss() -> tuple[Any, dict[str, Any]]:
    """(TRL's ``GRPOTrainer._compute_loss`` as a plain function, the namespace it runs in)."""
    root = _package_dir("trl") / "trainer"
    namespace: dict[str, Any] = {"torch": torch}
    _exec_functions(root / "utils.py", None, ("nanmin", "nanmax"), namespace)
    _exec_functions(root / "grpo_trainer.py", "GRPOTrainer", ("_compute_loss",), namespace)
    return namespace["_compute_loss"], namespace


@cache
def trl_gkd_trainer() -> type:
    """A class of TRL's ``GKDTrainer.compute_loss`` and ``generalized_jsd_loss`` (a static method there too)."""
    namespace: dict[str, Any] = {"torch": torch, "F": torch.nn.functional, "empty_cache": lambda: None}
    path = _package_dir("trl") / "experimental" / "gkd" / "gkd_trainer.py"
    _exec_functions(path, "GKDTrainer", ("compute_loss", "generalized_jsd_loss"), namespace)
    return type("TrlGKDLoss", (), {"compute_loss": namespace["compute_loss"],
                                   "generalized_jsd_loss": staticmethod(namespace["generalized_jsd_loss"])})


def import_trl_kernel(name: str) -> types.ModuleType:
    """A module of ``trl.kernels`` whose one import from the rest of TRL is ``trl.trainer.utils``'s ZeRO-3 gather
    (that module imports pandas, accelerate, datasets): imported with a no-op stub of it in ``sys.modules``, which is
    put back as it was afterwards (the kernel module binds the name at import). Raises ImportError without TRL; also
    used by tools/benchmarks/distill_peers.py."""
    utils = types.ModuleType("trl.trainer.utils")
    utils.maybe_gather_lm_head_ctx = lambda *params: contextlib.nullcontext()
    saved = sys.modules.get("trl.trainer.utils")
    sys.modules["trl.trainer.utils"] = utils
    try:
        return importlib.import_module(name)
    finally:
        if saved is None:
            del sys.modules["trl.trainer.utils"]
        else:
            sys.modules["trl.trainer.utils"] = saved


@cache
def trl_chunked_divergence_loss() -> Any:
    """TRL's ``_chunked_divergence_loss`` (its DistillationTrainer's loss, trl/trainer/distillation_trainer.py) over
    its own kernel (trl/kernels/chunked_divergence.py, imported with its one import from trl.trainer.utils, the
    ZeRO-3 gather, a no-op stub while it loads)."""
    _package_dir("trl")
    kernel = import_trl_kernel("trl.kernels.chunked_divergence")
    importlib.import_module("torch.distributed.tensor")  # the function reads torch.distributed.tensor.DTensor
    namespace: dict[str, Any] = {"torch": torch, "ChunkedDivergenceFunction": kernel.ChunkedDivergenceFunction,
                                 "_use_triton": importlib.import_module("trl.kernels.chunked_logprob")._use_triton}
    _exec_functions(_package_dir("trl") / "trainer" / "distillation_trainer.py", None,
                    ("_chunked_divergence_loss",), namespace)
    return namespace["_chunked_divergence_loss"]


def trl_distillation_trainer(divergence_loss: Any) -> type:
    """A class of TRL's ``DistillationTrainer.compute_loss``, ``_compute_loss`` and ``_get_last_hidden_state``
    (trl/trainer/distillation_trainer.py) whose ``_chunked_divergence_loss`` is ``divergence_loss``, as the module
    attribute a user replaces would be (TRL's own: :func:`trl_chunked_divergence_loss`). Run on a stand-in trainer
    with the attributes they read (no PEFT model here: ``is_peft_model`` says no)."""
    transformers = pytest.importorskip("transformers")
    from packaging.version import Version  # a dependency of transformers
    namespace: dict[str, Any] = {"torch": torch, "transformers": transformers, "Version": Version,
                                 "is_peft_model": lambda model: False, "_chunked_divergence_loss": divergence_loss}
    _exec_functions(_package_dir("trl") / "trainer" / "distillation_trainer.py", "DistillationTrainer",
                    ("compute_loss", "_compute_loss", "_get_last_hidden_state"), namespace)
    return type("TrlDistillationLoss", (), {name: namespace[name] for name in
                                            ("compute_loss", "_compute_loss", "_get_last_hidden_state")})


def _exec_functions(path: Path, class_name: str | None, names: tuple[str, ...], namespace: dict[str, Any]) -> None:
    """Run the definitions of ``names`` (module level, or in class ``class_name``) from ``path`` in ``namespace``,
    their decorators dropped."""
    if not path.is_file():
        pytest.skip(f"{path} is missing ({INSTALL_HINT})")
    tree = ast.parse(path.read_text())
    scopes = [tree] if class_name is None else [n for n in tree.body if isinstance(n, ast.ClassDef)
                                                 and n.name == class_name]
    found = [n for scope in scopes for n in scope.body if isinstance(n, ast.FunctionDef) and n.name in names]
    if len(found) != len(names):
        pytest.skip(f"{path} lacks {names} (expected trl 1.16.0)")
    for node in found:
        node.decorator_list = []
    exec(compile(ast.Module(body=found, type_ignores=[]), str(path), "exec"), namespace)
