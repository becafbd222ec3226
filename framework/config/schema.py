"""Typed schema of the composed config.

Registered in Hydra's ConfigStore as `config_schema` and listed first in conf/config.yaml's
defaults, so a wrong type or an unknown key fails when Hydra composes, before anything runs.
Hydra lets `+key=value` add a key the schema lacks; `unknown_key` finds those, and validation
refuses them before launch. Free-form nodes (`model`, `optim`, `data.dataset`, `objective`,
the plan's entries) are checked by framework.validate instead.
"""
import dataclasses
import difflib
import os
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Dict, List, Optional, Tuple

from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

# The builder's stages, in the only order it accepts (framework.training.builder runs them).
STAGES = [
    "distributed",
    "mesh",
    "model",
    "adapters",
    "float8",
    "pipeline_parallel",
    "data_parallel",
    "tensor_parallel",
    "expert_parallel",
    "context_parallel",
    "compile",
    "fully_shard",
    "weights",
    "sampler",
    "dataloader",
    "optimizer",
    "checkpoint",
    "objective",
    "trainer",
]


class DeviceType(str, Enum):
    auto = "auto"
    cpu = "cpu"
    cuda = "cuda"


class LRDecay(str, Enum):
    constant = "constant"
    cosine = "cosine"


class Precision(str, Enum):
    bf16 = "bf16"


class Compile(str, Enum):
    none = "none"
    blocks = "blocks"  # torch.compile each of the model's `layers` (framework.training.compile)


class DPStrategy(str, Enum):
    replicate = "replicate"  # DataParallel: a full copy per DP rank, gradients all-reduced
    fsdp = "fsdp"            # FSDP2 fully_shard over every DP rank
    hsdp = "hsdp"            # FSDP2 over (dp_replicate, dp): sharded within dp, replicated across


# torch.distributed.pipelining's schedules (framework.parallel.pipeline); the functional form
# because a member's name is what the config writes, and `1f1b` is not an identifier.
PPSchedule = Enum("PPSchedule", {name: name for name in ("gpipe", "1f1b", "interleaved_1f1b",
                                                          "interleaved_zero_bubble", "zbv_zero_bubble",
                                                          "dualpipev")}, type=str)


class Backend(str, Enum):
    auto = "auto"
    gloo = "gloo"
    nccl = "nccl"


@dataclass
class MeshConfig:
    shape: List[int] = field(default_factory=lambda: [2, 2])
    dim_names: List[str] = field(default_factory=lambda: ["dp", "tp"])
    device_type: DeviceType = DeviceType.auto  # auto: cuda when each local rank has a GPU, else cpu
    backend: Backend = Backend.auto
    # Ranks that share one host; null: all ranks of a self-launched run, LOCAL_WORLD_SIZE under torchrun.
    ranks_per_host: Optional[int] = None
    auto: bool = False  # mesh=auto: framework.train lets the planner choose (framework.planner.auto)


@dataclass
class ParallelConfig:
    dp_dim: Optional[str] = "dp"
    dp_replicate_dim: str = "dp_replicate"
    dp_strategy: DPStrategy = DPStrategy.replicate
    overlap_dp_sync: Optional[bool] = None  # null: on GPUs only
    tp_dim: Optional[str] = "tp"
    enforce_tp_innermost: bool = True
    allow_tp_across_hosts: bool = False
    pp_dim: Optional[str] = "pp"
    pp_schedule: PPSchedule = PPSchedule["1f1b"]
    pp_microbatches: Optional[int] = None
    pp_stages_per_rank: int = 1
    pp_layers_per_stage: Optional[List[int]] = None
    ep_dims: Optional[List[str]] = None
    cp_dim: Optional[str] = "cp"


@dataclass
class SamplerConfig:
    shuffle: bool = True
    seed: int = 0
    drop_last: bool = True


@dataclass
class DataConfig:
    global_batch_size: int = 24
    micro_batch_size: Optional[int] = None
    num_workers: int = 0
    path: Optional[str] = None  # prepared token data (data=tokens / instructions): framework.prepare's --out
    tokenizer: Optional[str] = None  # the tokenizer.json the model is meant for: other data is refused
    split: str = "train"  # data=hf: the dataset's split (a save_to_disk DatasetDict's, a Hub dataset's)
    name: Optional[str] = None  # data=hf: a Hub dataset's configuration (load_dataset's `name`)
    streaming: bool = False  # data=hf: read record by record (framework.data.stream) instead of indexed
    document_masking: bool = False  # packed token data: attention within each document (data=tokens sets it)
    dataset: Any = None


