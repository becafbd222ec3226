"""Single-process pieces: mesh layout, plan parsing, epoch handling, gradient buckets."""
import gc

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard
from torch.utils.data import DataLoader

from framework.atomic import atomic_file
from framework.data import SyntheticRegression
from framework.data.loader import build_sampler
from framework.config.errors import ConfigError
from framework.parallel.mesh import layout_table, submesh_ranks
from framework.parallel.roles import MeshRoles
from framework.models import SeedMLP
from framework.parallel.data_parallel import BUCKET_BYTES, _buckets
from framework.parallel.tensor_parallel import to_placement
from framework.parallel.plan import check_layout, matching_modules
from framework.data.loader import DataPosition, batches
from framework.training.schedule import lr_multiplier
from framework.training.metrics import mfu, peak_flops
from framework.training.trainer import PendingLosses, garbage_frozen
from tests.conftest import compose_config


def test_layout_of_the_seed_mesh_lists_each_ranks_groups():
    table = layout_table([3, 2], ["dp", "tp"]).splitlines()
    assert table[0] == "DeviceMesh [dp=3, tp=2] ranks [[0, 1], [2, 3], [4, 5]]"
    assert table[1].split() == ["rank", "dp", "tp", "dp", "group", "tp", "group"]
    assert table[4] == "2     1   0   [0, 2, 4]  [2, 3]"


def test_submesh_ranks_of_a_three_dim_mesh():
    # shape [2, 2, 2], rank 5 = (1, 0, 1)
    assert submesh_ranks([2, 2, 2], 5, 0) == [1, 5]
    assert submesh_ranks([2, 2, 2], 5, 1) == [5, 7]
    assert submesh_ranks([2, 2, 2], 5, 2) == [4, 5]


def test_layouts_are_checked_then_turned_into_placements():
    assert to_placement("replicate") == Replicate()
    assert to_placement("Shard(-1)") == Shard(-1)
    assert to_placement(["shard(1)", None]) == (Shard(1), None)
    check_layout("k", ["shard(1)", None, "replicate"])
    with pytest.raises(ConfigError, match="k='shard'"):
        check_layout("k", ["replicate", "shard"])


def test_wildcards_match_one_name_segment():
    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList([SeedMLP(), SeedMLP()])
    assert matching_modules(model, "layers.*.net1") == ["layers.0.net1", "layers.1.net1"]
    assert matching_modules(model, "layers.*") == ["layers.0", "layers.1"]
    assert matching_modules(model, "net1") == []


def test_every_epoch_gets_its_own_permutation_and_covers_the_data_once():
    dataset = SyntheticRegression(num_samples=48)
    sampler = build_sampler(dataset, dp_size=2, dp_rank=1, shuffle=True, seed=0, drop_last=True)
    index_loader = DataLoader(range(48), batch_size=8, sampler=sampler, drop_last=True)
    stream = batches(sampler, index_loader, DataPosition(), global_batch=16)
    epochs = [torch.cat([next(stream) for _ in range(3)]).tolist() for _ in range(2)]  # 24 per replica
    assert epochs[0] != epochs[1]
    for epoch, indices in enumerate(epochs):
        sampler.set_epoch(epoch)
        assert indices == list(sampler)


