"""Tuning an explainer's parameters against an evaluation metric, with optuna (the ``tdhook[tune]`` extra).

The explainer says what can be tuned (``get_tunables()``, see
:mod:`tdhook.attribution.tunables`); each trial sets a copy of it
(``copy().set_kwargs(...)``), explains ``td`` with it and scores the result
with ``metric(module, td_with_attribution)``, whose mean is the objective.
"""

from __future__ import annotations

import inspect
import math
import numbers
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from tensordict import TensorDictBase
from tqdm import TqdmWarning, tqdm  # the plain bar: tqdm.auto warns in notebooks without ipywidgets

from tdhook.attribution.tunables import Space

__all__ = ["TuneResult", "tune"]

Metric = Callable[[Any, TensorDictBase], torch.Tensor]
_SAMPLERS = ("tpe", "random")


@dataclass
class TuneResult:
    """What :func:`tune` found.

    Attributes:
        best_params: the tunable parameters of the best trial.
        best_value: the objective of the best trial (the metric's mean).
        explainer: a copy of the explainer with ``best_params`` set.
        study: the optuna study, with every trial.

    Examples:
        >>> import torch
        >>> from tensordict import TensorDict
        >>> from tensordict.nn import TensorDictModule
        >>> from tdhook.attribution import LRP, UniformEpsilon
        >>> from tdhook.metrics import aopc, pixel_flipping
        >>> net = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
        >>> policy = TensorDictModule(net, in_keys=["observation"], out_keys=["action_value"])
        >>> td = TensorDict(observation=torch.randn(8, 6), batch_size=[8])
        >>> result = tune(LRP(policy, UniformEpsilon()), td,
        ...               lambda m, td: aopc(pixel_flipping(m, td, relevance_key="relevance")), n_trials=2,
        ...               progress=False)
        >>> len(result.study.trials), result.best_value == result.study.best_value
        (2, True)
        >>> result.explainer.rule_mapper.epsilon == result.best_params["epsilon"]
        True
    """

    best_params: dict[str, Any]
    best_value: float
    explainer: Any
    study: Any


def _import_optuna() -> Any:
    try:
        # optuna imports tqdm.auto, which in a notebook without ipywidgets warns that it falls back to the plain
        # bar; tune uses the plain bar anyway, so the warning says nothing to the reader.
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="IProgress not found", category=TqdmWarning)
            import optuna
    except ImportError as err:
        raise ImportError(
            "tune needs optuna, which is an optional extra of tdhook: pip install 'tdhook[tune]'"
        ) from err
    return optuna


def _suggest(trial: Any, name: str, space: Space) -> Any:
    kind, spec = space
    if "choices" in spec:
        return trial.suggest_categorical(name, list(spec["choices"]))
    if kind is int:
        return trial.suggest_int(name, int(spec["low"]), int(spec["high"]), log=bool(spec["log"]))
    return trial.suggest_float(name, float(spec["low"]), float(spec["high"]), log=bool(spec["log"]))


def _takes_explainer(metric: Metric) -> bool:
    """Whether ``metric`` takes the explainer itself, as a keyword ``explainer`` (sensitivity, randomisation)."""
    try:
        parameters = inspect.signature(metric).parameters
    except (TypeError, ValueError):
        return False
    return "explainer" in parameters


def _sampler(optuna: Any, sampler: Any, seed: int) -> Any:
    if isinstance(sampler, optuna.samplers.BaseSampler):
        return sampler
    if sampler == "tpe":
        return optuna.samplers.TPESampler(seed=seed)
    if sampler == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    raise ValueError(f"tune: sampler must be one of {list(_SAMPLERS)} or an optuna sampler, got {sampler!r}")


_EXPLAINER_METHODS = ("get_tunables", "tunable_values", "set_kwargs", "copy")


