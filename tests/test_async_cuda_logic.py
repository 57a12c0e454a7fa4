"""The logic of the CUDA serving path that runs on the CPU too: the decode graphs' padded
batch rows (kvlab.runner.decode_graph, its static pass run eagerly), a step whose input ids
come from the step before on the device, and async scheduling over those buckets when a
sequence ends in the step before a step already launched for it. The CUDA launcher runs
each step inline (its kernels queue on the stream); a launcher without a worker thread does
the same here, so the engine's order of launch, bookkeeping and emit is the one CUDA sees."""

from __future__ import annotations

import pytest
import torch
from test_async_scheduling import engine, run

from kvlab.engine import Engine
from kvlab.kernels.transfer import upload
from kvlab.models.loader import LoadOptions, load_model
from kvlab.request import SamplingParams
from kvlab.runner import ModelRunner
from kvlab.runner.decode_graph import decode_rows
from kvlab.runner.inflight import StepLauncher
from kvlab.scheduler import ScheduledSeq, SchedulerOutput
from kvlab.weights.checkpoint import open_checkpoint

from tiny_models import build

GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
PROMPTS = [[3, 14, 15, 92, 65], list(range(20, 41)), [7] * 9]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    build("llama", out := tmp_path_factory.mktemp("llama"))  # block tables alone
    return out / "model.gguf"


# ---- a bucket's rows ---------------------------------------------------------------------


def test_decode_rows_layout_with_padding_rows():
    """Two rows in a bucket of four, block size 4, width 8 (scratch slot 99):

        row 0: position 5, table [3, 1]   keys 0-5 -> 12 13 14 15 4 5, then 12 12 (masked)
        row 1: position 2, table [6, 7]   keys 0-2 -> 24 25 26, then 24 x 5 (7 is stale)
        rows 2, 3: padding
    """
    rows = torch.full((4, 12), -1, dtype=torch.long)
    tables = torch.tensor([[3, 1], [6, 7]])
    decode_rows(rows, torch.tensor([41, 42]), torch.tensor([5, 2]), tables, 4, 99)
    assert rows[0].tolist() == [41, 5, 6, 5, 12, 13, 14, 15, 4, 5, 12, 12]
    assert rows[1].tolist() == [42, 2, 3, 26, 24, 25, 26, 24, 24, 24, 24, 24]
    assert rows[2:].tolist() == [[0, 0, 1] + [99] * 9] * 2


def test_decode_rows_wider_than_the_tables_and_refilled():
    """A width past the tables' columns repeats their first block (masked keys); a bucket
    refilled with fewer rows turns the rows it no longer uses back into padding."""
    rows = torch.empty(2, 4 + 16, dtype=torch.long)
    decode_rows(rows, torch.tensor([8, 9]), torch.tensor([1, 6]), torch.tensor([[2], [5]]),
                8, 77)
    assert rows[:, 4:].tolist() == [[16, 17] + [16] * 14, [40, 41, 42, 43, 44, 45, 46] +
                                    [40] * 9]
    assert rows[:, 3].tolist() == [17, 46]
    decode_rows(rows, torch.tensor([8]), torch.tensor([2]), torch.tensor([[2]]), 8, 77)
    assert rows[1].tolist() == [0, 0, 1] + [77] * 17
    assert rows[0, :4].tolist() == [8, 2, 3, 18]


# ---- a graph step whose ids are on the device ----------------------------------------------


def _runner(path, graphs: str) -> ModelRunner:
    loaded = load_model(open_checkpoint(path), LoadOptions())
    return ModelRunner(loaded.model, loaded.config, 16, 4, graphs=graphs, max_batch=8)


def _prefill(runner: ModelRunner) -> list[ScheduledSeq]:
    """PROMPTS as sequences a, b, c (blocks 0-1, 2-7, 8-10); their first decode rows, with
    the token 17 + i each."""
    tables = [[0, 1], [2, 3, 4, 5, 6, 7], [8, 9, 10]]
    seqs = [ScheduledSeq(s, 0, p, t, True, len(p))
            for s, p, t in zip("abc", PROMPTS, tables)]
    runner.execute(SchedulerOutput(seqs))
    return [ScheduledSeq(s.seq_id, len(s.token_ids), [17 + i], s.block_table, True, 0)
            for i, s in enumerate(seqs)]


def test_graph_step_takes_its_ids_from_the_device_tensor(tiny):
    """Three rows in a bucket of four: stand-in ids and the real ones as input_ids give the
    logits the real ids give, in the static pass as in the ordinary one."""
    logits, buckets = {}, None
    for name, graphs, stand_ins in (("off", "off", False), ("eager", "eager", False),
                                    ("ahead", "eager", True)):
        runner = _runner(tiny, graphs)
        decode = _prefill(runner)
        ids = None
        if stand_ins:
            ids = torch.tensor([s.token_ids[0] for s in decode])
            decode = [s._replace(token_ids=[0]) for s in decode]
        step = SchedulerOutput(decode, decode=True)
        logits[name] = runner.execute(step, input_ids=ids).logits
        buckets = runner.graphs and list(runner.graphs.buckets)
    assert buckets == [(4, 64)]  # the pool (16 blocks of 4) caps the width
    assert torch.equal(logits["ahead"], logits["eager"])
    torch.testing.assert_close(logits["eager"], logits["off"], atol=1e-4, rtol=1e-4)


