"""Every bad config is refused before launch with one message naming key, value and fix."""
import pytest
import torch

from framework.config.errors import ConfigError
from framework.validate import validate
from tests.conftest import TEST_MODELS, compose_config, run_cli

BAD_CONFIGS = [
    (["mesh.dim_names=[dp]"], r"mesh.dim_names=\['dp'\]: give one name per dim of mesh.shape=\[2, 2\]"),
    (["mesh.dim_names=[dp,dp]"], r"mesh.dim_names=\['dp', 'dp'\]: dim names must be unique"),
    (["mesh.shape=[0,2]"], r"mesh.shape=\[0, 2\]: dim 'dp' has size 0; every size must be >= 1"),
    (["parallel.dp_dim=data"], r"parallel.dp_dim='data': name one of the mesh dims \['dp', 'tp'\], or null"),
    (["parallel.tp_dim=model"], r"parallel.tp_dim='model': name one of the mesh dims"),
    (["mesh.shape=[2,2,2]", "mesh.dim_names=[dp,tp,ep]"], r"dim 'ep' has size 2 but no role; set parallel.dp_dim, parallel.tp_dim, "
                                                          r"parallel.cp_dim or parallel.pp_dim to it"),
    (["mesh.dim_names=[tp,dp]"],
     r"mesh.dim_names=\['tp', 'dp'\]: the TP dim 'tp' must be innermost .* parallel.enforce_tp_innermost=false"),
    (["mesh.ranks_per_host=1"],
     r"mesh.shape=\[2, 2\]: TP group \[0, 1\] spans hosts \[0, 1\] \(1 ranks per host\).*allow_tp_across_hosts=true"),
    (["+plan.net9.style=colwise"],
     r"plan.net9='net9': it matches no module of the model; its modules are: net1, relu, net2, net3"),
    (["+plan.relu.style=colwise"],
     r"plan.relu.style='colwise': relu is a ReLU; colwise applies only to nn.Linear and nn.Embedding"),
    (["plan.net1.style=diagonal"], r"plan.net1.style='diagonal': use one of: colwise, rowwise, sequence_parallel"),
    (["plan.net3.output_layouts=replicated"],
     r"plan.net3.output_layouts='replicated': write a layout as replicate, shard\(D\) or null"),
    (["+plan.net1.sequence_dim=1"], r"plan.net1.sequence_dim=1: colwise does not take sequence_dim"),
    (["+plan.net1.output_layout=replicate"], r"plan.net1.output_layout='replicate': not a plan option"),
    (["mesh=1x4", "model.hidden_dim=30"],
     r"plan.net1=.colwise.: colwise shards net1.out_features=30, which the TP size 4 does not divide"),
    (["data.global_batch_size=25"],
     r"data.global_batch_size=25: must be a positive multiple of the DP size 2"),
    (["data.global_batch_size=3000"], r"the dataset.s train split has only 1536 samples"),
    (["model._target_=os.system"], r"model._target_='os.system': only targets under .* may be instantiated"),
    (["optim._target_=subprocess.call"], r"optim._target_='subprocess.call'"),
    (["pipeline=[distributed,mesh,model,tensor_parallel,data_parallel]"],
     r"pipeline=.*: tensor_parallel must come after data_parallel: DP is the outer wrapper"),
    (["pipeline=[mesh,distributed]"], r"pipeline=.*: the stages run in the fixed order"),
    (["+optim.betas=[0.9,0.95]"], r"optim.betas=\[0.9, 0.95\]: SGD takes no such option; remove it: ~optim.betas"),
    (["recipe=lm_2d", "optim=muon"], r"optim.betas=\[0.9, 0.95\]: Muon takes no such option \(its AdamW side's go "
                                     r"under optim.adamw: optim.adamw.betas\); remove it: ~optim.betas on the command"),
    (["trainer.eval_every=5"], r"trainer.eval_every=5: framework.data.SyntheticRegression has no `split` argument"),
    (["mesh.ranks_per_host=0"], r"mesh.ranks_per_host=0: must be >= 1"),
    (["launcher.threads_per_rank=0"], r"launcher.threads_per_rank=0: must be >= 1, or null"),
    # `+` adds a key the schema lacks (Hydra's own hint for a typo): ignored, it would train something else
    (["+parallel.dp_stratgy=fsdp"], r"parallel.dp_stratgy='fsdp': no such key; did you mean parallel.dp_strategy\?"),
    (["+trainer.mixed_precison=bf16"],
     r"trainer.mixed_precison='bf16': no such key; did you mean trainer.mixed_precision\?"),
    (["+checkpoint.zzz=1"], r"checkpoint.zzz=1: no such key; checkpoint has async_save, dir, every, final_hf, init_from"),
    (["+trainr.max_steps=3"], r"trainr=\{'max_steps': 3\}: no such key; did you mean trainer\?"),
    (["model=lm_tiny", "data=byte_corpus", "plan=none", "model._target_=framework.transformer.Transformer"],
     r"model._target_='framework.transformer.Transformer': this module moved; use framework.models.Transformer"),
    (["model=lm_tiny", "data=byte_corpus", "plan=none", "data.dataset._target_=framework.corpus.ByteCorpus"],
     r"data.dataset._target_='framework.corpus.ByteCorpus': this module moved; use framework.data.ByteCorpus"),
    (["trainer.grad_clip=0"], r"trainer.grad_clip=0.0: must be > 0"),
    (["mesh.backend=nccl"], r"mesh.backend='nccl': nccl needs mesh.device_type=cuda"),
    (["optim.lr=-1"], r"optim.lr=-1: SGD refuses it: Invalid learning rate: -1$"),
    (["optim=adamw", "+optim.betas=[2,0.9]"], r"optim.betas=\[2, 0.9\]: AdamW refuses it: Invalid beta parameter at index 0"),
    (["optim=adamw", "optim.fused=yes"], r"optim.fused='yes': must be true or false$"),  # torch takes any truthy value
    (["+optim.nesterov=1"], r"optim.nesterov=1: must be true or false$"),
    (["plan.net3.output_layouts=null"],
     r"plan.net3=.*: colwise leaves the model's output \(net3\) as local shards \(shard\(-1\)\) on each of the 2 TP "
     r"ranks, so the loss would see only a slice of it; set output_layouts: replicate, or output_layouts: shard\(-1\) "
     r"with use_local_output: false"),
    (["recipe=lm_2d", "plan=lm_tp_sp_loss_parallel", "plan.output.use_local_output=true"],
     r"plan.output=.*: colwise leaves the model's output \(output\) as local shards"),
    (["launcher.ranks_per_node=3"], r"launcher.ranks_per_node=3: must divide the mesh size 4 \(mesh.shape=\[2, 2\]\)"),
    (["launcher.ranks_per_node=2", "mesh.ranks_per_host=4"],
     r"launcher.ranks_per_node=2: differs from mesh.ranks_per_host=4; both say how many ranks share a node"),
    (["data.micro_batch_size=5"],
     r"data.micro_batch_size=5: must divide the per-replica batch 12 \(data.global_batch_size=24 over DP size 2\)"),
    (["+model.activation_checkpointing=full"],
     r"model.activation_checkpointing='full': framework.models.SeedMLP has no blocks to recompute"),
    (["recipe=lm_2d", "model.activation_checkpointing=some"],
     r"model.activation_checkpointing='some': use none, or full to recompute every block's activations"),
    (["parallel.dp_strategy=hsdp"],
     r"parallel.dp_strategy='hsdp': needs two DP dims, parallel.dp_replicate_dim='dp_replicate' \(replicas\) outside "
     r"parallel.dp_dim='dp' \(shards\), and mesh.dim_names=\['dp', 'tp'\] has \['dp'\]; use mesh=2x2x1 or mesh=2x1x2"),
    (["mesh=1x2", "parallel.dp_dim=null", "parallel.dp_strategy=fsdp"],
     r"parallel.dp_strategy='fsdp': shards over the DP ranks, and parallel.dp_dim is null; name a DP mesh dim"),
    (["pipeline=[distributed,mesh,model,data_parallel,fully_shard,tensor_parallel]"],
     r"pipeline=.*: fully_shard must come after tensor_parallel: torch's fully_shard shards the DTensor parameters "
     r"TP made"),
    (["mesh=2x2x1", "mesh.dim_names=[dp,dp_replicate,tp]"],
     r"mesh.dim_names=\['dp', 'dp_replicate', 'tp'\]: the DP replica dim 'dp_replicate' .* needs the DP dim "
     r"parallel.dp_dim='dp' inside it"),
    (["mesh=2x2x1", "data.global_batch_size=6"], r"data.global_batch_size=6: must be a positive multiple of the DP size 4"),
    (["trainer.stall_timeout_s=300"],
     r"trainer.stall_timeout_s=300.0: must be > 0 and below trainer.collective_timeout_s=300"),
]


