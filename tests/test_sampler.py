"""Sampler: each filter on a hand-computed example, seeding, greedy, logprobs, statistics."""

import math

import pytest
import torch

from kvlab.request import SamplingParams
from kvlab.sampler import (
    SamplingBatch,
    SamplingCache,
    TokenIds,
    apply_min_p,
    apply_penalties,
    apply_presence_frequency_penalty,
    apply_repetition_penalty,
    apply_temperature,
    apply_top_k,
    apply_top_p,
    sample,
)

NEG_INF = float("-inf")


def make_batch(params, prompts=None, outputs=None, seeds=None) -> SamplingBatch:
    n = len(params)
    generators = [
        None if s is None else torch.Generator().manual_seed(s) for s in (seeds or [None] * n)
    ]
    return SamplingBatch.build(
        params, prompts or [[] for _ in range(n)], outputs or [[] for _ in range(n)],
        generators, "cpu",
    )


def random_logits(rows: int, vocab: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3


# --- each filter alone ---


def test_temperature():
    out = apply_temperature(torch.tensor([[2.0, -4.0], [2.0, -4.0]]), torch.tensor([2.0, 0.5]))
    assert torch.equal(out, torch.tensor([[1.0, -2.0], [4.0, -8.0]]))


def test_top_k_per_row():
    logits = torch.tensor([[1.0, 5.0, 3.0, 4.0]] * 3)
    out = apply_top_k(logits, torch.tensor([2, 0, 9]), max_top_k=9)
    assert torch.equal(out[0], torch.tensor([NEG_INF, 5.0, NEG_INF, 4.0]))
    assert torch.equal(out[1], logits[1])  # 0 disables
    assert torch.equal(out[2], logits[2])  # k beyond the vocab keeps all


def test_top_p_per_row():
    logits = torch.tensor([[0.5, 0.3, 0.2]]).log().repeat(4, 1)
    out = apply_top_p(logits, torch.tensor([0.75, 0.45, 0.81, 1.0]))
    kept = torch.isfinite(out)
    assert kept.tolist() == [
        [True, True, False],  # 0.5 + 0.3 reaches 0.75
        [True, False, False],  # 0.5 alone reaches 0.45
        [True, True, True],  # 0.8 < 0.81 needs the third
        [True, True, True],  # 1 disables
    ]
    assert torch.equal(out[kept], logits[kept])


def test_min_p_per_row():
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log().repeat(3, 1)
    out = apply_min_p(logits, torch.tensor([0.5, 0.2, 0.0]))
    assert torch.isfinite(out).tolist() == [
        [True, True, False, False],  # below 0.5 * 0.5 = 0.25 dropped
        [True, True, True, False],  # below 0.2 * 0.5 = 0.1 dropped
        [True, True, True, True],  # 0 disables
    ]


def test_repetition_penalty_divides_positive_multiplies_negative():
    logits = torch.tensor([[2.0, -2.0, 1.0, -1.0]])
    seen = torch.tensor([[True, True, False, False]])
    out = apply_repetition_penalty(logits, seen, torch.tensor([2.0]))
    assert torch.equal(out, torch.tensor([[1.0, -4.0, 1.0, -1.0]]))


def test_presence_and_frequency_penalties():
    counts = torch.tensor([[2.0, 0.0, 1.0, 0.0]])
    out = apply_presence_frequency_penalty(
        torch.zeros(1, 4), counts, torch.tensor([0.5]), torch.tensor([0.25])
    )
    assert torch.allclose(out, torch.tensor([[-1.0, 0.0, -0.75, 0.0]]))


def test_penalties_from_batch_use_the_right_tokens():
    # repetition: prompt + output tokens; presence / frequency: output tokens only
    params = [
        SamplingParams(repetition_penalty=2.0),
        SamplingParams(presence_penalty=0.5, frequency_penalty=0.25),
        SamplingParams(),
    ]
    batch = make_batch(params, prompts=[[0], [0], [0]], outputs=[[1, 1], [1, 1, 2], [1]])
    logits = torch.tensor([[4.0, 4.0, 4.0, 4.0]]).repeat(3, 1)
    out = apply_penalties(logits, batch)
    assert torch.allclose(out, torch.tensor([
        [2.0, 2.0, 4.0, 4.0],
        [4.0, 4.0 - 0.5 - 0.5, 4.0 - 0.5 - 0.25, 4.0],
        [4.0, 4.0, 4.0, 4.0],
    ]))


# --- sample() ---


def test_greedy_is_argmax_of_penalized_logits():
    logits = random_logits(6, 50)
    batch = make_batch([SamplingParams(temperature=0)] * 6)
    assert torch.equal(sample(logits, batch).token_ids, logits.argmax(-1))
    top = logits.argmax(-1)[0].item()
    rep = make_batch([SamplingParams(temperature=0, repetition_penalty=1e3)], prompts=[[top]])
    masked = logits[:1].clone()
    masked[0, top] = NEG_INF
    assert sample(logits[:1], rep).token_ids.item() == masked.argmax(-1).item()


def test_greedy_rows_in_a_mixed_batch():
    logits = random_logits(4, 30)
    params = [SamplingParams(temperature=0), SamplingParams(temperature=1.5),
              SamplingParams(temperature=0), SamplingParams(temperature=0.7, top_k=5)]
    out = sample(logits, make_batch(params, seeds=[1, 2, None, 3])).token_ids
    assert out[0] == logits[0].argmax() and out[2] == logits[2].argmax()


@pytest.mark.parametrize("params", [
    SamplingParams(top_k=1, temperature=1.3),
    SamplingParams(top_p=1e-6, temperature=1.3),
    SamplingParams(min_p=1.0, temperature=1.3),
])
def test_degenerate_filters_equal_greedy(params):
    logits = random_logits(32, 100, seed=1)
    out = sample(logits, make_batch([params] * 32)).token_ids
    assert torch.equal(out, logits.argmax(-1))


def test_same_seed_same_tokens_batched_or_alone():
    logits = random_logits(5, 40, seed=2) / 3  # flat enough that every sampled row varies
    params = [SamplingParams(temperature=0.9, top_p=0.9, seed=7),
              SamplingParams(temperature=1.0),
              SamplingParams(temperature=0),
              SamplingParams(temperature=1.2, top_k=10, min_p=0.05, seed=8),
              SamplingParams(temperature=0.8, repetition_penalty=1.3, seed=9)]
    seeds = [p.seed for p in params]
    prompts = [[1, 2, 3]] * 5

    def run(rows: list[int], steps: int = 12) -> list[list[int]]:
        gens = [None if seeds[r] is None else torch.Generator().manual_seed(seeds[r])
                for r in rows]
        outputs: list[list[int]] = [[] for _ in rows]
        for _ in range(steps):
            batch = SamplingBatch.build([params[r] for r in rows], [prompts[r] for r in rows],
                                        outputs, gens, "cpu")
            for out, tok in zip(outputs, sample(logits[rows], batch).token_ids.tolist()):
                out.append(tok)
        return outputs

    batched = run([0, 1, 2, 3, 4])
    for r in (0, 3, 4):
        assert run([r]) == [batched[r]]
        assert run([r]) == run([r])
    assert all(len(set(batched[r])) > 1 for r in (0, 1, 3, 4))  # it really samples


def test_logprobs_are_of_the_raw_distribution():
    logits = random_logits(3, 20, seed=3)
    params = [SamplingParams(temperature=0.5, top_k=3, repetition_penalty=1.5, logprobs=4),
              SamplingParams(temperature=0, presence_penalty=2.0, logprobs=1),
              SamplingParams(temperature=1.0)]
    result = sample(logits, make_batch(params, outputs=[[0], [1], [2]], seeds=[0, 1, 2]))
    raw = torch.log_softmax(logits, dim=-1)
    expected = raw.gather(1, result.token_ids[:, None]).squeeze(1)
    assert torch.allclose(result.logprobs, expected)
    assert result.top_ids.shape == (3, 4) and result.top_logprobs.shape == (3, 4)
    assert torch.equal(result.top_ids, raw.topk(4, dim=-1).indices)
    assert torch.allclose(result.top_logprobs, raw.topk(4, dim=-1).values)


def test_no_logprobs_requested_gives_empty_top():
    result = sample(random_logits(2, 10), make_batch([SamplingParams(temperature=0)] * 2))
    assert result.top_ids.shape == (2, 0) and result.top_logprobs.shape == (2, 0)
    assert result.top_ids.dtype == torch.int64 and result.top_logprobs.dtype == torch.float32
    assert result.logprobs.shape == (2,) and result.logprobs.isnan().all()
    assert result.token_ids.dtype == torch.int64


def test_steps_of_a_kept_batch_without_logprobs_make_no_logprob_columns():
    """A batch kept across steps (the engine's) gives every step the same empty columns."""
    batch = make_batch([SamplingParams(temperature=0), SamplingParams(temperature=0.7)],
                       seeds=[0, 1])
    first, second = (sample(random_logits(2, 10), batch) for _ in range(2))
    assert all(a is b for a, b in zip(
        (first.logprobs, first.top_ids, first.top_logprobs),
        (second.logprobs, second.top_ids, second.top_logprobs)))


def test_sample_does_not_modify_logits():
    logits = random_logits(2, 10)
    before = logits.clone()
    params = [SamplingParams(temperature=0.7, top_k=3, top_p=0.8, repetition_penalty=1.2)] * 2
    sample(logits, make_batch(params, prompts=[[1], [2]], seeds=[0, 1]))
    assert torch.equal(logits, before)


def test_build_rejects_ragged_inputs():
    with pytest.raises(ValueError, match="one entry per row"):
        SamplingBatch.build([SamplingParams()], [[1], [2]], [[]], [None], "cpu")


@pytest.mark.parametrize("seeded", [False, True])
def test_sampling_frequencies_match_softmax(seeded):
    probs = torch.tensor([0.1, 0.2, 0.3, 0.4])
    n = 20_000
    logits = probs.log().repeat(n, 1)
    params = [SamplingParams(temperature=1.0)] * n
    generator = torch.Generator().manual_seed(1234)  # shared: each row draws in turn
    batch = SamplingBatch.build(params, [[]] * n, [[]] * n, [generator if seeded else None] * n,
                                "cpu")
    with torch.random.fork_rng():
        torch.manual_seed(1234)
        tokens = sample(logits, batch).token_ids
    observed = torch.bincount(tokens, minlength=4).double()
    expected = probs.double() * n
    chi2 = ((observed - expected) ** 2 / expected).sum().item()
    assert chi2 < 16.27, (observed.tolist(), chi2)  # 3 dof, p = 0.001
    assert math.isclose(observed.sum().item(), n)


def test_logit_bias_forces_bans_and_leaves_the_raw_logprobs():
    logits = random_logits(3, 50, seed=3)
    top = int(logits[1].argmax())
    params = [SamplingParams(temperature=0, logit_bias={7: 100.0}, logprobs=1),
              SamplingParams(temperature=0, logit_bias={top: -100.0}, logprobs=1),
              SamplingParams(temperature=0, logprobs=1)]
    out = sample(logits, make_batch(params))
    assert out.token_ids[0] == 7 and out.token_ids[1] != top
    assert out.token_ids[2] == int(logits[2].argmax())  # an unbiased row is untouched
    raw = torch.log_softmax(logits, dim=-1)
    assert out.logprobs[0] == pytest.approx(float(raw[0, 7]), abs=1e-5)  # the model's own


def test_logit_bias_bans_a_token_from_sampled_rows():
    logits = torch.zeros(1, 4)
    logits[0, 2] = 3.0  # the likeliest by far
    params = [SamplingParams(temperature=1.0, logit_bias={2: -100.0})]
    drawn = {int(sample(logits, make_batch(params, seeds=[s])).token_ids[0]) for s in range(200)}
    assert 2 not in drawn and drawn == {0, 1, 3}


def test_logit_bias_values_are_checked():
    with pytest.raises(Exception, match=r"\[-100, 100\]"):
        SamplingParams(logit_bias={1: 101.0})
    with pytest.raises(Exception, match=">= 0"):
        SamplingParams(logit_bias={-1: 1.0})
    assert SamplingParams(logit_bias={5: 1, 2: -3}).logit_bias == ((2, -3.0), (5, 1.0))


# --- the batch kept across steps ---


def _cached(cache, owners, params, seeds, outputs=None, allowed=None):
    """cache.get for owners (indices into params and seeds), and how it was built."""
    how = []

    def describe(o):
        how.append("row")
        return params[o], torch.Generator().manual_seed(seeds[o])

    def build():
        how.append("whole")
        return make_batch([params[o] for o in owners], outputs=outputs,
                          seeds=[seeds[o] for o in owners])

    return cache.get(owners, describe, build, "cpu", allowed), how


def test_cache_keeps_the_batch_for_the_same_rows_and_draws_as_a_fresh_one():
    params = [SamplingParams(temperature=0.8, top_p=0.9), SamplingParams(temperature=0)]
    cache, logits = SamplingCache(), random_logits(2, 50)
    first, how = _cached(cache, [0, 1], params, [7, 8])
    again, again_how = _cached(cache, [0, 1], params, [7, 8])
    assert again is first and how == ["row", "row"] and again_how == []
    # the kept batch's generators go on drawing as a fresh batch's would, step after step
    fresh = make_batch(params, seeds=[7, 8])
    for _ in range(3):
        assert torch.equal(sample(logits, again).token_ids, sample(logits, fresh).token_ids)
    mask = torch.zeros(2, 2, dtype=torch.int32)
    masked, _ = _cached(cache, [0, 1], params, [7, 8], allowed=mask)
    assert masked.allowed is mask and first.allowed is None
    swapped, how = _cached(cache, [1, 0], params, [7, 8])  # gathered again, rows known
    assert how == [] and swapped.greedy.tolist() == [True, False]


def _same_batch(got: SamplingBatch, want: SamplingBatch) -> None:
    for name in ("greedy", "temperature", "top_k", "top_p", "min_p"):
        a, b = getattr(got, name), getattr(want, name)
        assert (a is None) == (b is None), name
        assert a is None or (a.dtype == b.dtype and torch.equal(a, b)), name
    assert [r for r, _ in got.seeded_rows] == [r for r, _ in want.seeded_rows]
    assert (got.any_unseeded_sampled, got.all_greedy, got.max_top_k, got.num_logprobs,
            got.want_logprobs) == (want.any_unseeded_sampled, want.all_greedy,
                                   want.max_top_k, want.num_logprobs, want.want_logprobs)
    assert (got.logit_bias is None) == (want.logit_bias is None)
    if got.logit_bias is not None:
        for name in ("rows", "ids", "values"):
            assert torch.equal(getattr(got.logit_bias, name), getattr(want.logit_bias, name))


def test_cache_rows_give_the_batch_a_fresh_build_gives_as_sequences_come_and_go():
    rng = torch.Generator().manual_seed(0)

    def draw(n):
        return torch.randint(0, n, (1,), generator=rng).item()

    params = [SamplingParams(temperature=[0, 0.7, 1.3][draw(3)], top_k=[0, 5, 40][draw(3)],
                             top_p=[1.0, 0.9][draw(2)], min_p=[0.0, 0.05][draw(2)],
                             logprobs=[None, 0, 3][draw(3)],
                             logit_bias=[(), ((4, 2.5),)][draw(2)]) for _ in range(100)]
    seeds = list(range(100))
    cache = SamplingCache()
    for _ in range(40):  # a random subset of sequences in a random order, each step
        owners = torch.randperm(100, generator=rng)[:1 + draw(99)].tolist()
        got, how = _cached(cache, owners, params, seeds)
        assert "whole" not in how
        _same_batch(got, make_batch([params[o] for o in owners],
                                    seeds=[seeds[o] for o in owners]))


def test_cache_builds_a_penalized_batch_every_step():
    params = [SamplingParams(temperature=0, presence_penalty=1.0), SamplingParams()]
    cache = SamplingCache()
    _, how = _cached(cache, [0, 1], params, [1, 2], outputs=[[3], []])
    got, again = _cached(cache, [0, 1], params, [1, 2], outputs=[[3, 3], []])
    assert how == ["row", "row", "whole"] and again == ["whole"]
    assert got.output_tokens.ids.tolist() == [[3, 3], [0, 0]]


def test_token_ids_pad_ragged_rows():
    rows = [[5, 1, 5], [], [7], [2, 2, 2, 2, 9]]
    got = TokenIds.build(rows, "cpu")
    assert got.ids.tolist() == [[5, 1, 5, 0, 0], [0] * 5, [7, 0, 0, 0, 0], [2, 2, 2, 2, 9]]
    assert got.valid.tolist() == [[1, 1, 1, 0, 0], [0] * 5, [1, 0, 0, 0, 0], [1] * 5]
    assert got.counts(10)[3].tolist() == [0, 0, 4, 0, 0, 0, 0, 0, 0, 1]
    empty = TokenIds.build([[], []], "cpu")
    assert empty.ids.tolist() == [[0], [0]] and empty.valid.tolist() == [[0], [0]]
