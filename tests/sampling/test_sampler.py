"""Sampler against NumPy references: masks, penalties, logprobs, seeded draws, distribution."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from kvtide.sampling.metadata import RowState, SamplingMetadata
from kvtide.sampling.ops import ARGMAX_BLOCK, apply_min_p, apply_penalties, apply_top_k_top_p, argmax_first
from kvtide.sampling.sampler import Sampler
from kvtide.sampling_params import SamplingParams

V = 64


def row(prompt=(5, 6), output=(), stop_ids=(), **params) -> RowState:
    p = SamplingParams(**params)
    p.all_stop_token_ids = set(stop_ids) | set(p.stop_token_ids or [])
    return RowState(p, list(prompt), list(output))


def sample(rows: list[RowState], logits: torch.Tensor, seed: int = 0):
    md = SamplingMetadata.build(rows, logits.shape[-1])
    return Sampler(seed)(logits.clone(), md)


# ---------------------------------------------------------------------------- NumPy references

def np_softmax(x: np.ndarray) -> np.ndarray:
    x = x - x.max()
    e = np.exp(x)
    return e / e.sum()


def np_log_softmax(x: np.ndarray) -> np.ndarray:
    m = x.max()
    return x - m - np.log(np.exp(x - m).sum())


def ref_top_k(x: np.ndarray, k: int) -> np.ndarray:
    """Keep the k largest (ties with the k-th kept too); k <= 0 or >= V keeps all."""
    if k <= 0 or k >= x.size:
        return np.ones(x.size, dtype=bool)
    kth = np.sort(x)[::-1][k - 1]
    return x >= kth


def ref_top_p(x: np.ndarray, keep: np.ndarray, p: float) -> tuple[np.ndarray, np.ndarray]:
    """Nucleus over the tokens in `keep`: the smallest most-likely-first prefix whose mass reaches p.
    Returns (kept mask, ambiguous mask): ambiguous tokens sit within rounding of the boundary."""
    if p >= 1.0:
        return keep, np.zeros(x.size, dtype=bool)
    masked = np.where(keep, x, -np.inf)
    probs = np_softmax(masked)
    order = np.argsort(-masked, kind="stable")
    ahead = np.concatenate([[0.0], np.cumsum(probs[order])[:-1]])  # mass strictly ahead of each
    kept_sorted = ahead < p
    kept_sorted[0] = True
    kept = np.zeros(x.size, dtype=bool)
    kept[order] = kept_sorted
    ambiguous = np.zeros(x.size, dtype=bool)
    ambiguous[order] = np.abs(ahead - p) < 1e-5
    return kept & keep, ambiguous


def ref_penalties(x: np.ndarray, r: RowState) -> np.ndarray:
    p = r.params
    x = x.astype(np.float64).copy()
    for t, b in (p.logit_bias or {}).items():
        if t < x.size:
            x[t] += b
    if len(r.output_token_ids) < p.min_tokens:
        for t in p.all_stop_token_ids:
            if t < x.size:
                x[t] = -np.inf
    seen = set(r.prompt_token_ids) | set(r.output_token_ids)
    for t in seen:
        if x[t] > 0:
            x[t] /= p.repetition_penalty
        else:
            x[t] *= p.repetition_penalty
    counts = np.bincount(np.array(r.output_token_ids, dtype=np.int64), minlength=x.size)[:x.size]
    x -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0)
    return x


# ---------------------------------------------------------------------------- masks

@pytest.mark.parametrize("vocab", [1, 7, ARGMAX_BLOCK - 1, ARGMAX_BLOCK, 2 * ARGMAX_BLOCK,
                                   2 * ARGMAX_BLOCK + 1, 5 * ARGMAX_BLOCK - 3, 32000])
def test_argmax_first_matches_numpy_first_max(vocab):
    """The blocked CPU argmax against np.argmax (first maximum), on rows full of ties, -inf, NaN."""
    gen = torch.Generator().manual_seed(vocab)
    x = torch.randint(-4, 4, (9, vocab), generator=gen).float()  # few values: ties everywhere
    x[1] = float("-inf")
    x[2, -1] = 10.0  # the maximum in the last column (a short last block)
    x[3, x[3] < 3] = float("-inf")
    x[4, vocab // 2] = float("nan")  # NaN wins, as in np.argmax
    x[5] = torch.randn(vocab, generator=gen)  # one clear maximum
    expected = np.argmax(x.numpy(), axis=-1)
    assert argmax_first(x).tolist() == expected.tolist()


def test_top_k_top_p_masks_match_numpy_reference():
    rng = np.random.default_rng(0)
    num_rows = 200
    logits = rng.normal(0.0, 3.0, size=(num_rows, V)).astype(np.float32)
    ks = rng.integers(-1, V + 5, size=num_rows)  # includes disabled (-1/0) and k > V
    ps = rng.uniform(0.05, 1.0, size=num_rows)
    ps[::7] = 1.0
    top_k = torch.tensor([k if k > 0 else V for k in ks], dtype=torch.int64)
    top_p = torch.tensor(ps, dtype=torch.float32)
    for use_k, use_p in ((True, False), (False, True), (True, True)):
        out = apply_top_k_top_p(torch.from_numpy(logits), top_k if use_k else None,
                                top_p if use_p else None).numpy()
        num_ambiguous = 0
        for i in range(num_rows):
            keep = ref_top_k(logits[i], int(ks[i])) if use_k else np.ones(V, dtype=bool)
            ambiguous = np.zeros(V, dtype=bool)
            if use_p:
                keep, ambiguous = ref_top_p(logits[i], keep, float(np.float32(ps[i])))
            got = np.isfinite(out[i])
            num_ambiguous += int(ambiguous.sum())
            assert (got == keep)[~ambiguous].all(), (i, ks[i], ps[i], np.nonzero(got != keep))
            np.testing.assert_array_equal(out[i][got], logits[i][got])  # survivors unchanged
            assert got[np.argmax(logits[i])]  # the most likely token always survives
        assert num_ambiguous <= 2


def test_min_p_matches_numpy_reference():
    rng = np.random.default_rng(1)
    probs = rng.dirichlet(np.full(V, 0.3), size=100).astype(np.float32)
    min_p = rng.uniform(0.0, 1.0, size=100).astype(np.float32)
    min_p[:5] = 0.0
    min_p[5:10] = 1.0
    out = apply_min_p(torch.from_numpy(probs), torch.from_numpy(min_p)).numpy()
    for i in range(100):
        keep = probs[i] >= probs[i].max() * min_p[i]
        np.testing.assert_array_equal(out[i], np.where(keep, probs[i], 0.0))
        assert out[i].max() > 0


def test_sampled_tokens_stay_inside_reference_support():
    """Through the whole sampler: every draw is in top_k ∩ top_p ∩ min_p of softmax(logits / T)."""
    rng = np.random.default_rng(2)
    num_rows = 40
    logits = rng.normal(0.0, 2.0, size=(num_rows, V)).astype(np.float32)
    configs = [dict(temperature=float(rng.uniform(0.3, 1.5)), top_k=int(rng.choice([-1, *range(1, 12)])),
                    top_p=float(rng.uniform(0.3, 1.0)), min_p=float(rng.choice([0.0, 0.05, 0.3])))
               for _ in range(num_rows)]
    allowed = []
    for i, c in enumerate(configs):
        x = logits[i].astype(np.float64) / np.float32(c["temperature"])
        keep = ref_top_k(x, c["top_k"])
        keep, _ = ref_top_p(x, keep, c["top_p"])
        probs = np_softmax(np.where(keep, x, -np.inf))
        keep &= probs >= probs.max() * c["min_p"] * (1 - 1e-5)
        allowed.append(keep)
    rows = [row(**c) for c in configs]
    seen = [set() for _ in range(num_rows)]
    for step in range(30):
        out = sample(rows, torch.from_numpy(logits), seed=step)
        assert out.bad_rows == []
        for i, t in enumerate(out.token_ids):
            assert allowed[i][t], (i, configs[i], t)
            seen[i].add(t)
    # rows that keep exactly one token always draw it
    for i in range(num_rows):
        if allowed[i].sum() == 1:
            assert seen[i] == {int(np.argmax(allowed[i]))}


# ---------------------------------------------------------------------------- seeded draws

def _mixed_batch(target: RowState, position: int, size: int) -> list[RowState]:
    rng = np.random.default_rng(position + 100 * size)
    rows = []
    for j in range(size - 1):
        kind = j % 4
        if kind == 0:
            rows.append(row(temperature=0.0))
        elif kind == 1:
            rows.append(row(temperature=0.8, top_k=5, seed=int(rng.integers(1000))))
        elif kind == 2:
            rows.append(row(temperature=1.3, top_p=0.7, min_p=0.1, repetition_penalty=1.3,
                            output=[1, 2, 3]))
        else:
            rows.append(row(temperature=0.5, presence_penalty=0.5, logit_bias={3: 5.0}))
    rows.insert(position, target)
    return rows


@pytest.mark.parametrize("params", [dict(temperature=1.0), dict(temperature=0.7, top_k=10),
                                    dict(temperature=1.2, top_p=0.9, min_p=0.02)])
def test_seeded_draw_does_not_depend_on_batch(params):
    rng = np.random.default_rng(3)
    target_logits = torch.from_numpy(rng.normal(0, 1.0, size=V).astype(np.float32))
    for output_len in (0, 1, 7):
        target = row(seed=1234, output=list(range(output_len)), **params)
        alone = sample([target], target_logits[None], seed=0).token_ids[0]
        for position, size in ((7, 20), (0, 3), (2, 3), (15, 16)):
            batch = _mixed_batch(target, position, size)
            logits = torch.from_numpy(rng.normal(0, 1.0, size=(size, V)).astype(np.float32))
            logits[position] = target_logits
            for sampler_seed in (0, 99):
                assert sample(batch, logits, seed=sampler_seed).token_ids[position] == alone


def test_seed_and_position_change_the_draw():
    """Different seeds / output positions give different streams (not a constant token)."""
    logits = torch.zeros(1, V)
    draws_by_seed = {sample([row(seed=s)], logits).token_ids[0] for s in range(40)}
    draws_by_position = {sample([row(seed=5, output=[0] * n)], logits).token_ids[0] for n in range(40)}
    assert len(draws_by_seed) > 10 and len(draws_by_position) > 10


def test_unseeded_rows_follow_the_sampler_seed():
    logits = torch.zeros(8, V)
    rows = [row() for _ in range(8)]
    assert sample(rows, logits, seed=1).token_ids == sample(rows, logits, seed=1).token_ids
    assert sample(rows, logits, seed=1).token_ids != sample(rows, logits, seed=2).token_ids


def test_greedy_rows_unaffected_by_random_rows():
    rng = np.random.default_rng(4)
    logits = torch.from_numpy(rng.normal(0, 1.0, size=(20, V)).astype(np.float32))
    greedy_rows = [0, 5, 11, 19]
    rows = [row(temperature=0.0) if i in greedy_rows else
            row(temperature=2.0, top_k=3, seed=i if i % 2 else None) for i in range(20)]
    for seed in range(5):
        out = sample(rows, logits, seed=seed)
        for i in greedy_rows:
            assert out.token_ids[i] == int(logits[i].argmax())
    alone = sample([rows[5]], logits[5:6]).token_ids[0]
    assert alone == int(logits[5].argmax())


# ---------------------------------------------------------------------------- distribution

def chi2_sf(x: float, df: int) -> float:
    """P(X > x) for X ~ chi-square(df): 1 - P(df/2, x/2), the regularized lower incomplete gamma
    by its power series, summed in log space so that large x does not overflow."""
    s, z = df / 2.0, x / 2.0
    if z <= 0:
        return 1.0
    log_terms = [-math.log(s)]
    n = 1
    while n < 10 * (z + 10) and (n < z or log_terms[-1] - log_terms[0] > -40):
        log_terms.append(log_terms[-1] + math.log(z / (s + n)))
        n += 1
    peak = max(log_terms)
    log_total = peak + math.log(sum(math.exp(t - peak) for t in log_terms))
    lower = math.exp(s * math.log(z) - z - math.lgamma(s) + log_total)
    return min(1.0, max(0.0, 1.0 - lower))


def test_chi2_sf_against_known_quantiles():
    # Tabulated upper quantiles (e.g. NIST/SEMATECH handbook table 1.3.6.7.4).
    assert chi2_sf(14.067, 7) == pytest.approx(0.05, abs=2e-4)
    assert chi2_sf(24.322, 7) == pytest.approx(0.001, abs=2e-5)
    assert chi2_sf(3.841, 1) == pytest.approx(0.05, abs=2e-4)
    assert chi2_sf(2.0, 2) == pytest.approx(math.exp(-1.0), rel=1e-9)  # df=2: sf = exp(-x/2)
    assert chi2_sf(5000.0, 7) < 1e-9 and chi2_sf(0.0, 7) == 1.0  # 0 up to rounding


@pytest.mark.parametrize("temperature,columns", [
    (0.7, None), (1.0, None), (1.6, None),
    (1.0, [3, ARGMAX_BLOCK - 1, ARGMAX_BLOCK, 700, 701, 2 * ARGMAX_BLOCK + 9, 1033, 1034]),  # across blocks
])
def test_temperature_sampling_matches_softmax(temperature, columns):
    """Chi-square goodness of fit of N draws over an 8-token vocabulary (or 8 tokens spread over a
    vocabulary of 1035, the rest 1e4 lower). With a fixed seed the test is deterministic; the
    threshold is the 0.1% upper quantile of chi-square(7) (24.32), so a correct sampler fails for 1
    seed in 1000, and the wrong-temperature check below shows the test has power at this N."""
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -0.5, -1.0, 1.5, -2.0]])
    num_draws = 20000
    rows = [row(temperature=temperature)] * num_draws
    if columns is None:
        tokens = sample(rows, logits.expand(num_draws, -1).contiguous(), seed=12345).token_ids
    else:
        wide = torch.full((1, columns[-1] + 1), -1e4)  # probability exactly 0 in float32
        wide[0, columns] = logits[0]
        drawn = sample(rows, wide.expand(num_draws, -1).contiguous(), seed=12345).token_ids
        assert set(drawn) <= set(columns)
        tokens = [columns.index(t) for t in drawn]
    observed = np.bincount(tokens, minlength=8).astype(np.float64)
    expected = np_softmax(logits[0].double().numpy() / temperature) * num_draws
    assert expected.min() >= 5  # the chi-square approximation holds
    stat = float(((observed - expected) ** 2 / expected).sum())
    assert chi2_sf(stat, df=7) > 1e-3, (stat, observed, expected)
    wrong = np_softmax(logits[0].double().numpy() / (temperature * 1.15)) * num_draws
    wrong_stat = float(((observed - wrong) ** 2 / wrong).sum())
    assert chi2_sf(wrong_stat, df=7) < 1e-3, wrong_stat


def test_seeded_rows_are_distributed_like_softmax():
    """Across many seeds, one seeded position is a fair draw too."""
    logits = torch.tensor([[1.0, 0.0, -1.0, 2.0, 0.5, -0.5, 0.2, -2.0]])
    num_draws = 4000
    rows = [row(temperature=1.0, seed=s) for s in range(num_draws)]
    tokens = sample(rows, logits.expand(num_draws, -1).contiguous()).token_ids
    observed = np.bincount(tokens, minlength=8).astype(np.float64)
    expected = np_softmax(logits[0].double().numpy()) * num_draws
    stat = float(((observed - expected) ** 2 / expected).sum())
    assert chi2_sf(stat, df=7) > 1e-3, (stat, observed, expected)


# ---------------------------------------------------------------------------- penalties

def test_penalties_and_logit_bias_match_numpy_reference():
    rng = np.random.default_rng(5)
    rows = []
    for i in range(30):
        prompt = rng.integers(0, V, size=int(rng.integers(1, 20))).tolist()
        output = rng.integers(0, V, size=int(rng.integers(0, 20))).tolist()
        bias = {int(t): float(rng.uniform(-100, 100)) for t in rng.integers(0, V, size=3)} if i % 3 else None
        rows.append(row(prompt=prompt, output=output, stop_ids=[1, 7], logit_bias=bias,
                        min_tokens=int(rng.integers(0, 25)),
                        repetition_penalty=float(rng.choice([1.0, rng.uniform(0.5, 2.0)])),
                        presence_penalty=float(rng.uniform(-2, 2)) if i % 2 else 0.0,
                        frequency_penalty=float(rng.uniform(-2, 2)) if i % 4 else 0.0,
                        max_tokens=None))
    logits = rng.normal(0, 3.0, size=(30, V)).astype(np.float32)
    md = SamplingMetadata.build(rows, V)
    assert md.needs_processing
    out = apply_penalties(torch.from_numpy(logits), md).numpy()
    for i, r in enumerate(rows):
        np.testing.assert_allclose(out[i], ref_penalties(logits[i], r), rtol=1e-5, atol=1e-4)


def test_penalties_leave_untouched_rows_exact():
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(0))
    rows = [row(output=[1, 2]), row(repetition_penalty=1.5, output=[3]), row(output=[4])]
    out = apply_penalties(logits, SamplingMetadata.build(rows, V))
    assert torch.equal(out[0], logits[0]) and torch.equal(out[2], logits[2])
    assert not torch.equal(out[1], logits[1])


def test_logit_bias_steers_greedy_choice():
    logits = torch.zeros(2, V)
    logits[:, 3] = 5.0
    out = sample([row(temperature=0.0, logit_bias={9: 10.0}), row(temperature=0.0)], logits)
    assert out.token_ids == [9, 3]


def test_min_tokens_masks_eos_and_stop_ids():
    logits = torch.zeros(1, V)
    logits[0, 1] = 10.0  # EOS
    logits[0, 7] = 9.0  # a stop token id
    logits[0, 4] = 1.0
    for n_out, expected in ((0, 4), (2, 4), (3, 1), (5, 1)):
        r = row(temperature=0.0, min_tokens=3, stop_ids=[1], stop_token_ids=[7], output=[9] * n_out)
        md = SamplingMetadata.build([r], V)
        processed = apply_penalties(logits, md) if md.needs_processing else logits
        assert sample([r], logits).token_ids == [expected]
        masked = bool(torch.isneginf(processed[0, 1])) and bool(torch.isneginf(processed[0, 7]))
        assert masked == (n_out < 3)
    # random rows too: EOS is never drawn while masked
    rows = [row(temperature=1.0, min_tokens=2, stop_ids=[1], stop_token_ids=[7]) for _ in range(200)]
    tokens = sample(rows, logits.expand(200, -1).contiguous()).token_ids
    assert 1 not in tokens and 7 not in tokens


# ---------------------------------------------------------------------------- logprobs

@pytest.mark.parametrize("k", [0, 1, 5, 20])
def test_logprobs_match_log_softmax(k):
    rng = np.random.default_rng(6)
    logits = rng.normal(0, 2.0, size=(6, V)).astype(np.float32)
    rows = [row(temperature=0.0, logprobs=k), row(temperature=1.0, logprobs=k, seed=3), row(),
            row(temperature=0.9, logprobs=k, repetition_penalty=1.5, output=[1, 2]),
            row(temperature=0.0, logprobs=k, logit_bias={int(np.argmin(logits[4])): 100.0}),
            row(temperature=1.0, logprobs=k)]
    out = sample(rows, torch.from_numpy(logits))
    assert out.logprobs[2] is None
    for i in (0, 1, 3, 4, 5):
        ref = np_log_softmax(logits[i].astype(np.float64))
        lp = out.logprobs[i]
        t = out.token_ids[i]
        assert lp.token_logprob == pytest.approx(ref[t], abs=1e-5)
        assert lp.token_rank == 1 + int((ref > ref[t]).sum())
        order = np.argsort(-ref, kind="stable")[:k]
        assert lp.top_ids == order.tolist()
        np.testing.assert_allclose(lp.top_logprobs, ref[order], atol=1e-5)
    assert out.token_ids[0] == int(np.argmax(logits[0])) and out.logprobs[0].token_rank == 1
    # logprobs are those of the raw logits: the biased token reports its low, unbiased rank
    assert out.token_ids[4] == int(np.argmin(logits[4])) and out.logprobs[4].token_rank == V


def test_logprobs_more_than_vocab():
    logits = torch.randn(1, 8, generator=torch.Generator().manual_seed(0))
    out = sample([row(temperature=0.0, logprobs=20)], logits)
    assert len(out.logprobs[0].top_ids) == 8


# ---------------------------------------------------------------------------- bad rows

def test_non_finite_rows_reported_without_affecting_others():
    rng = np.random.default_rng(7)
    logits = torch.from_numpy(rng.normal(0, 1.0, size=(8, V)).astype(np.float32))
    rows = [row(temperature=0.0), row(seed=1), row(seed=2, top_p=0.8), row(temperature=0.0, logprobs=3),
            row(seed=4, top_k=4), row(seed=5, repetition_penalty=1.2, output=[3]), row(seed=6),
            row(temperature=0.0)]
    clean = sample(rows, logits)
    assert clean.bad_rows == []
    broken = logits.clone()
    broken[1, 3] = float("nan")
    broken[4, 0] = float("inf")
    broken[6, :] = float("-inf")
    out = sample(rows, broken)
    assert out.bad_rows == [1, 4, 6]
    for i in (0, 2, 3, 5, 7):
        assert out.token_ids[i] == clean.token_ids[i]
    assert out.logprobs[3] == clean.logprobs[3]
    assert all(0 <= t < V for t in out.token_ids)


def test_metadata_flags():
    rows = [row(temperature=0.0), row(temperature=0.5, top_k=3)]
    md = SamplingMetadata.build(rows, V)
    assert not md.all_greedy and not md.all_random and md.top_p is None and md.min_p is None
    assert md.top_k.tolist() == [V, 3] and md.greedy_mask.tolist() == [True, False]
    assert md.max_num_logprobs is None and not md.needs_processing
    md = SamplingMetadata.build([row(temperature=0.0, top_k=3, top_p=0.5)], V)
    assert md.all_greedy and md.top_k is None and md.top_p is None
    md = SamplingMetadata.build([row(logprobs=2), row(logprobs=7, seed=1)], V)
    assert md.max_num_logprobs == 7 and list(md.generators) == [1]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_sampler_on_cuda():
    """On the GPU: unseeded rows draw from a CUDA generator, seeded rows do not depend on the batch,
    greedy rows take the argmax, draws stay inside top_k."""
    device = torch.device("cuda")
    rng = np.random.default_rng(8)
    logits = torch.from_numpy(rng.normal(0, 1.0, size=(20, V)).astype(np.float32)).to(device)
    rows = [row(temperature=0.0) if i % 3 == 0 else row(temperature=0.9, top_k=4, seed=i if i % 2 else None)
            for i in range(20)]
    md = SamplingMetadata.build(rows, V, device)
    out = Sampler(0)(logits, md)
    for i, t in enumerate(out.token_ids):
        top4 = set(logits[i].topk(4).indices.tolist())
        assert t in top4 and (i % 3 or t == int(logits[i].argmax()))
    alone = Sampler(1)(logits[7:8], SamplingMetadata.build([rows[7]], V, device)).token_ids[0]
    assert out.token_ids[7] == alone
