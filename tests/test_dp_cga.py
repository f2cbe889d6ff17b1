"""dp-cga (Esfandiari et al.'s CGA with DP cross-gradients): the batched QP against scipy's
NNLS, private and non-private runs on ring and complete graphs with their ledger, and
the conformance kit."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch
from scipy.optimize import nnls

from p4bench import hookimpl
from p4bench.privacy.accountants import RDPAccountant, ReleaseSegment, accounted_epsilon
from p4bench.run.runner import run
from p4bench.testing import check_method
from p4bench_baselines.dp_cga import cone_projection, segments_of, solve_cone_qp

EXACT = {"iterations": 20_000, "tolerance": 1e-12}


def _reference(
    anchor: np.ndarray, rows: np.ndarray, mask: np.ndarray, margin: float
) -> tuple[np.ndarray, np.ndarray]:
    """(v, lambda) of one instance: lambda = margin + mu, mu = NNLS(R^T, -(a + margin R^T 1))."""
    active = np.flatnonzero(mask)
    lam = np.zeros(len(mask))
    if len(active):
        basis = rows[active].T  # (P, k)
        mu, _ = nnls(basis, -(anchor + margin * basis.sum(1)), maxiter=10_000)
        lam[active] = margin + mu
    return anchor + lam @ rows, lam


def _instances(
    seed: int, count: int = 8, slots: int = 5, size: int = 12
) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    anchor = torch.randn(count, size, generator=gen, dtype=torch.float64)
    rows = torch.randn(count, slots, size, generator=gen, dtype=torch.float64)
    mask = torch.rand(count, slots, generator=gen) < 0.7
    mask[0] = False  # an agent without neighbours: v = anchor
    mask[1] = True
    return anchor, rows, mask


@pytest.mark.parametrize("margin", [0.0, 0.5])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_batched_qp_matches_nnls_with_padded_slots(seed, margin):
    anchor, rows, mask = _instances(seed)
    v, lam, residual = cone_projection(anchor, rows, mask, margin=margin, **EXACT)
    assert lam.shape == (8, 1, 5) and bool((residual <= 1e-9).all())
    for b in range(len(anchor)):
        v_ref, lam_ref = _reference(anchor[b].numpy(), rows[b].numpy(), mask[b].numpy(), margin)
        np.testing.assert_allclose(v[b].numpy(), v_ref, atol=1e-7)
        np.testing.assert_allclose(lam[b, 0].numpy(), lam_ref, atol=1e-6)
    assert bool((lam[:, 0][~mask] == 0).all()) and bool((lam[:, 0][mask] >= margin).all())
    assert torch.equal(v[0], anchor[0])


def test_no_conflict_leaves_the_anchor_unchanged():
    anchor, rows, mask = _instances(3)
    # rows pushed towards the anchor: every <anchor, r_j> > 0, so the anchor is already feasible
    rows = rows + 4 * anchor.unsqueeze(1) * rows.norm(dim=2, keepdim=True) / anchor.norm(
        dim=1
    ).view(-1, 1, 1)
    assert bool((torch.einsum("bp,bkp->bk", anchor, rows) > 0).all())
    v, lam, _ = cone_projection(anchor, rows, mask, margin=0.0)
    assert torch.equal(v, anchor) and bool((lam == 0).all())


def test_conflicts_are_removed_and_padding_is_ignored():
    anchor, rows, mask = _instances(4)
    rows = rows - 4 * anchor.unsqueeze(1) * rows.norm(dim=2, keepdim=True) / anchor.norm(
        dim=1
    ).view(-1, 1, 1)
    v, lam, _ = cone_projection(anchor, rows, mask, margin=0.0, **EXACT)
    assert bool((torch.einsum("bp,bkp->bk", anchor, rows)[mask] < 0).all()) and bool(
        (lam[:, 0][mask] > 0).any()
    )
    inner = torch.einsum("bp,bkp->bk", v, rows)
    scale = rows.norm(dim=2) * anchor.norm(dim=1, keepdim=True)
    assert bool((inner[mask] >= -1e-9 * scale[mask]).all())  # no update against a neighbour's data
    assert bool(
        (lam[:, 0][mask] * inner[mask]).abs().max() <= 1e-8 * scale.max()
    )  # complementary slackness
    # a padded slot holding a conflicting row changes nothing
    dropped = rows * mask.unsqueeze(2)
    v_dropped, _, _ = cone_projection(anchor, dropped, mask, margin=0.0, **EXACT)
    torch.testing.assert_close(v, v_dropped)


def test_each_item_is_solved_independently_of_the_batch():
    anchor, rows, mask = _instances(5)
    gram, linear = torch.bmm(rows, rows.transpose(1, 2)), torch.einsum("bkp,bp->bk", rows, anchor)
    lam, _ = solve_cone_qp(gram, linear, mask, 0.5, 300, 1e-6)
    for b in (1, 4):
        alone, _ = solve_cone_qp(
            gram[b : b + 1], linear[b : b + 1], mask[b : b + 1], 0.5, 300, 1e-6
        )
        torch.testing.assert_close(alone[0], lam[b], rtol=0, atol=1e-12)


def test_per_layer_scope_solves_each_parameter_tensor_apart():
    like = {"b": torch.zeros(1, 3), "w": torch.zeros(1, 3, 3)}
    segments = segments_of(like, "layer")
    assert segments == [(0, 3), (3, 12)] and segments_of(like, "model") == [(0, 12)]
    anchor, rows, mask = _instances(6)
    v, lam, _ = cone_projection(anchor, rows, mask, segments, margin=0.5, **EXACT)
    for s, (a, b) in enumerate(segments):
        part, part_lam, _ = cone_projection(
            anchor[:, a:b], rows[:, :, a:b], mask, margin=0.5, **EXACT
        )
        torch.testing.assert_close(v[:, a:b], part)
        torch.testing.assert_close(lam[:, s], part_lam[:, 0])


# -- runs -------------------------------------------------------------------------------------------
class ReleaseSpy:
    """Observer: the clients of every release, per round."""

    def __init__(self) -> None:
        self.round, self.counts = 0, Counter()

    @hookimpl
    def privacy_release(self, run, release):
        for client in release.clients:
            self.counts[(self.round, client)] += release.steps

    @hookimpl
    def round_finished(self, run, report):
        self.round += 1


@pytest.mark.parametrize("topology", ["ring", "complete"])
@pytest.mark.parametrize("private", [True, False], ids=["dp", "no-dp"])
def test_runs_on_digits_with_one_release_per_agent_and_round(
    verify_full, small_config, topology, private
):
    clients, rounds = 6, 3
    privacy = {"epsilon": 4.0, "accountant": "rdp"} if private else {"no_dp": True}
    config = small_config(
        method="dp-cga", clients=clients, rounds=rounds, options={"topology": topology}, **privacy
    )
    spy = ReleaseSpy()
    result = run(config, observers=[spy], track=False)
    s = result.summary
    assert 0.0 <= s["accuracy_mean"] <= 1.0 and s["rounds_completed"] == rounds
    if not private:
        assert not s["private"] and s["epsilon"] is None and not spy.counts
        return
    assert s["epsilon_certified"] and s["epsilon"] <= 4.0 + 0.05 and s["clients_stopped"] == 0
    assert s["receivers_per_release"] == (2 if topology == "ring" else clients - 1)
    assert spy.counts == Counter({(t, c): 1 for t in range(rounds) for c in range(clients)})
    # batch clipping: one Gaussian release per round at rate 1, composed over the rounds
    expected = accounted_epsilon(
        RDPAccountant(),
        [ReleaseSegment(s["noise_multiplier"], 1.0, rounds)],
        s["delta"],
        s["neighbouring"],
    )
    assert s["epsilon"] == pytest.approx(expected)


def test_per_example_clipping_is_accounted_at_the_sampling_rate(small_config):
    config = small_config(
        method="dp-cga",
        clients=6,
        rounds=2,
        epsilon=4.0,
        accountant="rdp",
        options={"clip_mode": "per-example", "order": "atc"},
    )
    s = run(config, track=False).summary
    history = [ReleaseSegment(s["noise_multiplier"], config.data_rate, 2)]
    assert s["epsilon"] == pytest.approx(
        accounted_epsilon(RDPAccountant(), history, s["delta"], s["neighbouring"])
    )


@pytest.mark.usefixtures("fresh_registry")
def test_dp_cga_conforms():
    # CGA's combine-then-adapt (the default) ends every round on a local noisy step that is
    # not mixed: over the kit's 2 rounds that step is as large as the distance moved (the
    # models agree within 0.5 of it from about 6 rounds on), hence the wider tolerance
    check_method("dp-cga", consensus_tolerance=1.5)
    check_method("dp-cga", options={"order": "atc", "qp_scope": "model", "margin": 0.0})
