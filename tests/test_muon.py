"""optim=muon: torch.optim.Muon's update for the hidden matrices beside AdamW for the rest, on
every mesh, each matrix orthogonalized whole once a step (framework.training.muon,
framework.parallel.whole_on_owners). The reference is torch's own Muon and AdamW in a plain
loop; a stacked expert weight gets torch's update matrix by matrix."""
import copy
import re

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from framework.config.errors import ConfigError
from framework.launch.local import launch_local, spawn_ranks
from framework.training.muon import Muon, muon_split, newton_schulz
from framework.validate import validate
from tests.conftest import TINY_LM, compose_config, run_cli
from tests.errors import max_relative_error
from tests.reference import reference_training

STEPS = 10
# lm_2d's tiny LM, 10 steps at a constant lr, the final weights checkpointed
MUON = [*TINY_LM, "optim=muon", "~optim.betas", f"trainer.max_steps={STEPS}", "trainer.log_every=5",
        "trainer.eval_every=null", "trainer.warmup_steps=0", "trainer.lr_decay=constant", "logger.tensorboard=false",
        f"checkpoint.every={STEPS}"]
MOE = ["recipe=lm_moe", "model=lm_moe_tiny", "plan=none", "parallel.ep_dims=[]", *MUON[2:]]
EXACT = ["optim.ns_dtype=float32"]  # (auto's choice on a CPU) the reference's Newton-Schulz in float32 too
# The hidden matrices, named by hand: attention and MLP projections, the shared expert's, the expert stacks
HIDDEN = re.compile(r"layers\.\d+\.(attention\.w[qkvo]\.weight|feed_forward\.(shared_expert\.)?w[123]\.weight"
                    r"|feed_forward\.experts\.w[123])")


class TorchMuonBesideAdamW:
    """torch.optim.Muon over the 2-D hidden matrices, torch's own single-tensor Muon update on
    each expert's matrix of a 3-D stack (torch.optim.Muon refuses 3-D), torch.optim.AdamW over
    the rest, with optim's options."""

    def __init__(self, model: torch.nn.Module, o):
        named = list(model.named_parameters())
        hidden = [p for n, p in named if HIDDEN.fullmatch(n)]
        self.options = dict(lr=o.lr, weight_decay=o.weight_decay, momentum=o.momentum, nesterov=o.nesterov,
                            ns_coefficients=tuple(o.ns_coefficients),
                            ns_steps=o.ns_steps, eps=o.eps, adjust_lr_fn=o.adjust_lr_fn)
        self.muon = torch.optim.Muon([p for p in hidden if p.ndim == 2], **self.options)
        self.stacks = [(p, torch.zeros_like(p)) for p in hidden if p.ndim == 3]
        self.adamw = torch.optim.AdamW([p for n, p in named if not HIDDEN.fullmatch(n)], lr=o.adamw.lr,
                                       betas=tuple(o.adamw.betas), eps=o.adamw.eps,
                                       weight_decay=o.adamw.weight_decay, fused=o.adamw.fused)

    def zero_grad(self):
        self.muon.zero_grad()
        self.adamw.zero_grad()
        for p, _ in self.stacks:
            p.grad = None

    @torch.no_grad()
    def step(self):
        self.adamw.step()
        self.muon.step()
        for p, buffer in self.stacks:
            for e in range(p.shape[0]):
                torch.optim._muon._single_tensor_muon([p[e]], [p.grad[e]], [buffer[e]], has_complex=False,
                                                      **self.options)


