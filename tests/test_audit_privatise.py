"""The mechanism-level audit of releases made with `Releases.privatise` (#44): PDSL's (and
DP-CGA's) one release of k cross-gradients carries the canaries, with a norm of the
release's sensitivity, scale x C; PDSL is audited at its default level and a planted
fault on its path is refuted."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from p4bench.audit import AuditedMechanism, CanaryBank, release_scores, run_audit
from p4bench.audit.canaries import privatised_norm
from p4bench.cli import main
from p4bench.privacy.concatenated import noise_scale
from p4bench.privacy.mechanism import DPMechanism, DPSettings
from p4bench.privacy.noise import NoiseStreams
from p4bench.privacy.releases import Releases
from p4bench.testing.audit_faults import NO_CLIP, unclipped


class TenthScaledNoise(DPMechanism):
    """A faulty mechanism, for tests only: `add_scaled_noise` adds a tenth of the noise asked for."""

    def add_scaled_noise(self, targets, scale):
        super().add_scaled_noise(
            targets,
            torch.full((len(next(iter(targets.values()))),), 0.1) if scale is None else scale * 0.1,
        )

    def take(self, positions):
        return TenthScaledNoise(
            self.settings, self.noise.take(positions), self.report, self.allowed
        )


def tenth_scaled_noise(mechanism: DPMechanism) -> DPMechanism:
    return TenthScaledNoise(
        mechanism.settings, mechanism.noise, mechanism.report, mechanism.allowed
    )


# -- the release ------------------------------------------------------------------------------
@pytest.mark.parametrize("neighbouring", ["add-remove", "replace-one"])
def test_privatise_carries_canaries_of_the_release_sensitivity_and_observes_noise_plus_canaries(
    neighbouring,
):
    settings = DPSettings(clip=1.5, noise_multiplier=0.8, neighbouring=neighbouring)
    rows = torch.tensor([0, 1, 2])
    bank = CanaryBank(num_clients=3, per_client=None, seed=5)
    ctx = SimpleNamespace(rows=rows, phase="train")
    allowed = lambda clients, rate, phase: clients != 2  # noqa: E731  client 2's budget is spent
    reported = []
    audited = AuditedMechanism(
        DPMechanism(settings, NoiseStreams(9, rows.tolist()), reported.append, allowed), bank
    )
    sums = {"g": torch.randn(3, 12)}  # 3 slots x 4 parameters, as cross_gradients flattens them
    clean = sums["g"].clone()
    scale = torch.tensor([1.0, 2.0, math.sqrt(3.0)], dtype=torch.float64)  # sqrt(k) for k = 1, 4, 3
    with Releases(audited, ctx, 0.5) as releases:
        out = releases.privatise(sums, scale)
    assert out is sums and reported[0].clients == (0, 1) and not bank.bypassed
    assert bank.per_client == 12 and bank.releases.tolist() == [1, 1, 0]
    # the same draws without canaries: what is left is the canaries, of norm scale x C
    noise = (
        NoiseStreams(9, rows.tolist()).normal_parts([(12,)])[0]
        * settings.noise_std
        * scale.float()[:, None]
    )
    canary = sums["g"] - clean - noise
    coefficients = (
        canary @ bank.directions.T / (settings.clip * scale.float()[:, None])
    )  # 0, or +-1 when sampled
    assert torch.allclose(coefficients, coefficients.round(), atol=1e-4)
    signs = bank.included.float() if neighbouring == "add-remove" else bank.included.float() * 2 - 1
    assert bool(((coefficients.round() == 0) | (coefficients.round() == signs)).all())
    assert bool((coefficients.round() != 0).any())
    # scored in units of the row's noise std (scale x noise_std): the shift is C / noise_std, as in `release`
    x = (
        noise[:2] / scale.float()[:2, None] @ bank.directions.T
        + coefficients[:2].round() * settings.clip
    ) / settings.noise_std
    expected = release_scores(x, 0.5, settings.clip / settings.noise_std, neighbouring).numpy()
    assert bank.scores[:2].numpy() == pytest.approx(expected, abs=1e-4)
    assert float(bank.scores[2].abs().sum()) == 0.0


@pytest.mark.parametrize("neighbouring", ["add-remove", "replace-one"])
def test_the_canary_norm_is_the_sensitivity_and_never_more_than_a_clipped_release_can_move(
    neighbouring,
):
    degree = torch.tensor([1.0, 4.0, 9.0], dtype=torch.float64)
    honest = DPSettings(clip=1.5, noise_multiplier=0.8, neighbouring=neighbouring)
    for mode in ("per-example", "batch"):
        factor = noise_scale(honest, mode, degree)
        assert torch.allclose(privatised_norm(honest, factor), factor * honest.clip)
    # batch clipping: 2C per model under add-remove (the sensitivity the accountant charges), +-C under replace-one
    per_model = 2.0 if neighbouring == "add-remove" else 1.0
    batch = privatised_norm(honest, noise_scale(honest, "batch", degree))
    assert torch.allclose(batch, per_model * degree.sqrt() * honest.clip)
    # clipping removed (noise for the claimed C): per-example clipping leaks (a record's clipped value is 1e12), batch
    # clipping reads the clip into its noise (2 C sigma sqrt(k)), so its canaries stay at mu = 1 / sigma:
    # nothing to show
    faulty = unclipped(DPMechanism(honest, NoiseStreams(0, [0]), print, print)).settings
    leaky = privatised_norm(faulty, noise_scale(faulty, "per-example", degree))
    assert torch.allclose(leaky, torch.full((3,), NO_CLIP, dtype=torch.float64))
    factor = noise_scale(faulty, "batch", degree)
    mu = privatised_norm(faulty, factor) / (factor * faulty.noise_std)
    assert torch.allclose(mu, torch.full((3,), honest.clip / honest.noise_std, dtype=torch.float64))


# -- PDSL on digits -------------------------------------------------------------------------------
def _pdsl(small_config, **changes):
    options = {"R": 2, **changes.pop("options", {})}
    return small_config(method="pdsl", clients=6, epsilon=4.0, options=options, **changes)


def test_pdsl_is_audited_at_the_mechanism_level_and_stays_below_its_claim(small_config):
    """Before: refused (its noise went through `add_scaled_noise`, around the canaries)."""
    result = run_audit(_pdsl(small_config), track=False)
    assert (
        result.canaries_per_client == 1024 and result.bound.trials == 6 * 1024
    )  # of 6 slots x 650 parameters
    assert result.bound.ceiling > result.claimed_epsilon == pytest.approx(4.0, abs=0.05)
    assert (
        result.verdict == "consistent" and 0.0 < result.bound.epsilon_lower < result.claimed_epsilon
    ), result.line()


def test_a_fault_on_pdsl_path_is_refuted(small_config):
    """A tenth of the noise, on PDSL's default batch clipping; clipping removed under per-example
    clipping (where the noise does not follow the clip, so the fault applies; 20 releases at
    rate 0.5 miss an in-canary with probability 1e-6)."""
    quiet = run_audit(_pdsl(small_config), wrap_mechanism=tenth_scaled_noise, track=False)
    assert quiet.verdict == "refuted" and quiet.bound.epsilon_lower > quiet.claimed_epsilon, (
        quiet.line()
    )
    leaky = run_audit(
        _pdsl(small_config, rounds=20, data_rate=0.5, options={"clip_mode": "per-example"}),
        wrap_mechanism=unclipped,
        track=False,
    )
    assert leaky.verdict == "refuted" and leaky.separated, leaky.line()


def test_clipping_removed_cannot_apply_to_pdsl_batch_clipping(small_config):
    """PDSL's batch noise is 2 C sigma sqrt(k) with the clip in force: at clip 1e12 the noise
    grows with it, and the release is as private as claimed."""
    result = run_audit(_pdsl(small_config), wrap_mechanism=unclipped, track=False)
    assert result.verdict == "consistent" and result.bound.epsilon_lower < result.claimed_epsilon, (
        result.line()
    )


def test_cli_audits_pdsl(capsys, results_dir):
    with pytest.raises(SystemExit) as info:
        main(
            [
                "audit",
                "--method",
                "pdsl",
                "--epsilon",
                "4",
                "--clients",
                "6",
                "--rounds",
                "2",
                "-o",
                "R=2",
                "--results-dir",
                results_dir,
            ]
        )
    out, err = capsys.readouterr()
    assert (info.value.code or 0) == 0, err
    line = out.strip().splitlines()[-1]
    assert (
        line.startswith("audit pdsl on digits (mechanism-level")
        and " on 6144 canaries in 1 run; " in line
    )
    assert ": consistent: the lower bound " in line