@pytest.mark.parametrize("overrides,message", BAD_CONFIGS, ids=[" ".join(o) for o, _ in BAD_CONFIGS])
def test_bad_config_is_refused_with_key_value_and_fix(overrides, message):
    with pytest.raises(ConfigError, match=message):
        validate(compose_config(overrides))


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_cuda_without_a_gpu_is_refused_before_any_rank_starts():
    with pytest.raises(ConfigError, match=r"mesh.device_type='cuda': torch sees no CUDA device here .*; use "
                                          r"mesh.device_type=cpu"):
        validate(compose_config(["mesh.device_type=cuda"]))


@pytest.mark.parametrize("overrides", [
    ["recipe=lm_2d", "plan=lm_tp_sp_loss_parallel"],
    ["mesh.dim_names=[tp,dp]", "parallel.enforce_tp_innermost=false"],
    ["mesh.ranks_per_host=1", "parallel.allow_tp_across_hosts=true"],
    ["mesh.ranks_per_host=2"],
    ["mesh.dim_names=[col,row]", "parallel.dp_dim=col", "parallel.tp_dim=row"],
    [TEST_MODELS, "model._target_=tests.workers.FailOnRank"],
    ["mesh=2x2x1", "parallel.dp_strategy=hsdp"],
    ["mesh=2x1x2", "parallel.dp_strategy=hsdp"],
    ["mesh=2x2x1", "parallel.dp_strategy=fsdp"],
    ["mesh=2x2x1"],
])
def test_explicit_opt_outs_and_renamed_roles_are_accepted(overrides):
    validate(compose_config(overrides))


