"""What a run holds as the builder's stages fill it in (framework.training.builder), and what
the loop reads. Its own module, so the builder and the loop both import it and not each other."""
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

from omegaconf import DictConfig
from torch import nn

from framework.checkpoint.weights import Start
from framework.parallel.data_parallel import DataParallel, NoGradientSync
from framework.parallel.device import Device
from framework.parallel.fault_tolerance import NoFaultTolerance
from framework.parallel.roles import MeshRoles


@dataclass
class Run:
    cfg: DictConfig
    out_dir: str
    meta_only: bool = False  # the dry run: the model stays on meta (shapes, no storage, no weights read)
    rank: int = 0
    device: Optional[Device] = None  # where it computes, settled once (framework.parallel.device)
    mesh: Any = None
    # the ranks that hold the same weights and other tokens, as one 1-D mesh: the DP dims (two
    # flattened) and a cp dim (MeshRoles.dp_cp_mesh); gradients average and losses count over it
    dp_cp_mesh: Any = None
    dp_cp: Dict[str, int] = field(default_factory=dict)  # {"size", "rank"} on dp_cp_mesh
    samples: Dict[str, int] = field(default_factory=dict)  # {"size", "rank"} of the DP replicas the sampler serves
    tp: Dict[str, int] = field(default_factory=dict)
    pp: Dict[str, int] = field(default_factory=dict)  # {"size", "rank"} on the pp dim, with pipeline parallelism
    stages: List[Tuple[int, Any]] = field(default_factory=list)  # this rank's (stage index, StageModule)
    model: Any = None  # what the loop calls: DataParallel's wrapper (replicate) or the model (fsdp, hsdp)
    # how the DP strategy's gradient sync meets micro-batches and pipeline schedules (the DP stages set it)
    gradient_sync: Any = field(default_factory=NoGradientSync)
    dataset: Any = None
    sampler: Any = None
    dataloader: Any = None
    val_dataloader: Any = None  # only with trainer.eval_every
    objective: Any = None  # framework.training.objectives: what a step optimizes
    optimizer: Any = None
    scheduler: Any = None
    state: Any = None  # framework.training.state.TrainState: step, data position, history
    start: Start = field(default_factory=Start)  # what the run starts from (the weights stage's choice)
    checkpointer: Any = None  # framework.checkpoint.manager.Checkpointer
    resumed: Any = None  # framework.checkpoint.manager.Resumed, when the run continues a checkpoint
    summary: Optional[dict] = None
    # launcher.fault_tolerance (framework.parallel.fault_tolerance): the loop's hooks; torchft's replica groups
    fault_tolerance: Any = field(default_factory=NoFaultTolerance)
    # which mesh dim plays which role: read from cfg once, when the run is made (verify's
    # one-process reference clears the roles in its cfg before)
    roles: MeshRoles = field(init=False)

    def __post_init__(self) -> None:
        self.roles = MeshRoles.from_config(self.cfg)


    @property
    def module(self) -> nn.Module:
        """The model itself, whose parameters (DTensor shards included) the optimizer, grad
        clipping and checkpoints see: DataParallel's `.module`, or the fully_shard-ed model."""
        return self.model.module if isinstance(self.model, DataParallel) else self.model

    @module.setter
    def module(self, module: nn.Module) -> None:
        if isinstance(self.model, DataParallel):
            self.model.module = module
        else:
            self.model = module

    @property
    def pp_group(self):
        return self.roles.pp_mesh(self.mesh).get_group() if self.pp else None

    @property
    def stage_group(self):
        """The ranks of this rank's pipeline stage (every dim but pp); None without pp."""
        stage = self.roles.stage_mesh(self.mesh) if self.pp else None
        return None if stage is None else stage.get_group()

    @property
    def dp_cp_group(self):
        return None if self.dp_cp_mesh is None else self.dp_cp_mesh.get_group()

    def group_labels(self) -> Dict[str, str]:
        """Process-group name -> what reports call it: each mesh dim's name, and the DP group
        flattened from two dims (or DP and cp), and EP's over several dims, by its flattened name
        (`dp_replicate_dp`, `dp_cp`, `dp_tp`)."""
        # a mesh dim's own name wins for the flattened group over the same ranks (dp=1 x cp: cp's)
        flattened = [self.dp_cp_mesh, self.roles.ep_mesh(self.mesh)]
        meshes = [mesh for mesh in flattened if mesh is not None] + [self.mesh[dim] for dim in self.mesh.mesh_dim_names]
        return {mesh.get_group().group_name: mesh.mesh_dim_names[0] for mesh in meshes}
