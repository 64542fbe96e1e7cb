"""A softmax whose ``dtype`` narrows its logits' range, so that a mask's lowest value becomes ``-inf``.

An attention mask marks a key a query must not see with the lowest value of the scores' dtype
(``torch.finfo(dtype).min``), not with ``-inf``, so that a query that sees no key at all (a left-padded
position) still gets finite weights. A softmax that computes in a narrower dtype than its input
(``softmax(scores, dim=-1, dtype=torch.float32)`` on float64 scores, as transformers' eager attention of
Llama, Mistral, Qwen2, Gemma and others calls it) casts that value to ``-inf``: such a query's weights are
``NaN``, and so are the model's output and the relevance wherever they reach (the plain model's output too).
No rule can give that query finite weights without changing the model's output, so the call is refused,
naming the module and the mask.

Examples:
    >>> scores = torch.tensor([[0.5, torch.finfo(torch.float64).min]], dtype=torch.float64)
    >>> raise_for_unseen_rows(scores, torch.softmax(scores, -1, dtype=torch.float32), -1)  # a key seen: finite
"""

from __future__ import annotations

import torch

from tdhook.attribution.rules._recomputed import error_in_running_module

__all__ = ["raise_for_unseen_rows"]


def raise_for_unseen_rows(logits: torch.Tensor, weights: torch.Tensor, dim: int | None) -> None:
    """Raise where the softmax ``weights`` of finite ``logits``, computed in a narrower dtype, are ``NaN`` in a row
    whose logits all became ``-inf`` in that dtype (a query that the mask leaves no key, see the module's
    docstring). Logits that are ``-inf`` or ``NaN`` themselves are the model's own choice: left as they are.

    Checked where the function rules' mode runs: a call outside the wrapper's context, and the first call of a
    context. A later call that takes the recorded graph's way (see :mod:`~tdhook.attribution._function_rule_plan`)
    is not checked: there a NaN weight gives the NaN output and relevance it gives the plain model.

    Raises:
        FloatingPointError: naming the module (its path is added by the LRP wrapper), the mask and the rows.

    Examples:
        >>> lowest = torch.finfo(torch.float64).min
        >>> scores = torch.tensor([[0.5, lowest], [lowest, lowest]], dtype=torch.float64)
        >>> try:
        ...     raise_for_unseen_rows(scores, torch.softmax(scores, -1, dtype=torch.float32), -1)
        ... except FloatingPointError as err:
        ...     print(str(err)[:59])
        LRP: a call computes a softmax over float64 scores in float
    """
    if dim is None or weights.dtype.itemsize >= logits.dtype.itemsize or not logits.is_floating_point():
        return
    values = logits.detach()
    unseen = torch.isneginf(values.to(weights.dtype)).all(dim) & values.isfinite().all(dim)
    if not bool(unseen.any()):
        return
    rows = unseen.nonzero()
    wide, narrow = (str(t.dtype).removeprefix("torch.") for t in (logits, weights))
    raise error_in_running_module(
        FloatingPointError,
        f"computes a softmax over {wide} scores in {narrow} (its dtype argument): the mask's lowest {wide} value "
        f"(torch.finfo(torch.{wide}).min) becomes -inf in {narrow}, so a query the "
        f"attention mask leaves no key (left padding: {len(rows)} such rows of the scores {tuple(logits.shape)}, the "
        f"first at {tuple(rows[0].tolist())} without the softmax's dim {dim}) gets NaN weights, and the "
        "model's own output and the relevance are NaN wherever they reach. No rule can make them finite without "
        "changing the output: run the model in the dtype its softmax computes in (float32), or with an attention "
        "that handles a query without keys (attn_implementation='sdpa' in transformers)",
    )
