"""Draft verification against the math: emitted tokens follow the target distribution exactly."""

from __future__ import annotations

import math

import pytest
import torch

from kvtide.spec_decode.policy import expected_tokens
from kvtide.spec_decode.rejection_sampler import (
    accept_matching,
    expected_acceptance_rate,
    rejection_sample,
)

N = 20000
"""Simulated verification steps per distribution check."""

CHI2_CRITICAL_999 = {1: 10.828, 2: 13.816, 3: 16.266, 4: 18.467, 5: 20.515, 6: 22.458, 7: 24.322, 8: 26.124,
                     9: 27.877, 10: 29.588, 11: 31.264, 12: 32.909, 13: 34.528, 14: 36.123, 15: 37.697}
"""Chi-square quantiles at 1 - 0.001 by degrees of freedom (scipy.stats.chi2.ppf(0.999, dof))."""

LOGITS = torch.tensor([2.0, 1.2, 0.9, 0.3, 0.0, -0.4, -1.0, -2.0])


# ---------------------------------------------------------------------------- helpers

def chi_square(observed: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    """Pearson statistic and degrees of freedom of counts against probabilities. Cells of probability 0
    must be empty; cells expecting under 5 counts are pooled into one."""
    observed, probs = observed.double(), probs.double() / probs.sum()
    assert observed[probs == 0].sum() == 0, f"counts where the probability is 0: {observed.tolist()}"
    expected = probs * observed.sum()
    big, small = expected >= 5, (expected < 5) & (probs > 0)
    obs, exp = observed[big].tolist(), expected[big].tolist()
    if small.any():
        obs.append(float(observed[small].sum()))
        exp.append(float(expected[small].sum()))
    stat = sum((o - e) ** 2 / e for o, e in zip(obs, exp, strict=True))
    return stat, len(obs) - 1


def assert_follows(tokens: torch.Tensor, probs: torch.Tensor) -> None:
    """Token ids are a sample of probs (chi-square, p = 0.001)."""
    counts = torch.bincount(tokens.flatten(), minlength=probs.numel())
    stat, dof = chi_square(counts, probs)
    critical = CHI2_CRITICAL_999[dof]
    assert stat < critical, f"chi2 {stat:.1f} >= {critical} (dof {dof}): {counts.tolist()} against {probs.tolist()}"


def assert_rate(hits: torch.Tensor, rate: float) -> None:
    """Bernoulli outcomes have mean rate, within 5 binomial standard deviations."""
    n = hits.numel()
    sigma = math.sqrt(max(rate * (1 - rate), 1e-12) / n)
    assert abs(hits.double().mean().item() - rate) <= 5 * sigma + 1e-12, (hits.double().mean().item(), rate)


def race(weights: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """Draws from each row of (..., V) weights by exponential race."""
    noise = torch.empty(weights.shape).exponential_(generator=gen)
    return (weights / noise).argmax(dim=-1)


def processed(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """softmax(logits / temperature), restricted to the smallest top set of mass >= top_p and renormalized."""
    probs = (logits / temperature).softmax(dim=-1)
    order = probs.argsort(descending=True)
    mass_before = probs[order].cumsum(dim=0) - probs[order]
    keep = torch.zeros_like(probs, dtype=torch.bool)
    keep[order[mass_before < top_p]] = True
    probs = torch.where(keep, probs, 0.0)
    return probs / probs.sum()


def speculate(p: torch.Tensor, q: torch.Tensor, k: int, seed: int) -> tuple[list[list[int]], torch.Tensor]:
    """N steps of k i.i.d. drafts from q verified against p: the emitted rows and the drafts."""
    gen = torch.Generator().manual_seed(seed)
    vocab = p.numel()
    drafts = torch.multinomial(q.expand(N * k, vocab), 1, replacement=True, generator=gen).view(N, k)
    out = rejection_sample(p.expand(N, k + 1, vocab).contiguous(), q.expand(N, k, vocab).contiguous(), drafts,
                           [k] * N, torch.rand(N, k, generator=gen),
                           torch.empty(N, k + 1, vocab).exponential_(generator=gen))
    return out, drafts


# ---------------------------------------------------------------------------- accept_matching

def test_accept_matching_hand_cases():
    assert accept_matching([[5, 6, 7, 8]], [[5, 6, 7]]) == [[5, 6, 7, 8]]  # all match: k + 1 tokens
    assert accept_matching([[9, 6, 7, 8]], [[5, 6, 7]]) == [[9]]  # first draft wrong: the target's token only
    assert accept_matching([[5, 4, 7, 8]], [[5, 6, 7]]) == [[5, 4]]  # later drafts never rescue a mismatch
    assert accept_matching([[3]], [[]]) == [[3]]  # no drafts: one token
    assert accept_matching([[1, 2], [3], [4, 5, 6]], [[1], [], [0, 5]]) == [[1, 2], [3], [4]]
    assert accept_matching([], []) == []
    with pytest.raises(ValueError):
        accept_matching([[1, 2]], [[1, 2]])


def test_accept_matching_follows_target_distribution():
    p = torch.tensor([0.30, 0.25, 0.20, 0.15, 0.07, 0.03])
    bad_draft, k = 5, 2  # the target's least likely token, drafted at every position
    gen = torch.Generator().manual_seed(0)
    targets = race(p.expand(N, k + 1, p.numel()), gen)
    out = accept_matching(targets.tolist(), [[bad_draft] * k] * N)

    first = torch.tensor([row[0] for row in out])
    assert_follows(first, p)
    assert_rate(torch.tensor([len(row) > 1 for row in out]), p[bad_draft].item())
    second = torch.tensor([row[1] for row in out if len(row) > 1])
    assert_follows(second, p)
    lengths = torch.tensor([len(row) for row in out])
    a = p[bad_draft].item()
    assert_follows(lengths - 1, torch.tensor([1 - a, a * (1 - a), a * a]))
    assert all(row[:-1] == [bad_draft] * (len(row) - 1) for row in out)


# ---------------------------------------------------------------------------- rejection_sample

SETTINGS = [(1.0, 1.0), (0.7, 0.9), (1.5, 0.75)]


@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("temperature,top_p", SETTINGS)
def test_rejection_sample_follows_target_distribution(temperature, top_p, k):
    p = processed(LOGITS, temperature, top_p)
    q = (-LOGITS).softmax(dim=-1)  # mass where p has little, and on tokens top-p removed
    a = torch.minimum(p, q).sum().item()
    assert a < 0.6
    out, drafts = speculate(p, q, k, seed=k * 100 + int(temperature * 10) + int(top_p * 100))

    assert all(row[:-1] == drafts[r, :len(row) - 1].tolist() for r, row in enumerate(out))
    first = torch.tensor([row[0] for row in out])
    assert_follows(first, p)
    assert_follows(drafts[:, 0], q)
    draft_as_p = chi_square(torch.bincount(drafts[:, 0][p[drafts[:, 0]] > 0], minlength=p.numel()), p)
    assert draft_as_p[0] > 10 * CHI2_CRITICAL_999[draft_as_p[1]]  # the test tells q from p
    lengths = torch.tensor([len(row) for row in out])
    assert_rate(lengths > 1, a)

    if k == 3:
        assert_follows(torch.tensor([row[1] for row in out if len(row) > 1]), p)
        theory = torch.tensor([a ** j * (1 - a) for j in range(k)] + [a ** k])
        assert_follows(lengths - 1, theory)
        mean, std = lengths.double().mean().item(), lengths.double().std().item()
        assert abs(mean - sum(a ** j for j in range(k + 1))) < 5 * std / math.sqrt(N)


@pytest.mark.parametrize("k", [1, 3])
def test_rejection_sample_draft_equal_to_target_always_accepts(k):
    p = processed(LOGITS, 0.8, 0.95)
    out, drafts = speculate(p, p, k, seed=7 + k)
    assert all(len(row) == k + 1 for row in out)
    emitted = torch.tensor(out)
    assert torch.equal(emitted[:, :k], drafts)
    assert_follows(emitted[:, 0], p)
    assert_follows(emitted[:, k], p)  # the bonus draw


def test_rejection_sample_without_drafts_draws_from_first_position():
    p0 = torch.tensor([0.1, 0.6, 0.3, 0.0])
    p1 = torch.tensor([0.0, 0.0, 0.0, 1.0])  # must not be used: position 1 is not verified
    target = torch.stack((p0, p1)).expand(N, 2, 4).contiguous()
    gen = torch.Generator().manual_seed(3)
    out = rejection_sample(target, torch.full((N, 1, 4), 0.25), torch.full((N, 1), 3), [0] * N,
                           torch.zeros(N, 1), torch.empty(N, 2, 4).exponential_(generator=gen))
    assert all(len(row) == 1 for row in out)
    assert_follows(torch.tensor(out).flatten(), p0)

    no_positions = rejection_sample(target[:5, :1], torch.empty(5, 0, 4), torch.empty(5, 0, dtype=torch.int64),
                                    [0] * 5, torch.empty(5, 0), torch.ones(5, 1, 4))
    assert no_positions == [[1]] * 5  # K = 0, unit noise: the mode of p0


def test_rejection_sample_mixed_draft_counts_hand_case():
    # Unit noise makes every draw the argmax of its weights, so each outcome follows from the rules alone.
    flat = [0.25] * 4
    target = torch.tensor([
        [[0.1, 0.6, 0.3, 0.0], [1.0, 0.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0]],
        [[0.2, 0.5, 0.3, 0.0], [0.0, 0.1, 0.2, 0.7], [1.0, 0.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0]],
        [[0.2, 0.5, 0.3, 0.0], [0.5, 0.3, 0.2, 0.0], [0.0, 0.0, 1.0, 0.0], [0.0, 0.0, 1.0, 0.0]],
        [[0.2, 0.5, 0.3, 0.0], [0.3, 0.3, 0.4, 0.0], [0.0, 0.9, 0.1, 0.0], [0.0, 0.0, 0.0, 1.0]],
        [[0.15, 0.5, 0.35, 0.0], [1.0, 0.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0]],
    ])
    draft = torch.tensor([
        [flat, flat, flat],
        [[0.0, 1.0, 0.0, 0.0], flat, flat],
        [[0.0, 0.0, 1.0, 0.0], [0.6, 0.0, 0.1, 0.3], flat],
        [[1.0, 0.0, 0.0, 0.0], [0.0, 0.0, 1.0, 0.0], [0.0, 0.0, 1.0, 0.0]],
        [[0.0, 0.9, 0.1, 0.0], flat, flat],
    ])
    draft_ids = torch.tensor([[-1, -1, -1], [1, 2, 0], [2, 3, 2], [0, 2, 2], [1, 0, 0]])
    uniforms = torch.tensor([[0.0] * 3, [0.3, 0.0, 0.0], [0.2, 0.0, 0.0], [0.15, 0.35, 0.0], [0.7, 0.0, 0.0]])
    out = rejection_sample(target, draft, draft_ids, [0, 1, 3, 2, 2], uniforms, torch.ones(5, 4, 4))
    assert out == [
        [1],  # k = 0, padding ids of -1: the mode of p_0
        [1, 3],  # 0.3 * 1.0 < 0.5 accepts; the padding draft would pass too, but the bonus is p_1's mode
        [2, 1],  # 0.2 * 1.0 < 0.3 accepts; p_1(3) = 0 rejects; residual (0, 0.3, 0.1, 0), p_1's mode would be 0
        [0, 2, 1],  # 0.15 < 0.2 and 0.35 < 0.4 accept; bonus from p_2, not p_3 past the padding draft
        [2],  # 0.7 * 0.9 >= 0.5 rejects at once; residual (0.15, 0, 0.25, 0), p_0's mode would be 1
    ]


def test_rejection_sample_draws_with_the_noise_of_its_position():
    flat = torch.full((4,), 0.25)
    target = torch.stack((flat, flat, flat)).expand(2, 3, 4).contiguous()
    draft = torch.tensor([[1.0, 0.0, 0.0, 0.0]] * 2).expand(2, 2, 4).contiguous()
    noise = torch.ones(2, 3, 4)
    for j, token in enumerate((3, 2, 1)):
        noise[:, j, token] = 0.1  # the race at position j is won by this token
    # Row 0 accepts both drafts (bonus at 2); row 1 accepts one and rejects at 1, residual (0, 1/4, 1/4, 1/4).
    out = rejection_sample(target, draft, torch.zeros(2, 2, dtype=torch.int64), [2, 2],
                           torch.tensor([[0.1, 0.2], [0.1, 0.9]]), noise)
    assert out == [[0, 0, 1], [0, 2]]


def test_rejection_sample_residual_all_zero_falls_back_to_target():
    # p == q, and the draft has probability 0 under both: rejected, with nothing left in max(0, p - q).
    p = torch.tensor([0.2, 0.8, 0.0, 0.0])
    gen = torch.Generator().manual_seed(11)
    out = rejection_sample(p.expand(N, 2, 4).contiguous(), p.expand(N, 1, 4).contiguous(), torch.full((N, 1), 2),
                           [1] * N, torch.rand(N, 1, generator=gen),
                           torch.empty(N, 2, 4).exponential_(generator=gen))
    assert all(len(row) == 1 for row in out)
    assert_follows(torch.tensor(out).flatten(), p)


def test_rejection_sample_empty_batch():
    assert rejection_sample(torch.empty(0, 3, 5), torch.empty(0, 2, 5), torch.empty(0, 2, dtype=torch.int64), [],
                            torch.empty(0, 2), torch.empty(0, 3, 5)) == []


# ---------------------------------------------------------------------------- theory

def test_expected_tokens_per_step():
    assert expected_tokens(0.0, 4) == 1.0
    assert expected_tokens(1.0, 4) == 5.0
    assert expected_tokens(1.0, 0) == 1.0
    assert expected_tokens(0.5, 2) == pytest.approx(1.75)  # 1 + 0.5 + 0.25
    assert expected_tokens(0.8, 4) == pytest.approx(1 + 0.8 + 0.64 + 0.512 + 0.4096)
    assert expected_tokens(0.999999, 3) == pytest.approx(4.0, rel=1e-5)  # continuous at a = 1
    with pytest.raises(ValueError):
        expected_tokens(1.5, 2)


def test_expected_acceptance_rate():
    p = torch.tensor([[0.5, 0.5, 0.0], [0.1, 0.2, 0.7]])
    q = torch.tensor([[0.25, 0.25, 0.5], [0.1, 0.2, 0.7]])
    rate = expected_acceptance_rate(p, q)
    assert rate.shape == (2,)
    assert torch.allclose(rate, torch.tensor([0.5, 1.0]))
    stacked = expected_acceptance_rate(p.expand(4, 3, 2, 3), q.expand(4, 3, 2, 3))
    assert stacked.shape == (4, 3, 2)
    assert torch.allclose(stacked, torch.tensor([0.5, 1.0]).expand(4, 3, 2))


def test_chi_square_table():
    chi2 = pytest.importorskip("scipy.stats").chi2
    for dof, critical in CHI2_CRITICAL_999.items():
        assert critical == pytest.approx(chi2.ppf(0.999, dof), abs=1e-3)