def _check_explainer(explainer: Any) -> None:
    """Refuse what is no explainer with tunables (a policy, a preset) by name, before any trial runs.

    Examples:
        >>> from tdhook.attribution import UniformEpsilon
        >>> _check_explainer(UniformEpsilon())
        Traceback (most recent call last):
        ...
        TypeError: tune: explainer must be an attribution wrapper that says what can be tuned (get_tunables(), \
set_kwargs(), copy()), such as LRP(policy, UniformEpsilon()) or IntegratedGradients(policy); got UniformEpsilon, a \
rule mapper: wrap the model with it, LRP(policy, UniformEpsilon())
    """
    if all(callable(getattr(explainer, name, None)) for name in _EXPLAINER_METHODS) and hasattr(explainer, "module"):
        return
    kind = type(explainer).__name__
    if all(callable(getattr(explainer, name, None)) for name in _EXPLAINER_METHODS):  # a preset: no model
        kind = f"{kind}, a rule mapper: wrap the model with it, LRP(policy, {kind}())"
    raise TypeError(
        "tune: explainer must be an attribution wrapper that says what can be tuned (get_tunables(), set_kwargs(), "
        f"copy()), such as LRP(policy, UniformEpsilon()) or IntegratedGradients(policy); got {kind}"
    )


def _first_trial(values: dict[str, Any], tunables: dict[str, Space]) -> dict[str, Any]:
    """The current values optuna can start from: a choice among the choices, a number clamped to its range."""
    first = {}
    for name, value in values.items():
        kind, spec = tunables[name]
        if "choices" in spec:
            if any(value is c or (type(value) is type(c) and value == c) for c in spec["choices"]):
                first[name] = value
        elif (number := _plain_number(value)) is not None and math.isfinite(number):
            first[name] = kind(min(max(number, spec["low"]), spec["high"]))
    return first


def _plain_number(value: Any) -> float | int | None:
    """``value`` as a Python number where it is one (a NumPy scalar, a tensor of one element, an ``int`` or a
    ``float``; not a ``bool``), else ``None``.

    Examples:
        >>> import numpy as np
        >>> _plain_number(np.float32(0.5)), _plain_number(torch.tensor(2.0)), _plain_number(True)
        (0.5, 2.0, None)
    """
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or value.dtype is torch.bool or value.is_complex():
            return None
        return value.item()
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return None
    return value if isinstance(value, (int, float)) else float(value)