@pytest.mark.parametrize("old_dp,new_dp", [(2, 2), (2, 4), (4, 1), (1, 2)])
def test_a_resumed_position_continues_the_global_batch_order_on_any_dp_size(old_dp, new_dp):
    """Global batch t is the union of the replicas' batch t, for every DP size; resuming at a
    global position (epoch 1, 2 of its 3 batches) on another DP size gives the same batches."""
    def global_batches(dp, position, count):
        streams = []
        for rank in range(dp):
            sampler = build_sampler(range(48), dp_size=dp, dp_rank=rank, shuffle=True, seed=3, drop_last=True)
            loader = DataLoader(range(48), batch_size=16 // dp, sampler=sampler, drop_last=True)
            streams.append(batches(sampler, loader, DataPosition(position.epoch, position.samples), 16))
        return [sorted(torch.cat([next(s) for s in streams]).tolist()) for _ in range(count)]

    straight = global_batches(old_dp, DataPosition(), 8)  # 3 batches per epoch: epochs 0, 1, 2
    assert global_batches(new_dp, DataPosition(epoch=1, samples=32), 3) == straight[5:8]


def test_buckets_keep_order_split_by_dtype_and_size():
    big = torch.zeros(BUCKET_BYTES // 4)  # exactly one bucket of float32
    tensors = [torch.zeros(3), big, torch.zeros(2, dtype=torch.float64), torch.zeros(1, dtype=torch.float64)]
    buckets = _buckets(tensors)
    assert [[t.numel() for t in b] for b in buckets] == [[3], [big.numel()], [2, 1]]


def test_lr_warms_up_linearly_then_decays_by_cosine_to_a_tenth():
    assert [lr_multiplier(s, 4, 104, "cosine") for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert lr_multiplier(3, 4, 104, "cosine") == 1.0  # last warmup step: the full lr
    assert lr_multiplier(53, 4, 104, "cosine") == pytest.approx(0.1 + 0.9 * 0.5)  # halfway
    assert lr_multiplier(103, 4, 104, "cosine") == pytest.approx(0.1)  # the last of 104 steps
    assert lr_multiplier(50, 4, 104, "constant") == 1.0


def test_mfu_is_achieved_over_peak_flops():
    # 1000 tokens/s x 6e9 FLOPs/token = 6e12 FLOP/s achieved, over 4 devices of 10 TFLOP/s.
    assert mfu(1000.0, 6_000_000_000, 4 * 10e12) == pytest.approx(0.15)


@pytest.mark.parametrize("name, tflops", [("NVIDIA H100 80GB HBM3", 989), ("NVIDIA A100-SXM4-80GB", 312),
                                          ("NVIDIA GeForce RTX 4090", None)])
def test_the_peak_is_the_planner_s_published_profile_of_the_device(monkeypatch, name, tflops):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda: name)
    cfg = compose_config(["mesh.device_type=cuda"])
    assert peak_flops(cfg) == (None if tflops is None else tflops * 1e12)
    assert peak_flops(compose_config(["mesh.device_type=cuda", "trainer.peak_tflops=100"])) == 100e12


def test_mesh_roles_come_from_the_config_alone():
    roles = MeshRoles.from_config(compose_config(["mesh=2x2x1"]))
    assert (roles.dp_dims, roles.dp_size, roles.tp_size, roles.world) == (["dp_replicate", "dp"], 4, 1, 4)
    roles = MeshRoles.from_config(compose_config(["mesh=1x4"]))
    assert (roles.dp_dims, roles.dp_size, roles.tp_size) == (["dp"], 1, 4)
    roles = MeshRoles.from_config(compose_config(["mesh.shape=[4]", "mesh.dim_names=[tp]", "parallel.dp_dim=null"]))
    assert (roles.dp_dims, roles.dp_size, roles.tp_size) == ([], 1, 4)


def test_an_atomic_file_appears_whole_or_not_at_all(tmp_path):
    path = tmp_path / "summary.json"
    path.write_text("old")
    with pytest.raises(RuntimeError):
        with atomic_file(str(path)) as f:
            f.write("half")
            raise RuntimeError("killed mid-write")
    assert path.read_text() == "old" and sorted(p.name for p in tmp_path.iterdir()) == ["summary.json"]
    with atomic_file(str(path)) as f:
        f.write("new")
    assert path.read_text() == "new"


def test_the_loop_freezes_what_exists_before_it_and_unfreezes_after():
    with garbage_frozen():
        frozen = gc.get_freeze_count()
        assert frozen > 0
        made_in_the_loop = [[] for _ in range(100)]
        assert gc.get_freeze_count() == frozen and made_in_the_loop  # what the loop makes stays collectable
    assert gc.get_freeze_count() == 0  # a process that trains again can collect everything


def test_pending_losses_are_written_into_one_buffer_made_before_the_loop():
    pending = PendingLosses(capacity=4, device=torch.device("cpu"))
    storage = pending.buffer.untyped_storage().data_ptr()
    for value in (2.5, 2.25, 2.0):
        pending.append(torch.tensor(value, requires_grad=True) * 1)  # a loss with autograd history
    taken = pending.take()
    assert taken.tolist() == [2.5, 2.25, 2.0] and not taken.requires_grad
    assert taken.untyped_storage().data_ptr() == storage  # no tensor kept per step
    pending.append(torch.tensor(1.5, dtype=torch.bfloat16))
    assert pending.take().tolist() == [1.5]  # counting starts again after a take


def test_the_rotation_table_gives_what_each_block_would_compute_and_grows_by_doubling():
    from framework.models.transformer import Rope

    rope = Rope(theta=10000.0, halves=True)
    rope.prepare(head_dim=16, positions=5, device=torch.device("cpu"))
    assert rope.table[0].shape == (8, 8)
    rope.prepare(head_dim=16, positions=8, device=torch.device("cpu"))
    assert rope.table[0].shape == (8, 8)  # covered: not made again
    # by hand: position p, pair i turns by p / theta^(2i / head_dim)
    angles = torch.tensor([[p / 10000.0 ** (2 * i / 16) for i in range(8)] for p in range(3, 11)], dtype=torch.float64)
    cos, sin = rope.cos_sin(16, start=3, length=4, device=torch.device("cpu"))
    torch.testing.assert_close(cos, angles[:4].cos().float(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(sin, angles[:4].sin().float(), rtol=1e-5, atol=1e-6)
    # beyond the table (a later pipeline stage that made none): computed in place, same values
    far_cos, far_sin = rope.cos_sin(16, start=6, length=5, device=torch.device("cpu"))
    torch.testing.assert_close(far_cos, angles[3:].cos().float(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(far_sin, angles[3:].sin().float(), rtol=1e-5, atol=1e-6)
    rope.prepare(head_dim=16, positions=9, device=torch.device("cpu"))
    assert rope.table[0].shape == (16, 8)
