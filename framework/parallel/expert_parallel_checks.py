"""Expert parallelism's checks before launch (framework.parallel.expert_parallel applies it):
what the experts need of the model, the plan and the mesh. Light: the launcher imports it."""
from framework.config.checked import Checked
from framework.config.errors import ConfigError
from framework.models.protocol import offered


def check_expert_parallel(c: Checked) -> None:
    """What the experts and their parallelism need of the model, the plan and the mesh."""
    model, plan, roles = c.model, c.plan, c.roles
    experts, ep_dims, ep_size = offered(model).expert_modules(), list(roles.ep_dims), roles.ep_size
    if ep_dims and not experts:
        raise ConfigError("parallel.ep_dims", ep_dims, f"spreads experts, and {type(model).__name__} has no "
                                                       f"mixture-of-experts blocks; set it to null")
    if not experts:
        return
    if experts[0].n_experts % ep_size:
        raise ConfigError("parallel.ep_dims", ep_dims, f"the EP size {ep_size} must divide the "
                                                       f"{experts[0].n_experts} experts of each block")
    for key, entry in plan.items():
        if entry.get("style") == "sequence_parallel" and key.split(".")[-1] == "ffn_norm":
            raise ConfigError(f"plan.{key}.style", "sequence_parallel", "would hand the mixture-of-experts blocks "
                                                                        "sequence shards, which they do not take yet; "
                                                                        "use a plan without SP (plan=lm_moe_tp)")
