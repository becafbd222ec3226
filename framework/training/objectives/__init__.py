"""What a step optimizes: the `objective` config group (conf/objective/), one module a concern.

base (the Objective and StepShare, the auxiliary terms), lm (objective=lm, mse), logps
(per-token and per-sequence log-probabilities), chunked_loss (the output projection: logits at
the counted targets, by chunks of tokens), reference (DPO's, KTO's and GRPO's reference model),
preference (objective=dpo, simpo, kto), grpo and rollout (objective=grpo, its generation phase),
rewards (the `reward` group that scores GRPO's completions).
"""
