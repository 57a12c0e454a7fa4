"""Speculative decoding on hybrid models (tiny random LFM2 and Qwen3.5; Granite 4 hybrid
and Nemotron-H with n-gram proposals): a verify step backs the recurrent state up, and a
rejected proposal rewinds the sequence to it, so greedy output is the same as plain decoding
alone, batched, chunked, after a prefix hit and after preemption, with n-gram proposals
(repeating prompts: some kept, some rejected) and with a draft model (a random one of
another family or of the same: mostly rejected; the model itself: all kept); every state
slot and block is free afterwards."""

from __future__ import annotations

import pytest
from test_hybrid import GREEDY, engine, run_all

from kvlab.cache import KVCacheManager
from kvlab.engine import Engine
from kvlab.models.loader import LoadOptions, load_model
from kvlab.request import SamplingParams
from kvlab.scheduler import Scheduler, SchedulerConfig, SchedulerOutput, Sequence
from kvlab.spec.adaptive import DraftState
from kvlab.spec.draft import DraftProposer
from kvlab.spec.proposer import Candidate
from kvlab.weights.checkpoint import open_checkpoint

from tiny_models import build, build_hybrid

NGRAM = {"speculative": "ngram", "num_speculative": 3, "speculative_adaptive": False}
PROMPTS = [[5, 6, 7, 8] * 5, list(range(20, 34)) * 2, [3, 14, 15, 92, 65, 3, 14, 15],
           [7] * 9]


@pytest.fixture(scope="module", params=["lfm2", "qwen3_5"])
def tiny(request, tmp_path_factory):
    out = tmp_path_factory.mktemp(request.param)
    build_hybrid(request.param, out)
    return request.param, None, out, None  # test_hybrid's form: engine() loads out / "hf"


@pytest.fixture(scope="module")
def draft(tmp_path_factory):
    out = tmp_path_factory.mktemp("draft")
    build("llama", out, seed=3)
    return out / "model.gguf"


def all_free(e: Engine) -> bool:
    states = e.kv.states
    assert states is not None
    return e.kv.num_free_blocks == e.kv.num_blocks and states.num_free == states.num_slots


@pytest.fixture(scope="module")
def alone(tiny):
    return [run_all(engine(tiny), [p])[0] for p in PROMPTS]


def test_ngram_alone_batched_and_chunked_equal_plain_decoding(tiny, alone):
    e = engine(tiny, **NGRAM)
    assert [run_all(e, [p])[0] for p in PROMPTS] == alone
    assert run_all(e, PROMPTS) == alone
    counts = e.stats().speculative
    assert counts.drafted > counts.accepted > 0  # some proposals kept, some rejected
    assert all_free(e)
    chunked = engine(tiny, max_num_batched_tokens=6, **NGRAM)
    assert run_all(chunked, PROMPTS) == alone and all_free(chunked)


def draft_engine(tiny, draft) -> Engine:
    return engine(tiny, speculative="draft", draft_model=str(draft), num_speculative=3,
                  speculative_adaptive=False)


def test_draft_model_proposals_equal_plain_decoding(tiny, draft, alone):
    e = draft_engine(tiny, draft)
    assert run_all(e, PROMPTS) == alone
    counts = e.stats().speculative
    assert counts.drafted > counts.accepted  # another model's guesses: mostly rejected
    assert all_free(e)


def test_the_model_as_its_own_draft_is_accepted_and_exact(tiny, alone):
    """A draft with recurrent layers: the target itself, whose guesses are all kept."""
    e = draft_engine(tiny, tiny[2] / "hf")
    assert run_all(e, PROMPTS) == alone
    counts = e.stats().speculative
    assert counts.drafted == counts.accepted > 0
    assert all_free(e)


def test_a_hybrid_draft_of_other_weights_rewinds_its_own_state(tiny, alone, tmp_path):
    """Another random model of the same family: its state goes back past the guesses
    the target rejected, and the output is still the target's."""
    build_hybrid(tiny[0], tmp_path, seed=7)
    e = draft_engine(tiny, tmp_path / "hf")
    assert run_all(e, PROMPTS) == alone
    counts = e.stats().speculative
    assert counts.drafted > counts.accepted
    assert all_free(e)