def newton_schulz_float32(grad, ns_coefficients, ns_steps, eps):
    """torch.optim.Muon's _zeropower_via_newtonschulz with float32 where it has bfloat16."""
    a, b, c = ns_coefficients
    x = grad.clone().float()
    if grad.size(0) > grad.size(1):
        x = x.T
    x.div_(x.norm().clamp(min=eps))
    for _ in range(ns_steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if grad.size(0) > grad.size(1) else x


def reference(cfg, monkeypatch, exact: bool) -> dict:
    if exact:
        monkeypatch.setattr(torch.optim._muon, "_zeropower_via_newtonschulz", newton_schulz_float32)
    return reference_training(cfg, optimizer_of=lambda model: TorchMuonBesideAdamW(model, cfg.optim))


def final_weights(out_dir) -> dict:
    dcp_to_torch_save(out_dir / "checkpoints" / f"step_{STEPS}", out_dir / "final.pt")
    return torch.load(out_dir / "final.pt", weights_only=False)


def weights_error(saved: dict, expected: dict) -> float:
    return max(((saved[name] - p).abs().max() / p.abs().max()).item() for name, p in expected.items())


def test_newton_schulz_is_torchs_op_for_op_and_a_stack_is_each_matrix():
    g = torch.Generator().manual_seed(0)
    for shape in ((24, 40), (40, 24), (16, 16)):
        matrix = torch.randn(shape, generator=g)
        ours = newton_schulz(matrix, 5, (3.4445, -4.7750, 2.0315), 1e-7, torch.bfloat16)
        assert torch.equal(ours, torch.optim._muon._zeropower_via_newtonschulz(matrix, (3.4445, -4.7750, 2.0315), 5,
                                                                               1e-7))
        assert torch.equal(newton_schulz(matrix, 5, (3.4445, -4.7750, 2.0315), 1e-7, torch.float32),
                           newton_schulz_float32(matrix, (3.4445, -4.7750, 2.0315), 5, 1e-7))
    stack = torch.randn(3, 8, 20, generator=g)
    whole = newton_schulz(stack, 5, (3.4445, -4.7750, 2.0315), 1e-7, torch.float32)
    for e in range(3):
        assert torch.equal(whole[e], newton_schulz_float32(stack[e], (3.4445, -4.7750, 2.0315), 5, 1e-7))
    before = stack.clone()
    newton_schulz(stack[0], 5, (3.4445, -4.7750, 2.0315), 1e-7, torch.float32)
    assert torch.equal(stack, before)  # never divides the caller's tensor (a momentum buffer) in place


def test_the_split_gives_muon_the_hidden_matrices_and_adamw_the_rest_patterns_move_them():
    moe = compose_config(MOE)
    from hydra.utils import instantiate
    model = instantiate(moe.model)
    muon, adamw = muon_split(model)
    assert [n for n, _ in muon] == [n for n, _ in model.named_parameters() if HIDDEN.fullmatch(n)]
    assert {why: [n for n, _ in pairs] for why, pairs in adamw.items()} == {
        "embeddings": ["tok_embeddings.weight"],
        "norms and biases": ["layers.0.attention_norm.weight", "layers.0.ffn_norm.weight",
                             "layers.1.attention_norm.weight", "layers.1.ffn_norm.weight", "norm.weight"],
        "routers": ["layers.0.feed_forward.gate.weight", "layers.1.feed_forward.gate.weight"],
        "output layer": ["output.weight"]}
    muon, adamw = muon_split(model, to_muon=[r"^output\."], to_adamw=[r"attention\.wo"])
    assert "output.weight" in [n for n, _ in muon]
    assert adamw["named in optim.to_adamw"] == [("layers.0.attention.wo.weight", model.layers[0].attention.wo.weight),
                                                ("layers.1.attention.wo.weight", model.layers[1].attention.wo.weight)]


def test_lora_adapters_stay_with_adamw_and_the_frozen_base_with_neither():
    from hydra.utils import instantiate

    from framework.models.lifecycle import adapt
    cfg = compose_config([*MUON, "adapter=lora"])
    model = instantiate(cfg.model)
    adapt(model, cfg.adapter, seed=0)
    muon, adamw = muon_split(model)
    assert muon == []  # every hidden matrix is frozen: no Muon side at all
    assert list(adamw) == ["adapters"]
    assert sorted(n for n, _ in adamw["adapters"]) == sorted(
        f"layers.{i}.attention.{w}.lora_{ab}.weight" for i in range(2) for w in ("wq", "wv") for ab in "AB")


@pytest.mark.parametrize("base", [MUON, MOE], ids=["dense", "moe"])
def test_steps_are_torchs_muon_beside_adamw_bit_for_bit(base):
    """On one process with the same gradients, bf16 Newton-Schulz as torch runs it: the same ops
    in the same order, so the same bits (a stack's experts each as torch's matrix)."""
    from hydra.utils import instantiate
    cfg = compose_config([*base, "mesh=1x1", "optim.ns_dtype=bfloat16"])
    torch.manual_seed(0)
    theirs = instantiate(cfg.model)
    ours = copy.deepcopy(theirs)
    reference_optimizer = TorchMuonBesideAdamW(theirs, cfg.optim)
    factory = instantiate(cfg.optim)
    optimizer = factory(Muon.groups_of(ours, **factory.keywords)[0])
    tokens = torch.randint(0, 256, (4, 32), generator=torch.Generator().manual_seed(1))
    start = copy.deepcopy(theirs)
    for _ in range(3):
        for model, o in ((theirs, reference_optimizer), (ours, optimizer)):
            o.zero_grad()
            model(tokens).logsumexp(-1).mean().backward()
            o.step()
        for (name, p), q in zip(theirs.named_parameters(), ours.parameters()):
            assert torch.equal(p, q), name
    assert all(not torch.equal(p, q) for p, q in zip(theirs.parameters(), start.parameters()))


@pytest.mark.parametrize("override,message", [
    ("optim.ns_steps=0", "config error: optim.ns_steps=0: Muon refuses it: ns_steps must be a whole number from 1 to 99"),
    ("optim.momentum=-0.5", "config error: optim.momentum=-0.5: Muon refuses it: momentum must be >= 0"),
    ("optim.weight_decay=-1", "config error: optim.weight_decay=-1: Muon refuses it: weight_decay must be >= 0"),
    ("optim.to_muon=[nothing_here]", "config error: optim.to_muon=['nothing_here']: 'nothing_here' matches no "
                                     "trainable parameter's name (re.search; they read like 'output.weight')"),
    ("optim.to_muon=[norm]", "config error: optim.to_muon=['norm']: 'norm' selects layers.0.attention_norm.weight of "
                             "shape [32]; Muon takes 2-D matrices and 3-D stacks of them: leave it to AdamW"),
    ("optim.ns_dtype=float16", "config error: optim.ns_dtype='float16': Muon refuses it: ns_dtype must be one of "
                               "bfloat16, float32, auto"),
])
def test_bad_muon_options_are_refused_naming_the_key(override, message):
    with pytest.raises(ConfigError) as error:
        validate(compose_config([*MUON, override]))
    assert str(error.value).startswith(message), str(error.value)


@pytest.mark.integration
def test_the_cli_refuses_a_bad_muon_option_in_one_line_before_launch(tmp_path):
    result = run_cli([*MUON, "optim.to_adamw=[nowhere]", f"hydra.run.dir={tmp_path}/run"])
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1].startswith("config error: optim.to_adamw=['nowhere']")
    assert not (tmp_path / "run").exists()