def tune(
    explainer: Any,
    td: TensorDictBase,
    metric: Metric,
    *,
    n_trials: int = 20,
    direction: str = "maximize",
    sampler: str | Any = "tpe",
    seed: int = 0,
    timeout: float | None = None,
    progress: bool = True,
    verbose: bool = False,
) -> TuneResult:
    """Pick the explainer's tunable parameters that score best on ``metric``.

    The explainer's current parameters are the first trial (a number outside
    its range clamped to the range, a parameter with no value sampled), so the
    result is never worse than the explainer as it is. A trial whose objective
    is not finite (NaN or infinite) is failed and cannot be the best. For a deterministic explainer and
    metric, ``best_value`` is the metric of ``result.explainer`` and the same
    ``seed`` gives the same result.

    Args:
        explainer: an object with ``get_tunables()``, ``set_kwargs()`` and ``copy()`` that explains a TensorDict
            when called (the :class:`~tdhook.attribution.LRP` wrapper, an attribution method).
        td: the inputs to explain (left unchanged).
        metric: ``(module, td_with_attribution) -> tensor``; its mean is the objective. ``module`` is the
            explainer's wrapped model. A metric with a parameter named ``explainer`` also receives the trial's
            explainer (for the metrics that explain again: ``sensitivity_max``, ``randomisation_check``).
        n_trials: the number of trials, the first included.
        direction: ``"maximize"`` or ``"minimize"``.
        sampler: ``"tpe"``, ``"random"`` or an optuna sampler.
        seed: the sampler's seed.
        timeout: stop starting trials after this many seconds.
        progress: show a progress bar.
        verbose: let optuna log each trial.

    Returns:
        A :class:`TuneResult`.

    Examples:
        >>> import torch
        >>> from tensordict import TensorDict
        >>> from tensordict.nn import TensorDictModule
        >>> from tdhook.attribution import LRP, UniformEpsilon
        >>> from tdhook.metrics import aopc, pixel_flipping
        >>> torch.manual_seed(0)  # doctest: +ELLIPSIS
        <torch._C.Generator object at ...>
        >>> net = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
        >>> policy = TensorDictModule(net, in_keys=["observation"], out_keys=["action_value"])
        >>> td = TensorDict(observation=torch.randn(8, 6), batch_size=[8])
        >>> lrp = LRP(policy, rule_mapper=UniformEpsilon())
        >>> result = tune(lrp, td, lambda m, td: aopc(pixel_flipping(m, td, relevance_key="relevance")),
        ...               n_trials=5, progress=False)
        >>> sorted(result.best_params), result.best_value >= result.study.trials[0].value
        (['epsilon'], True)
    """
    optuna = _import_optuna()
    if direction not in ("maximize", "minimize"):
        raise ValueError(f"tune: direction must be 'maximize' or 'minimize', got {direction!r}")
    if not isinstance(n_trials, int) or isinstance(n_trials, bool) or n_trials < 1:
        raise ValueError(f"tune: n_trials must be an integer >= 1, got {n_trials!r}")
    if not callable(metric):
        raise ValueError(
            f"tune: metric must be a callable (module, explained_td) -> tensor whose mean is the objective, such as "
            f"lambda m, td: aopc(pixel_flipping(m, td, relevance_key='relevance')); got {type(metric).__name__}"
        )
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise ValueError(f"tune: seed must be an integer (the same seed gives the same result), got {seed!r}")
    if timeout is not None and (
        not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or math.isnan(timeout) or timeout < 0
    ):
        raise ValueError(f"tune: timeout must be a number of seconds >= 0 or None, got {timeout!r}")
    if not isinstance(td, TensorDictBase):
        raise TypeError(
            f"tune: td must be a TensorDict of the inputs to explain (TensorDict(observation=x, batch_size=[n])), "
            f"got {type(td).__name__}"
        )
    _check_explainer(explainer)
    tunables = explainer.get_tunables()
    if not tunables:
        raise ValueError(f"tune: {type(explainer).__name__} has no tunable parameters")
    current = _first_trial(explainer.tunable_values(), tunables)
    module = explainer.module
    takes_explainer = _takes_explainer(metric)
    best: dict[str, Any] = {}

    def objective(trial: Any) -> float:
        params = {name: _suggest(trial, name, space) for name, space in tunables.items()}
        candidate = explainer.copy()
        candidate.set_kwargs(**params)
        explained = candidate(td.clone())
        score = metric(module, explained, explainer=candidate) if takes_explainer else metric(module, explained)
        if not isinstance(score, (torch.Tensor, numbers.Real)):
            raise TypeError(
                f"tune: the metric returned {type(score).__name__}; it must return a tensor or a number whose mean is "
                "the objective (of a metric returning a TensorDict, pick one entry: lambda m, td: "
                "action_fidelity(m, td, k=2)['relevant'])"
            )
        value = float(torch.as_tensor(score).double().mean())
        if not math.isfinite(value):
            # optuna fails a trial whose value is NaN, but would take an infinite one as the best: fail both, so that
            # the best trial, its parameters and the explainer returned are one trial's
            return math.nan
        previous = best.get("value")
        if previous is None or (value > previous if direction == "maximize" else value < previous):
            best.update(value=value, explainer=candidate)
        return value

    verbosity = optuna.logging.get_verbosity()
    optuna.logging.set_verbosity(optuna.logging.INFO if verbose else optuna.logging.ERROR)
    try:
        study = optuna.create_study(direction=direction, sampler=_sampler(optuna, sampler, seed))
        if current:
            study.enqueue_trial(current)
        with tqdm(total=n_trials, desc="tune", disable=not progress, leave=False) as bar:

            def advance(study: Any, trial: Any) -> None:
                bar.update(1)
                if "value" in best:
                    bar.set_postfix(best=f"{best['value']:.4g}")

            study.optimize(objective, n_trials=n_trials, timeout=timeout, callbacks=[advance])
    finally:
        optuna.logging.set_verbosity(verbosity)
    if all(t.state == optuna.trial.TrialState.WAITING for t in study.trials):
        raise RuntimeError(f"tune: no trial started before the timeout of {timeout} s")
    if "value" not in best:
        raise ValueError("tune: the metric was not finite in any trial")
    best_trial = study.best_trial
    return TuneResult(dict(best_trial.params), float(best_trial.value), best["explainer"], study)