def test_prefix_hit_and_snapshots_hold_only_verified_tokens(tiny, alone):
    """Snapshots every 2 blocks: a second run of a prompt resumes from one saved while the
    first decoded with proposals, and still gives the plain output."""
    e = engine(tiny, state_snapshot_blocks=2, **NGRAM)
    assert e.kv.snapshots is not None
    assert run_all(e, [PROMPTS[0]]) == [alone[0]]
    longer = PROMPTS[0] + alone[0]  # the whole first turn as the next prompt
    plain = run_all(engine(tiny, enable_prefix_caching=False), [longer])[0]
    e.add_request("again", longer, GREEDY)
    outs = []
    while e.has_unfinished():
        outs.extend(e.step())
    assert [t for o in outs for t in o.new_token_ids] == plain
    assert outs[-1].cached_tokens > 0
    assert all_free(e)


def test_preemption_with_proposals_loses_nothing(tiny, alone):
    c = engine(tiny).loaded.config
    # room for 14 blocks of 4 tokens beside 16 sequences' states and their backups: the
    # prompts grow to 24 blocks
    gib = (32 * c.state_bytes_per_seq() + 14 * 4 * c.kv_bytes_per_token(4)) / 2**30
    e = engine(tiny, kv_cache_gib=gib, enable_prefix_caching=False, **NGRAM)
    assert e.kv.num_blocks == 14
    seqs: list = []
    assert run_all(e, PROMPTS, seqs) == alone
    assert sum(s.num_preemptions for s in seqs) > 0
    assert all_free(e)


class _Fixed:
    """Proposes the same tokens every time."""

    def __init__(self, tokens: list[int]) -> None:
        self.tokens = tokens

    def propose(self, candidates, rows):
        return [list(self.tokens[:c.cap]) for c in candidates]

    def forget(self, state) -> None:
        pass


def test_a_rejection_rewinds_to_the_backup_and_recomputes_the_kept_tokens():
    kv = KVCacheManager(16, 4, False, state_slots=2, state_backups=True)
    assert kv.num_state_rows == 4
    sched = Scheduler(SchedulerConfig(), kv, _Fixed([1, 2, 3]))
    seq = Sequence("a", [9] * 6, 6, SamplingParams(max_tokens=20))
    sched.add(seq)
    first = sched.schedule().scheduled[0]
    assert first.state_backup is None  # a prefill step: nothing to take back
    sched.update(SchedulerOutput([first]), {"a": seq})
    seq.token_ids.append(4)  # sampled
    verify = sched.schedule().scheduled[0]
    assert verify.token_ids == [4, 1, 2, 3] and verify.num_logits == 4
    backup = kv.state_backup("a")
    assert verify.state_backup == backup == 2 + kv.state_slot("a")
    sched.settle(seq, 1)  # 1 kept, 2 rejected
    seq.token_ids.append(5)  # sampled in place of 2
    sched.update(SchedulerOutput([verify]), {"a": seq})
    assert seq.num_computed_tokens == 6  # rewound to the verify step's start
    again = sched.schedule().scheduled[0]
    assert again.token_ids == [4, 1, 5, 1, 2, 3] and again.start == 6
    assert again.state_restore == backup and again.state_backup == backup
    assert again.state_save is None  # unverified tokens: no snapshot



def test_a_draft_that_went_back_proposes_as_a_fresh_one(tiny):
    """One guess kept, the next rejected: the draft restores its backup and computes the
    kept guess again, so it proposes what a draft that never guessed proposes."""
    loaded = load_model(open_checkpoint(tiny[2] / "hf"), LoadOptions())

    def propose(p: DraftProposer, state: DraftState, tokens: list[int]) -> list[int]:
        return p.propose([Candidate(state, tokens, 8)], 1)[0]

    draft, state = DraftProposer(loaded, 3, "f32", 0.01, 4, adaptive=False), DraftState()
    tokens = list(PROMPTS[1])
    first = propose(draft, state, tokens)
    assert len(first) == 3
    tokens += [first[0], (first[1] + 1) % 96]
    fresh = DraftProposer(loaded, 3, "f32", 0.01, 4, adaptive=False)
    assert propose(draft, state, tokens) == propose(fresh, DraftState(), tokens)
    draft.forget(state)
    assert draft.kv.states is not None and draft.kv.states.num_free == draft.kv.states.num_slots


@pytest.mark.parametrize("arch", ["granitehybrid", "nemotron_h"])
def test_mamba2_families_with_ngram_equal_plain_decoding(arch, tmp_path):
    """Mamba-2 layers (SSD scan) take back rejected proposals the same way."""
    build_hybrid(arch, tmp_path)
    tiny = (arch, None, tmp_path, None)
    plain = run_all(engine(tiny), PROMPTS)
    e = engine(tiny, **NGRAM)
    assert run_all(e, PROMPTS) == plain
    assert e.stats().speculative.drafted > 0  # mostly rejected: the state taken back
    assert all_free(e)
