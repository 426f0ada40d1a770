"""Launch planning (sparse_train/plan/): the forward's split rule and the tile defaults (tuning.py), the device
probes (device.py) and the backward's KV-centric schedule (plan.py); the plan of an index itself is tested in
test_index.py."""

import torch

from sparse_train.plan import device, plan, tuning


def test_split_rule():
    h200 = 132  # streaming multiprocessors of an H200
    assert tuning.choose_num_splits(10_000, 30, h200) == 1  # big grid: never split
    assert tuning.choose_num_splits(8, 200, h200) == 8  # tiny grid, long rows
    assert tuning.choose_num_splits(8, 12, h200) == 1  # tiny grid, short rows: not worth it
    assert tuning.choose_num_splits(8, 20, h200) == 2  # each split keeps >= 8 blocks
    assert tuning.choose_num_splits(100, 64, h200) in (2, 4)


def test_sm_count_comes_from_the_device():
    assert device.device_sm_count("cpu") >= 1
    if torch.cuda.is_available():
        assert device.device_sm_count("cuda") == torch.cuda.get_device_properties(0).multi_processor_count


def test_kv_schedule_chunks_and_parts():
    reuse = torch.tensor([0, 1, 5, 2, 0], dtype=torch.int64)
    indptr = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(reuse, 0)])
    slots = torch.tensor([-1, -1, -1, 0, -1], dtype=torch.int32)  # block 3 is cold (atomics)
    rows, t0, t1, part, pstart, nparts, num_parts = plan.kv_schedule(reuse, indptr, slots, chunk=2)
    assert rows.tolist() == [1, 2, 2, 2]
    assert t0.tolist() == [0, 1, 3, 5] and t1.tolist() == [1, 3, 5, 6]
    assert part.tolist() == [-1, 0, 1, 2] and num_parts == 3
    assert nparts.tolist() == [-1, 0, 3, 0, -1] and pstart.tolist()[2] == 0


def test_tma_defaults_follow_the_device_the_layout_rule_and_the_options(monkeypatch):
    """TMA loads are on by default where the device takes descriptors (Hopper or newer; the CPU's interpreter
    emulates them), the KV-centric kernel's only for one head per step, no query-block map and key tiles
    under 128 x 128 (any tiles with stored dS), and its stage count follows the choice (3 with TMA, 2 with pointer loads
    at D = 64 over
    128-key blocks); an explicit option wins."""
    cpu = torch.device("cpu")
    assert device.copy_engine_loads(cpu)
    fwd = tuning.forward_config(4, 128, 128, 64, device=cpu)
    bwd = tuning.backward_config(4, 128, 128, 64, False, device=cpu)
    assert (fwd.tma_loads, bwd.dq_tma, bwd.kv_tma, bwd.kv_num_stages) == (1, 1, 1, 3)
    assert tuning.backward_config(4, 128, 128, 128, False, device=cpu).kv_tma == 0  # 128 x 128 key tiles
    stored = tuning.backward_config(4, 128, 128, 128, False, {"stored_ds": True}, device=cpu)
    assert (stored.kv_tma, stored.stored_ds) == (1, 1)  # unless dS leaves by TMA stores too
    mapped = tuning.backward_config(4, 128, 128, 64, False, device=cpu, query_map=True)
    assert (mapped.dq_tma, mapped.kv_tma, mapped.kv_num_stages) == (1, 0, 2)
    stacked = tuning.backward_config(4, 64, 64, 64, False, {"kv_heads_per_program": 2}, device=cpu)
    assert stacked.kv_tma == 0
    monkeypatch.setattr(tuning, "copy_engine_loads", lambda device: False)  # e.g. an A100
    old_gpu = tuning.backward_config(4, 128, 128, 64, False, device=cpu)
    assert (
        tuning.forward_config(4, 128, 128, 64, device=cpu).tma_loads,
        old_gpu.dq_tma,
        old_gpu.kv_tma,
        old_gpu.kv_num_stages,
    ) == (0, 0, 0, 2)
    forced = tuning.backward_config(4, 128, 128, 64, False, {"kv_tma": True, "dq_tma": True}, device=cpu)
    assert (forced.dq_tma, forced.kv_tma, forced.kv_num_stages) == (1, 1, 3)
