"""PAR, ``sum_h ReLU(sum_i c_i^2 - tau)^2`` with ``tau = tau_factor r``, against closed forms.

The one definition the project's trainer (``qkwatch.trainer.model.rank_anchored``) and any other
loop (``qkwatch.raa``) compute; here on heads whose principal cosines are known exactly.
"""

from __future__ import annotations

import math

import pytest
import torch

from qkwatch.agent.metrics import TAU_FACTOR, par_penalty


def heads_with_cosines(cosines: list[list[float]], d_model: int = 16, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """``(H, D, d)`` query and key heads, orthonormal columns, head ``h``'s principal cosines ``cosines[h]``."""
    gen = torch.Generator().manual_seed(seed)
    wq, wk = [], []
    for cs in cosines:
        d = len(cs)
        basis, _ = torch.linalg.qr(torch.randn(d_model, 2 * d, generator=gen, dtype=torch.float64))
        a, b = basis[:, :d], basis[:, d:]  # (D, d) each, orthogonal to each other
        c = torch.tensor(cs, dtype=torch.float64)
        wq.append(a)
        wk.append(a * c + b * (1 - c**2).sqrt())  # column i at angle acos(c_i) from a's column i
    return torch.stack(wq), torch.stack(wk)  # (H, D, d)


def test_tau_is_045_r() -> None:
    assert TAU_FACTOR == 0.45


def test_par_of_known_cosines_is_the_closed_form() -> None:
    cosines = [[1.0, 1.0, 0.6, 0.0], [1.0, 0.8, 0.8, 0.5], [0.3, 0.2, 0.1, 0.0]]
    wq, wk = heads_with_cosines(cosines)
    tau = 0.45 * 4
    expected = sum(max(sum(c * c for c in cs) - tau, 0.0) ** 2 for cs in cosines)  # the third head adds 0
    assert expected == pytest.approx((2.36 - 1.8) ** 2 + (2.53 - 1.8) ** 2)
    assert par_penalty(wq, wk).item() == pytest.approx(expected, rel=1e-9)
    assert par_penalty(wq, wk, tau_factor=0.1).item() == pytest.approx(
        sum(max(sum(c * c for c in cs) - 0.4, 0.0) ** 2 for cs in cosines), rel=1e-9
    )


def test_identical_and_orthogonal_subspaces_are_the_ends_of_the_range() -> None:
    wq, _ = heads_with_cosines([[1.0] * 4] * 3)
    ones = par_penalty(wq, wq * 2.0)  # the same column spaces: every c_i = 1
    assert ones.item() == pytest.approx(3 * ((1 - TAU_FACTOR) * 4) ** 2, rel=1e-9)
    q, k = heads_with_cosines([[0.0] * 4] * 3)
    assert par_penalty(q, k).item() == 0.0


def test_top_r_subspaces_and_grouped_query_heads() -> None:
    """``r = 2`` of scaled columns: the top-2 subspaces; key head ``g`` serves query heads ``2g, 2g + 1``."""
    eye = torch.eye(8, dtype=torch.float64)
    scale = torch.tensor([3.0, 2.0, 1.0, 0.5], dtype=torch.float64)
    kv = torch.stack([eye[:, [0, 1, 2, 3]] * scale, eye[:, [4, 5, 6, 7]] * scale])  # (G=2, D, d)
    # query heads 0, 1 against key head 0 (top-2 span e0, e1); 2, 3 against key head 1 (e4, e5)
    q = torch.stack([eye[:, [0, 1, 4, 5]], eye[:, [0, 6, 1, 7]], eye[:, [4, 0, 1, 2]], eye[:, [6, 7, 0, 1]]]) * scale
    # top-2 overlaps: 2 (e0, e1 both), 1 (e0 and e6), 1 (e4 and e0), 0 (e6, e7): tau = 0.45 * 2 = 0.9
    expected = (2 - 0.9) ** 2 + 2 * (1 - 0.9) ** 2
    assert par_penalty(q, kv, 2).item() == pytest.approx(expected, rel=1e-9)
    assert par_penalty(q, kv, 99).item() == pytest.approx(par_penalty(q, kv, 4).item())  # r is cut to d_head


def test_a_dead_head_adds_nothing() -> None:
    wq, wk = heads_with_cosines([[1.0, 0.9, 0.9, 0.2], [1.0, 1.0, 1.0, 1.0]])
    wq[1] = 0.0  # a dead query head: its subspace does not exist
    assert par_penalty(wq, wk).item() == pytest.approx((2.66 - 1.8) ** 2, rel=1e-9)


def test_float32_and_bfloat16_weights_give_a_float32_penalty() -> None:
    wq, wk = heads_with_cosines([[1.0, 1.0, 0.6, 0.0]])
    assert par_penalty(wq.float(), wk.float()).dtype == torch.float32
    low = par_penalty(wq.bfloat16(), wk.bfloat16())
    assert low.dtype == torch.float32 and math.isclose(low.item(), (2.36 - 1.8) ** 2, rel_tol=0.05)