@dataclass
class TrainerConfig:
    max_steps: int = 500
    log_every: int = 10
    seed: int = 0
    grad_clip: Optional[float] = None
    warmup_steps: int = 0
    lr_decay: LRDecay = LRDecay.constant
    eval_every: Optional[int] = None
    eval_batches: int = 4
    peak_tflops: Optional[float] = None
    progress_bar: bool = True
    collective_timeout_s: int = 300
    stall_timeout_s: Optional[float] = 180
    mixed_precision: Optional[Precision] = None
    check_replicas_every: Optional[int] = 100
    compile: Compile = Compile.none
    profile_steps: int = 0
    memory_snapshot: bool = False  # a GPU allocator's history from the first step, dumped at the end (framework.training.memory)
    loss_chunk_tokens: Optional[int] = None  # the loss by chunks of N tokens (framework.training.objectives.chunked_loss); 0: whole logits; null: auto
    sweep_metric: Optional[str] = None  # what a sweep job returns to an optimizing sweeper (framework/hpo.py METRICS); null: val_loss


@dataclass
class CheckpointConfig:
    every: Optional[int] = None
    dir: Optional[str] = None
    keep_last: Optional[int] = None
    async_save: bool = False
    resume: Optional[str] = "auto"
    init_from: Optional[str] = None
    reset_data: bool = False
    final_hf: bool = False


@dataclass
class LauncherConfig:
    max_restarts: int = 0
    ranks_per_node: Optional[int] = None
    threads_per_rank: Optional[int] = None
    bind_cores: Optional[bool] = None
    fault_tolerance: Optional[str] = None
    lighthouse: Optional[str] = None
    ft_detection_s: float = 5.0


@dataclass
class VerifyConfig:
    steps: int = 3
    rtol: float = 1e-5
    atol: float = 1e-6
    report: Optional[str] = None


@dataclass
class DryrunConfig:
    ranks: List[int] = field(default_factory=lambda: [0])
    device_memory_gb: Optional[float] = None


@dataclass
class PlannerConfig:
    world: Optional[int] = None
    device: str = "cpu"
    device_memory_gb: Optional[float] = None
    calibration: Optional[str] = None
    dims: List[str] = field(default_factory=lambda: ["pp", "dp", "tp"])
    strategies: List[str] = field(default_factory=lambda: ["replicate", "fsdp", "hsdp"])


@dataclass
class AdapterConfig:
    kind: str = "none"  # none | lora | qlora (conf/adapter/)
    rank: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    targets: List[str] = field(default_factory=lambda: ["wq", "wv"])
    init_from: Optional[str] = None  # a PEFT adapter directory to start from
    block_size: int = 64  # qlora: NF4's quantization blocks
    scaler_block_size: int = 256


@dataclass
class RewardConfig:
    """What scores objective=grpo's completions (conf/reward/, framework.training.objectives.rewards)."""
    kind: str = "none"  # none | exact_match | regex | char_share | length | math_verify | file | combined
    marker: Optional[str] = None  # exact_match: the answer follows the last one (null: the whole completion)
    pattern: Optional[str] = None  # regex: 1.0 when re.search finds it; char_share: the class a character matches
    target_length: Optional[int] = None  # length: the best completion's length in characters
    file: Optional[str] = None  # file: a Python file, given on the command line only (framework.config.trust)
    function: Optional[str] = None  # file: its function(prompt, completion, answer) -> number
    # combined: the weighted sum of these, each {kind, weight, name, and its kind's keys}
    parts: List[Dict[str, Any]] = field(default_factory=list)


@dataclass
class EnvironmentConfig:
    """What answers objective=grpo's completions between turns (conf/environment/,
    framework.training.objectives.environments)."""
    kind: str = "none"  # none | calculator | guess_digit | file
    marker: Optional[str] = None  # the token a model's turn ends at, for the environment to answer (null: its own)
    max_turns: int = 3  # the model's turns an episode may take (the environment answers between two)
    timeout_s: float = 10.0  # the longest one answer may take; past it that completion fails (reward 0)
    file: Optional[str] = None  # file: a Python file, given on the command line only (framework.config.trust)
    name: Optional[str] = None  # file: the class in it (one instance an episode)


@dataclass
class WandbConfig:
    mode: str = "offline"
    project: str = "framework"
    name: Optional[str] = None
    group: Optional[str] = None
    tags: List[str] = field(default_factory=list)


@dataclass
class MlflowConfig:
    tracking_uri: Optional[str] = None
    experiment: Optional[str] = None
    log_checkpoints: bool = False


@dataclass
class LoggerConfig:
    tensorboard: bool = False  # conf/logger/tensorboard.yaml turns it on (the default group option)
    wandb: Optional[WandbConfig] = None  # logger=[...,wandb]
    mlflow: Optional[MlflowConfig] = None  # logger=[...,mlflow]


