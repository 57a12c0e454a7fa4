"""The runner's persistent batch: rows kept across steps give the same step inputs as a fresh
build from the block tables, whatever changed between steps (a sequence joined, left, gained
a block, was preempted and came back with other blocks, had proposals rejected)."""

from __future__ import annotations

import torch

from kvlab.kernels import fused
from kvlab.models.attention import AttentionGroup, AttentionMetadata, SeqSpan, build_metadata
from kvlab.runner.persistent_batch import PersistentBatch
from kvlab.scheduler import ScheduledSeq, SchedulerOutput

BS = 4
CPU = torch.device("cpu")
SCRATCH = 99  # the window pool's scratch block


def fresh(out: SchedulerOutput, window: int | None) -> tuple[list[int], list[int],
                                                             AttentionMetadata]:
    """Ids, positions and metadata built from scratch: one span per sequence's known tokens
    and one per proposed token, each over the slots of its whole block table."""
    spans, ids, positions = [], [], []
    for s in out.scheduled:
        end = s.start + len(s.token_ids)
        slots = _slots(s.block_table, end)
        wslots = (None if s.window_table is None else
                  _slots([SCRATCH if b is None else b for b in s.window_table], end))
        known = len(s.token_ids) - (s.num_logits - 1 if s.needs_logits else 0)
        for start, n in [(s.start, known)] + [(p, 1) for p in range(s.start + known, end)]:
            spans.append(SeqSpan(start, n, slots[:start + n],
                                 None if wslots is None else wslots[:start + n]))
        ids.extend(s.token_ids)
        positions.extend(range(s.start, end))
    return ids, positions, build_metadata(spans, window, CPU)