def test_graph_step_after_a_row_left(tiny):
    """The step after one whose first sequence ended: the two others' ids are their rows of
    the sampled tensor (gathered on the device), in a bucket of two; the scratch rows of the
    bucket of four left nothing in their caches."""
    got = []
    for graphs in ("off", "eager"):
        runner = _runner(tiny, graphs)
        decode = _prefill(runner)
        first = runner.execute(SchedulerOutput(decode, decode=True)).logits
        sampled = first.argmax(-1)
        rest = [s._replace(start=s.start + 1, token_ids=[0]) for s in decode[1:]]
        ids = sampled[torch.tensor([1, 2], device=sampled.device)]
        got.append(runner.execute(SchedulerOutput(rest, decode=True), input_ids=ids).logits)
        if graphs == "eager":
            assert set(runner.graphs.buckets) == {(4, 64), (2, 64)}
    torch.testing.assert_close(got[1], got[0], atol=1e-4, rtol=1e-4)


# ---- async scheduling over the buckets ---------------------------------------------------


def _engine(path, async_on: bool, graphs: str, inline: bool = False, **kw) -> Engine:
    e = engine(path, async_on, decode_graphs=graphs, **kw)
    if inline:  # no worker thread: each step runs inside launch, as on CUDA
        e._launcher.close()
        e._launcher = StepLauncher(torch.device("meta"))
    return e


def _jobs(path) -> list[tuple[list[int], SamplingParams]]:
    """Three requests (a bucket of four, one padding row): the first ends at a stop token
    no limit foresees (its extra row is in the step already launched), the second by its
    limit, the third runs on alone (a bucket of one)."""
    alone = run(_engine(path, False, "off"), [(PROMPTS[0], GREEDY)])[0]["0"]
    return [(PROMPTS[0], SamplingParams(max_tokens=10, temperature=0, ignore_eos=True,
                                        stop_token_ids=(alone[3],))),
            (PROMPTS[1], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)),
            (PROMPTS[2], GREEDY)]


def _in_flight_at_end(e: Engine, request_id: str) -> list[list[str] | None]:
    """Wraps e.step: at each step where request_id finishes, the request ids of the step
    then in flight (None: none)."""
    seen: list[list[str] | None] = []
    step = e.step

    def observed():
        outs = step()
        if any(o.request_id == request_id and o.finished for o in outs):
            flight = e._inflight
            seen.append(None if flight is None else [s.seq_id for s in flight.seqs])
        return outs

    e.step = observed
    return seen


@pytest.mark.parametrize("inline", [False, True], ids=["worker", "inline"])
def test_sequence_ended_under_a_launched_padded_step(tiny, inline):
    jobs = _jobs(tiny)
    want = run(_engine(tiny, False, "off"), jobs)
    e = _engine(tiny, True, "eager", inline)
    ended = _in_flight_at_end(e, "0")
    got = run(e, jobs)
    assert got[:2] == want[:2] and got[2] > 0
    # request 0 ended with a step of three rows (a bucket of four) in flight holding its row
    assert ended == [["0", "1", "2"]]
    assert {b for b, _ in e.runner.graphs.buckets} == {1, 2, 4}
    # again on the same engine: the step left in flight for the ended ones is dropped
    assert run(e, jobs)[:2] == want[:2]


@pytest.mark.parametrize("inline", [False, True], ids=["worker", "inline"])
def test_abort_under_a_launched_padded_step(tiny, inline):
    jobs = [(p, GREEDY) for p in PROMPTS]
    want = run(_engine(tiny, False, "off"), jobs, {"1": 4})
    got = run(_engine(tiny, True, "eager", inline), jobs, {"1": 4})
    assert got[:2] == want[:2] and got[2] > 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_captured_graphs_pinned_ids_and_events(tiny):
    """The same on a GPU: captured graphs, ids copied to pinned memory behind an event, the
    next step's ids gathered on the device; fp32, so the CPU's synchronous tokens hold."""
    jobs = _jobs(tiny)
    want = run(_engine(tiny, False, "off"), jobs)
    e = _engine(tiny, True, "auto", device="cuda", dtype="float32", kv_dtype="f32")
    got = run(e, jobs)
    assert e.runner.graphs is not None and e.runner.graphs.capture
    assert got[:2] == want[:2] and got[2] > 0
    assert {b for b, _ in e.runner.graphs.buckets} == {1, 2, 4}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_logprobs_from_the_pinned_copies(tiny):
    """Logprobs read a step later on a GPU come from the host copies behind the step's event
    (reading the device's would wait for the step launched after it): a synchronous
    engine's, token for token."""
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=2)

    def logprobs(e: Engine) -> list[tuple[int, float]]:
        e.add_request("0", PROMPTS[0], params)
        got = []
        while e.has_unfinished():
            got += [(lp.token_id, round(lp.logprob, 4))
                    for o in e.step() for lp in o.logprobs or []]
        return got

    cuda = {"device": "cuda", "dtype": "float32", "kv_dtype": "f32"}
    want = logprobs(_engine(tiny, False, "auto", **cuda))
    e = _engine(tiny, True, "auto", **cuda)
    read, seen = e._logprob, []

    def observed(sampled, row, token):
        seen.append((sampled.logprobs.is_pinned(), sampled.top_ids.is_pinned()))
        return read(sampled, row, token)

    e._logprob = observed
    assert len(want) == 8 and logprobs(e) == want
    assert seen and all(pinned == (True, True) for pinned in seen[1:])  # the first: prefill


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device"))])
def test_upload_gives_the_values_on_the_device(device):
    host = torch.arange(7, dtype=torch.int64) * 3
    sent = upload(host, device)
    assert sent.device.type == device and sent.dtype == torch.int64
    assert sent.cpu().tolist() == [3 * i for i in range(7)]
    assert upload(torch.tensor([True, False]), device).cpu().tolist() == [True, False]