@dataclass
class Config:
    mesh: MeshConfig = field(default_factory=MeshConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    model: Any = None
    adapter: AdapterConfig = field(default_factory=AdapterConfig)  # conf/adapter/: LoRA, or none
    float8: Optional[str] = None  # a model conversion: tensorwise / rowwise float8 linear layers (framework.models.float8)
    # FQN pattern -> {style, options}; entries are checked by framework.parallel.plan.check_plan, which
    # names the bad key (a typed entry would refuse `+plan.NAME.style=...` on the command line).
    plan: Dict[str, Any] = field(default_factory=dict)
    sampler: SamplerConfig = field(default_factory=SamplerConfig)
    data: DataConfig = field(default_factory=DataConfig)
    objective: Any = None  # what a step optimizes (conf/objective/, framework.training.objectives)
    reward: RewardConfig = field(default_factory=RewardConfig)  # conf/reward/: what scores GRPO's completions
    environment: EnvironmentConfig = field(default_factory=EnvironmentConfig)  # conf/environment/: GRPO's turns
    optim: Any = None
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    launcher: LauncherConfig = field(default_factory=LauncherConfig)
    verify: VerifyConfig = field(default_factory=VerifyConfig)
    dryrun: DryrunConfig = field(default_factory=DryrunConfig)
    planner: PlannerConfig = field(default_factory=PlannerConfig)
    pipeline: List[str] = field(default_factory=lambda: list(STAGES))
    allowed_targets: List[str] = field(default_factory=lambda: ["framework", "torch.nn", "torch.optim"])


# Keys the launcher adds to the config it hands the ranks (framework.launch.handoff; `device`:
# framework.parallel.device.settle_device's record).
HANDED_TO_RANKS = ("overrides", "job", "device")


def _unknown_in(node: Any, schema: type, path: str) -> Optional[Tuple[str, List[str]]]:
    known = {f.name: f for f in dataclasses.fields(schema)}
    for key in node.keys():
        if schema is Config and key in HANDED_TO_RANKS:
            continue
        if key not in known:
            return f"{path}{key}", sorted(known)
        if dataclasses.is_dataclass(known[key].type) and hasattr(node[key], "keys"):
            found = _unknown_in(node[key], known[key].type, f"{path}{key}.")
            if found:
                return found
    return None


def unknown_key(cfg: Any) -> Optional[Tuple[str, List[str]]]:
    """The first key of a typed section that the schema does not have (a `+` override or a
    recipe's typo), with the keys its section has; None when every key is known."""
    return _unknown_in(cfg, Config, "")


def field_type(key: str) -> Any:
    """The schema's type of a dotted key (`trainer.memory_snapshot`), None where free-form or unknown."""
    schema: Any = Config
    for name in key.split("."):
        if not dataclasses.is_dataclass(schema):
            return None
        schema = {f.name: f.type for f in dataclasses.fields(schema)}.get(name)
    return schema


def section_keys(section: str) -> List[str]:
    """The keys of a typed section (`trainer`, `mesh`, ...; "" for the top), [] for a free-form one."""
    schema: Any = Config
    for name in filter(None, section.split(".")):
        schema = {f.name: f.type for f in dataclasses.fields(schema)}.get(name)
        if not dataclasses.is_dataclass(schema):
            return []
    return sorted(f.name for f in dataclasses.fields(schema))


# Keys that moved, and where to: a config that still sets one is told, not just refused.
MOVED = {"data.loss": "the loss moved to the objective group: objective=lm (next-token cross entropy) or "
                      "objective=mse, their options as objective.<key> (conf/objective/)",
         "trainer.float8": "float8, a conversion of the model, moved to the top level: float8=tensorwise or "
                           "float8=rowwise"}


def did_you_mean(key: str, known: List[str]) -> str:
    """`did you mean trainer.max_steps?` for a misspelled key (or where a moved key went), else
    the section's keys."""
    if key in MOVED:
        return MOVED[key]
    section, _, name = key.rpartition(".")
    prefix = f"{section}." if section else ""
    close = difflib.get_close_matches(name, known, n=1)
    if close:
        return f"did you mean {prefix}{close[0]}?"
    return f"{section or 'the config'} has {', '.join(known)}"


def _packaged(path: str) -> str:
    """`${packaged:prompts/lowercase}`: a path inside the installed package, so a recipe's shipped
    data (framework/prompts/) is found from any working directory."""
    return os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), path)


def _hf_text_reader(streaming: bool) -> str:
    """`${hf_text_reader:${data.streaming}}`: data=hf's dataset class, indexed or streamed."""
    return "framework.data.HFTokenStream" if streaming else "framework.data.HFTokenDataset"


def register_schema() -> None:
    """The schema, and the resolvers configs may use that read no data (framework.cli registers
    the one that does, `${tokens_vocab:...}`, where the config is composed)."""
    store = ConfigStore.instance()
    if "config_schema.yaml" not in store.repo:  # once: making it from the dataclasses takes ~50 ms
        store.store(name="config_schema", node=Config)
    if not OmegaConf.has_resolver("hf_text_reader"):
        OmegaConf.register_new_resolver("hf_text_reader", _hf_text_reader)
    if not OmegaConf.has_resolver("packaged"):
        OmegaConf.register_new_resolver("packaged", _packaged)