def test_world_size_must_match_the_mesh():
    with pytest.raises(ConfigError, match=r"mesh.shape=\[2, 2\]: its 4 positions differ from the launched world size 3"):
        validate(compose_config(), world_size=3)


def test_cli_refuses_bad_config_in_one_line_before_starting_anything(tmp_path):
    out = tmp_path / "run"
    result = run_cli(["plan.net1.style=diagonal", f"hydra.run.dir={out}"], timeout=120)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1].startswith("config error: plan.net1.style='diagonal'")
    assert "Traceback" not in result.stderr
    assert "DeviceMesh" not in result.stdout  # no rank ever started
    assert not out.exists()  # the job's dir is not left half-made


@pytest.mark.timeout(180)
def test_a_truncated_checkpoint_metadata_says_which_checkpoint_to_resume_from(tmp_path):
    """A save cut short in .metadata: the refusal names the checkpoint before it, not only the pickle error."""
    run = ["mesh=1x1", "trainer.max_steps=2", "checkpoint.every=1", "trainer.progress_bar=false",
           f"hydra.run.dir={tmp_path}"]
    assert run_cli(run, timeout=170).returncode == 0
    metadata = tmp_path / "checkpoints" / "step_2" / ".metadata"
    metadata.write_bytes(metadata.read_bytes()[: metadata.stat().st_size // 2])
    result = run_cli([*run[:1], "trainer.max_steps=3", *run[2:]], timeout=170)
    step_1, step_2 = tmp_path / "checkpoints" / "step_1", tmp_path / "checkpoints" / "step_2"
    assert result.returncode == 2 and result.stderr.strip() == (
        f"config error: checkpoint.resume='auto': checkpoint {step_2}: unreadable .metadata (UnpicklingError: pickle "
        f"data was truncated); the save was cut short or the file is not a DCP checkpoint's: delete {step_2} "
        f"(checkpoint.resume=auto then takes the one before it) or give checkpoint.resume={step_1}"), result.stderr