def _slots(table: list[int], end: int) -> torch.Tensor:
    return torch.tensor([table[p // BS] * BS + p % BS for p in range(end)], dtype=torch.long)


def check(batch: PersistentBatch, out: SchedulerOutput) -> None:
    step = batch.inputs(out)
    ids, positions, meta = fresh(out, batch.window)
    assert step.ids.tolist() == ids and step.positions.tolist() == positions
    assert step.seq_ids is None or step.seq_ids == [s.seq_id for s in out.scheduled]
    got, want = step.meta, meta
    assert torch.equal(got.slot_mapping, want.slot_mapping)
    for mine, theirs in ((got.slot_mapping_sliding, want.slot_mapping_sliding),):
        assert (mine is None) == (theirs is None)
        assert mine is None or torch.equal(mine, theirs)
    for sliding in (False, True):
        assert len(got.groups(sliding)) == len(want.groups(sliding))
        for g, w in zip(got.groups(sliding), want.groups(sliding)):
            assert torch.equal(g.rows, w.rows)
            same_keys(g, w)
            assert (g.num_seqs, g.queries_per_seq, g.prefill, g.fresh, g.start, g.first,
                    g.window) == (w.num_seqs, w.queries_per_seq, w.prefill, w.fresh,
                                  w.start, w.first, w.window)
            assert (g.lengths is None) == (w.lengths is None)
            assert g.lengths is None or torch.equal(g.lengths, w.lengths)


def same_keys(g: AttentionGroup, w: AttentionGroup) -> None:
    """g's keys read as w's: the same slots and mask in w's columns; a decode group may keep
    spare columns after them (PersistentBatch's kept keys), padding each row with its first
    slot, masked."""
    width = w.slots.shape[1]
    assert g.slots.shape[1] == width or g.lengths is not None
    assert torch.equal(g.slots[:, :width], w.slots)
    assert (g.slots[:, width:] == g.slots[:, :1]).all()
    mask, want = g.key_mask, w.key_mask
    if g.slots.shape[1] == width:
        assert (mask is None) == (want is None)
    if mask is not None:
        assert torch.equal(mask[..., :width], want if want is not None else
                           torch.ones_like(mask[..., :width]))
        assert not mask[..., width:].any()


def decode(seq_id: str, start: int, table: list[int], window: list | None = None,
           proposed: int = 0) -> ScheduledSeq:
    return ScheduledSeq(seq_id, start, [7] * (1 + proposed), table, True, 0, window,
                        num_logits=1 + proposed)


def prefill(seq_id: str, start: int, n: int, table: list[int],
            window: list | None = None) -> ScheduledSeq:
    return ScheduledSeq(seq_id, start, list(range(n)), table, True, n, window)


def test_rows_follow_joins_leaves_and_new_blocks():
    batch = PersistentBatch(BS, None, None, CPU)
    check(batch, SchedulerOutput([prefill("a", 0, 6, [3, 5]), prefill("b", 0, 3, [8])]))
    check(batch, SchedulerOutput([decode("a", 6, [3, 5]), decode("b", 3, [8])]))
    # b crosses into a new block; c joins with a prefill beside the decodes
    check(batch, SchedulerOutput([decode("a", 7, [3, 5]), decode("b", 4, [8, 2]),
                                  prefill("c", 0, 5, [10, 11])]))
    # a leaves; its row is not read again
    check(batch, SchedulerOutput([decode("b", 5, [8, 2]), decode("c", 5, [10, 11])]))
    check(batch, SchedulerOutput([decode("c", 6, [10, 11]), decode("b", 6, [8, 2])]))


def test_preempted_sequence_comes_back_with_other_blocks():
    batch = PersistentBatch(BS, None, None, CPU)
    check(batch, SchedulerOutput([decode("a", 5, [3, 5]), decode("b", 2, [8])]))
    check(batch, SchedulerOutput([decode("a", 6, [3, 5])], preempted=["b"]))
    check(batch, SchedulerOutput([decode("a", 7, [3, 5]), prefill("b", 0, 3, [4])]))
    # the same id, same length, other blocks, and no word of it: the row is rewritten
    check(batch, SchedulerOutput([decode("a", 8, [3, 12, 13]), decode("b", 3, [6])]))


def test_truncated_table_and_proposals():
    batch = PersistentBatch(BS, None, None, CPU)
    check(batch, SchedulerOutput([decode("a", 6, [3, 5, 9, 1], proposed=4),
                                  decode("b", 2, [8])]))
    # rejected proposals: the table shrank, then grows again with other blocks
    check(batch, SchedulerOutput([decode("a", 8, [3, 5, 2], proposed=2)]))
    check(batch, SchedulerOutput([decode("a", 9, [3, 5, 2]), decode("b", 3, [8])]))


def test_rows_are_reused_past_the_tensor_and_grow_with_the_batch():
    batch = PersistentBatch(BS, None, None, CPU)
    for step in range(3):  # 20 sequences at once: more rows than the tensor starts with
        check(batch, SchedulerOutput([decode(f"s{i}", 4 + step, [i, 20 + i])
                                      for i in range(20)]))
    for step in range(3):  # others come and go; the idle rows are reused
        check(batch, SchedulerOutput([decode(f"t{step}-{i}", 9, [40 + i, 60 + i, 80 + i])
                                      for i in range(12)]))
    check(batch, SchedulerOutput([decode(f"s{i}", 7, [i, 20 + i]) for i in range(20)]))


def test_long_tables_widen_the_rows():
    batch = PersistentBatch(BS, None, None, CPU)
    table = list(range(30, 0, -1))
    check(batch, SchedulerOutput([decode("a", 100, table[:26]), decode("b", 3, [31])]))
    check(batch, SchedulerOutput([decode("a", 117, table), decode("b", 4, [31, 32])]))


def test_steps_one_position_on_follow_the_last_step():
    """Decode steps of the same sequences, each one position on (built from the last
    step's rows): blocks gained past the tensor's width, then steps that are not one
    position on, a block of the past changed, the order changed, a sequence left."""
    batch = PersistentBatch(BS, None, None, CPU)
    starts = {"a": 3, "b": 8, "c": 8, "d": 13}
    tables = {k: [10 * i + j for j in range(start // BS + 1)]
              for i, (k, start) in enumerate(starts.items())}

    def step(order: str = "abcd", preempted: tuple[str, ...] = ()) -> None:
        for k in order:
            if starts[k] // BS >= len(tables[k]):  # a new block where a position starts one
                tables[k] = tables[k] + [50 + len(tables[k]) + 10 * "abcd".index(k)]
        check(batch, SchedulerOutput([decode(k, starts[k], tables[k]) for k in order],
                                     list(preempted)))
        for k in order:
            starts[k] += 1

    for _ in range(30):  # d reaches 43 keys: 11 blocks, past the 8 columns rows start with
        step()
    starts["b"] += 2  # two proposals accepted
    step()
    step()
    tables["c"] = [99] + tables["c"][1:]  # same length, another first block
    step()
    step()
    step("badc")
    step("badc")
    step("bdc")
    step("bdc")
    step("bc", preempted=("d",))
    step("bc")


def test_sliding_window_shared_and_own_pool():
    shared = PersistentBatch(BS, 5, None, CPU)
    check(shared, SchedulerOutput([prefill("a", 0, 9, [3, 5, 9]), decode("b", 2, [8])]))
    check(shared, SchedulerOutput([decode("a", 9, [3, 5, 9]), decode("b", 3, [8])]))
    own = PersistentBatch(BS, 5, SCRATCH, CPU)
    check(own, SchedulerOutput([prefill("a", 0, 9, [3, 5, 9], [1, 2, 4]),
                                decode("b", 2, [8], [6])]))
    check(own, SchedulerOutput([decode("a", 9, [3, 5, 9], [1, 2, 4]),
                                decode("b", 3, [8], [6])]))
    # a's first window block is released (behind every query's window)
    check(own, SchedulerOutput([decode("a", 10, [3, 5, 9], [None, 2, 4]),
                                decode("b", 4, [8, 0], [6, 7], proposed=1)]))


def test_tables_for_the_decode_graphs():
    batch = PersistentBatch(BS, None, None, CPU)
    steps = [[decode("a", 5, [3, 5]), decode("b", 2, [8])],
             [decode("b", 3, [8]), decode("a", 6, [3, 5, 7])],
             [decode("a", 7, [3, 5, 7]), decode("b", 4, [1, 2])]]  # b came back elsewhere
    for scheduled in steps:
        tables = batch.tables(SchedulerOutput(scheduled))
        assert [t[:len(s.block_table)] for s, t in zip(scheduled, tables.tolist())] == [
            s.block_table for s in scheduled]


def test_steps_that_say_they_follow_the_last_step():
    """A decode step that names the step it repeats one position on (serial, follows) and
    the rows whose table grew is built from those rows alone; one that names a step the
    batch did not build last is built the usual way. Its device ids, where given, are its
    ids."""
    batch = PersistentBatch(BS, None, None, CPU)
    starts, tables = {"a": 6, "b": 3}, {"a": [3, 5], "b": [8]}
    serial = 0

    def step(follows: int | None) -> SchedulerOutput:
        nonlocal serial
        grown = []
        for i, k in enumerate("ab"):
            if starts[k] // BS >= len(tables[k]):
                tables[k] = tables[k] + [20 + len(tables[k]) + 10 * i]
                grown.append(i)
        serial += 1
        out = SchedulerOutput([decode(k, starts[k], tables[k]) for k in "ab"], [], True,
                              serial, follows, tuple(grown))
        check(batch, out)
        for k in "ab":
            starts[k] += 1
        return out

    last = step(None)
    for _ in range(9):  # both sequences cross block boundaries on the way
        last = step(last.serial)
    check(batch, SchedulerOutput([prefill("c", 0, 3, [40])]))  # another step between
    last = step(last.serial)  # names a step the batch did not build last
    last = step(last.serial)
    ids = torch.tensor([4, 9])
    out = SchedulerOutput([decode(k, starts[k], tables[k]) for k in "ab"], [], True,
                          serial + 1, last.serial)
    assert batch.inputs(out, ids).ids is ids


def test_decode_group_off_the_c_path_reads_only_used_columns():
    """One sequence decoding step after step: the key table keeps spare columns for the C
    attention, but a device whose attention reads every column it is given (here "meta",
    standing for CUDA) gets exactly the sequence's keys, unpadded (SDPA without a mask)."""
    for device, spare in ((torch.device("meta"), False), (CPU, fused.ENABLED)):
        batch = PersistentBatch(BS, None, None, device)
        table, widths = [1], []
        for start in range(3, 12):
            if start // BS >= len(table):
                table = table + [len(table) + 1]
            step = batch.inputs(SchedulerOutput([decode("a", start, table)]))
            (g,) = step.meta.groups(False)
            widths.append(g.slots.shape[1])
            if not spare:
                assert g.slots.shape == (1, start + 1) and not g.padded
        assert any(w > s + 1 for w, s in zip(widths, range(3, 12))) == spare