MESHES = [
    pytest.param(["mesh=1x1"], MUON, id="1x1"),  # (2x2 FSDP2 x TP: the resume test below)
    pytest.param(["mesh=2x1", "parallel.ep_dims=[dp]"], MOE, id="moe-ep-over-dp-2x1", marks=pytest.mark.integration),
    pytest.param(["mesh=1x1"], MOE, id="moe-1x1", marks=pytest.mark.integration),
    pytest.param(["mesh=2x1", "plan=none", "parallel.dp_strategy=fsdp"], MUON, id="fsdp-2x1",
                 marks=pytest.mark.integration),
    pytest.param(["mesh=1x2", "plan=lm_tp"], MUON, id="tp-1x2", marks=pytest.mark.integration),
    pytest.param(["mesh=2x2x1", "plan=none", "parallel.dp_strategy=hsdp"], MUON, id="hsdp-2x2x1",
                 marks=pytest.mark.integration),
    pytest.param(["mesh=pp2x2x1", "plan=none", "parallel.dp_strategy=fsdp"], MUON, id="pp2-fsdp2",
                 marks=pytest.mark.integration),
    pytest.param(["mesh=2x1", "parallel.ep_dims=[dp]", "parallel.dp_strategy=fsdp"], MOE,
                 id="moe-ep-fsdp-2x1", marks=pytest.mark.integration),
]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("mesh,base", MESHES)
def test_every_mesh_trains_what_one_process_trains(mesh, base, monkeypatch, tmp_path):
    """torch's Muon beside AdamW in one process, with Newton-Schulz in float32 on both sides: in
    bf16 a last-bit difference in a gradient (another reduction order, the framework's loss
    path against the reference's) flips a rounding, and the iteration grows it (one step of
    1x1 measured a weight 1.8e-5 off, ten steps 2% of the largest weight)."""
    expected = reference(compose_config([*base, *EXACT, "mesh=1x1", "plan=none", "parallel.ep_dims=[]"]),
                         monkeypatch, exact=True)
    summary = launch_local(compose_config([*base, *EXACT, *mesh]), str(tmp_path))
    loss_error = max_relative_error(summary["losses"], expected["losses"])
    weights = weights_error(final_weights(tmp_path)["model"], expected["params"])
    print(f"Muon {' '.join(mesh)} against one process: losses {loss_error:.2e}, weights {weights:.2e}")
    assert loss_error < 1e-5 and weights < 5e-5  # measured: 0 to 1.8e-7 and 1.3e-6 to 3.3e-6


