"""bench/_equal_memory.py's host replay of the engine's schedule: the peak memory it
predicts and the bandwidth floor it puts under the equal-memory ratio, by hand."""

import numpy as np
import pytest

from jax_vmm.serving import engine as E
from scripts import load_script

EQ = load_script("bench/_equal_memory.py")


def request(i: int, prompt: int, new: int) -> E.Request:
    return E.Request(id=i, prompt=np.zeros(prompt, np.int32), max_new_tokens=new)


def test_the_schedule_releases_a_finished_slot_one_block_late_and_refills_it():
    reqs = [request(0, 10, 5), request(1, 3, 3)]  # block 2: 0 runs 2 blocks, 1 runs 1
    seen = [[(r.id, b) for r, b in occ] for occ in EQ.schedule(reqs, 1, 2)]
    # request 0 finishes in its second block, is released after a third is dispatched;
    # request 1 then takes the slot.
    assert seen == [[(0, 0)], [(0, 1)], [(0, 2)], [(1, 0)], [(1, 1)]]


def test_the_peak_counts_chunks_and_the_commit_ahead_chunk():
    reqs = [request(0, 10, 5)]
    # block 0 writes up to token 12, a chunk end: the next chunk is backed ahead (16);
    # later blocks need 14 tokens, inside those 16.
    assert EQ.simulated_peak(reqs, 1, 2, chunk=4, ahead=0) == 16
    assert EQ.simulated_peak(reqs, 1, 2, chunk=8, ahead=0) == 16
    assert EQ.simulated_peak(reqs, 1, 2, chunk=32, ahead=0) == 32


def test_the_peak_counts_the_read_tile_up_to_the_sequence_end():
    """A GPU arena's ensure backs the reader's whole tile (up to max_tokens): 14 tokens
    with a 32-token tile back 32, or the 20 a sequence holds at most."""
    reqs = [request(0, 10, 5)]
    assert EQ.simulated_peak(reqs, 1, 2, chunk=4, ahead=0, read_tile=32, max_tokens=64) == 32
    assert EQ.simulated_peak(reqs, 1, 2, chunk=4, ahead=0, read_tile=32, max_tokens=20) == 20
    assert EQ.simulated_peak(reqs, 1, 2, chunk=4, ahead=0, read_tile=1) == 16  # as before


def test_the_floor_reads_weights_every_step_and_the_kv_of_generating_sequences():
    reqs = [request(0, 10, 5)]  # generates tokens 11..14 in steps reading 10..13 cached
    seconds = EQ.decode_floor_seconds(
        reqs, 1, 2, weight_bytes=100, bytes_per_token=1, bytes_per_s=1
    )
    # three blocks of two steps run (the last only until the finished slot is read):
    assert seconds == pytest.approx(6 * 100 + (10 + 11 + 12 + 13))


def test_a_larger_batch_reads_the_weights_fewer_times():
    reqs = [request(i, 8, 9) for i in range(4)]
    one = EQ.decode_floor_seconds(reqs, 1, 4, weight_bytes=1000, bytes_per_token=1, bytes_per_s=1)
    four = EQ.decode_floor_seconds(reqs, 4, 4, weight_bytes=1000, bytes_per_token=1, bytes_per_s=1)
    kv = 4 * sum(8 + t for t in range(8))  # the same KV reads either way
    assert one == pytest.approx(4 * 3 * 4 * 1000 + kv)  # 3 blocks per request, one at a time
    assert four == pytest.approx(3 * 4 * 1000 + kv)