def owners_exchange(bucket_bytes: int) -> dict:
    """Four ranks: tensors sharded every way a mesh leaves them (uneven, a rank holding nothing,
    both dims of a 2-D mesh, HSDP's replicated shards, an expert stack, a plain tensor); a
    function of each whole computed on its owner; each rank's part of the result back."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor, init_device_mesh

    from framework.parallel.whole_on_owners import WholeOnOwners
    from framework.training.muon import _flat_group

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("a", "b"))
    g = torch.Generator().manual_seed(0)
    cases = [(torch.randn(5, 3, generator=g), mesh["a"], [Shard(0)]),  # rows 3 and 2
             (torch.randn(1, 16, generator=g), mesh["b"], [Shard(0)]),  # rows 1 and 0
             (torch.randn(4, 6, generator=g), mesh, [Shard(0), Shard(1)]),
             (torch.randn(6, 4, generator=g), mesh, [Replicate(), Shard(0)]),
             (torch.randn(3, 4, 6, generator=g), mesh["a"], [Shard(0)]),
             (torch.randn(4, 5, generator=g), mesh, [Shard(1), Shard(1)]),  # columns 2, 1, 1, 1
             (torch.randn(3, 3, generator=g), None, None)]
    tensors = [whole if m is None else distribute_tensor(whole, m, p, src_data_rank=None) for whole, m, p in cases]
    calls, computed = [], []
    exchange = dist.all_to_all_single

    def counted(output, input, *args, **kwargs):
        calls.append(input.numel())
        return exchange(output, input, *args, **kwargs)

    def fn(whole):  # depends on every element of the whole: a part alone cannot give it
        computed.append(tuple(whole.shape))
        return whole.flip(0) * 2 + whole.sum()

    dist.all_to_all_single = counted
    layout = WholeOnOwners(tensors, _flat_group, bucket_bytes)
    parts = [t.to_local() if m is not None else t for t, (_, m, _) in zip(tensors, cases)]
    results = layout.apply(parts, fn, torch.float32)
    expected = [fn(whole) if m is None else distribute_tensor(fn(whole), m, p, src_data_rank=None).to_local()
                for whole, m, p in cases]
    computed.clear()
    calls.clear()
    results = layout.apply(parts, fn, torch.float32)
    dist.all_to_all_single = exchange
    equal = [torch.equal(r, e) for r, e in zip(results, expected)]
    dist.destroy_process_group()
    return {"equal": equal, "exchanges": len(calls) // 2, "computed": computed, "gathered": sum(calls[0::2])}


@pytest.mark.timeout(120)
def test_each_whole_is_computed_once_on_its_owner_and_every_rank_gets_its_part():
    for bucket_bytes, buckets in ((2 ** 20, 3), (1, 6)):  # a bucket per mesh; a tensor per bucket
        reports = spawn_ranks(4, owners_exchange, bucket_bytes)
        for report in reports.values():
            assert report["equal"] == [True] * 7
            assert report["exchanges"] == buckets  # one all_to_all each way a bucket
        computed = sorted(shape for report in reports.values() for shape in report["computed"])
        # each DTensor once on its mesh's ranks: once in all on the 2-D mesh, once in each of
        # the two 1-D meshes a dim of it makes (as a replicate DP's replicas each compute theirs);
        # the plain tensor by every rank
        assert computed == sorted([(4, 6), (6, 4), (4, 5)] + [(5, 3), (1, 16), (3, 4, 6)] * 2 + [(3, 3)] * 4)
        # every element travels to its owner once: HSDP's replicas send their shard once between them
        assert sum(report["gathered"] for report in reports.values()) == 4 * 6 + 6 * 4 + 4 * 5 + 2 * (5 * 3 + 16 + 72)


FSDP_TP = ["mesh=2x2", "plan=lm_tp", "parallel.dp_strategy=fsdp"]


@pytest.mark.timeout(300)
def test_fsdp2_x_tp_trains_what_one_process_trains_and_its_momentum_resumes_on_one_process(monkeypatch, tmp_path):
    """2x2 FSDP2 x TP (the matrices' shards _StridedShard x Shard on a 2-D mesh) against torch's
    Muon beside AdamW in one process; its step-5 checkpoint (Muon's momentum and AdamW's moments
    as DTensor shards in DCP) goes on in one process along the same curve."""
    expected = reference(compose_config([*MUON, *EXACT, "mesh=1x1"]), monkeypatch, exact=True)
    straight = launch_local(compose_config([*MUON, *EXACT, *FSDP_TP, "checkpoint.every=5"]), str(tmp_path / "2x2"))
    resumed = launch_local(compose_config([*MUON, *EXACT, "mesh=1x1", "plan=none", "checkpoint.every=5",
                                           f"checkpoint.resume={tmp_path}/2x2/checkpoints/step_5"]),
                           str(tmp_path / "1x1"))
    assert resumed["resumed_from"]["step"] == 5
    for name, run, out in (("2x2 FSDP2 x TP", straight, "2x2"), ("1x1 from its step 5", resumed, "1x1")):
        loss_error = max_relative_error(run["losses"], expected["losses"])
        weights = weights_error(final_weights(tmp_path / out)["model"], expected["params"])
        print(f"Muon {name} against one process: losses {loss_error:.2e}, weights {weights:.2e}")
        assert loss_error < 1e-5 and weights < 5e-5


@pytest.mark.integration
@pytest.mark.timeout(300)
def test_a_run_resumed_on_its_own_mesh_goes_on_bit_for_bit(tmp_path):
    straight = launch_local(compose_config([*MUON, *FSDP_TP, "checkpoint.every=5"]), str(tmp_path / "straight"))
    resumed = launch_local(compose_config([*MUON, *FSDP_TP, "checkpoint.every=5",
                                           f"checkpoint.resume={tmp_path}/straight/checkpoints/step_5"]),
                           str(tmp_path / "resumed"))
    assert resumed["resumed_from"]["step"] == 5
    assert resumed["losses"] == straight["losses"]
    saved = [final_weights(tmp_path / out) for out in ("straight", "resumed")]
    for name, value in saved[0]["model"].items():
        assert torch.equal(value, saved[1]["model"][name]), name
