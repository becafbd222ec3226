"""objective=grpo's generation phase (framework.training.objectives.grpo): every DP replica
continues each of its prompts group_size times with the model as it trains (the framework's
KV-cache decoder, framework.models.decode), scores the completions with the reward and makes
each one's advantage; with beta > 0 the reference's per-token log-probabilities, with
num_iterations > 1 the old policy's. With an environment (environment=..., framework.training.
objectives.environments) completions are decoded in turns (framework.training.objectives.turns)
and the environment's answers are inputs the loss leaves out."""
import time
from contextlib import nullcontext
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
from omegaconf import OmegaConf
from torch import nn

from framework.data.batch import Batch
from framework.data.tokenizer import load_tokenizer
from framework.data.batch import IGNORE
from framework.models.decode import compiled_step, decoding_generators, generate_groups, stop_ids
from framework.models.protocol import offered
from framework.parallel.plan import shards_sequence
from framework.training.objectives.logps import token_logps
from framework.parallel.dtensors import reshard
from framework.training.objectives.environments import make_environment
from framework.training.objectives.staleness import StalePolicy
from framework.training.objectives.rewards import make_reward
from framework.training.objectives.turns import take_turns

ROLLOUT_METRICS = ("reward", "reward_std", "frac_reward_zero_std", "completions/mean_length",
                   "completions/max_length", "completions/clipped_ratio", "clip_ratio")
ENVIRONMENT_METRICS = ("environment/turns", "environment/failures")
STD_FLOOR = 1e-4  # TRL's: advantages over (std + this)


def sampling_seed(seed: int, step: int, index: int) -> int:
    """The seed of a prompt's completions at a step: a function of the three alone, the same on
    every mesh, after a resume and under any Python."""
    return ((seed * 1_000_003 + step) * 1_000_003 + index) % (1 << 62)


def group_advantages(rewards: torch.Tensor, group_size: int, scale: str,
                     batch_std: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Rewards (completions,), each group's `group_size` in a row, less their group's mean, over
    the group's std (unbiased, as TRL's nanstd), `batch_std` or 1 (`scale`), plus STD_FLOOR."""
    grouped = rewards.view(-1, group_size)
    centred = (grouped - grouped.mean(1, keepdim=True)).flatten()
    if scale == "none":
        return centred
    std = grouped.std(1).repeat_interleave(group_size) if scale == "group" else batch_std.expand_as(rewards)
    return centred / (std + STD_FLOOR)


class GroupRollout:
    """GroupRelativePolicy's generation phase: its settings are the objective's (objective.*,
    set by GroupRelativePolicy), what it reads of the run is set up here."""

    def setup_rollout(self, context) -> None:
        """The reward, the tokenizer that turns ids into the texts it scores, the stop ids, the
        groups it talks to, and the compiled decode step (compile_decode), from the objective's
        context (framework.training.objectives.context)."""
        cfg, tp = context.cfg, context.tp
        self.tokenizer = load_tokenizer(cfg.data.get("tokenizer") or context.dataset.documents.tokenizer["path"])
        self.stop = stop_ids(offered(context.module).hf_path, self.tokenizer)
        self.environment = make_environment(cfg.get("environment"))
        scores = self.environment is not None and self.environment.scores  # (the environment's own reward)
        self.reward = None if scores else make_reward(cfg.reward)
        self.episodes = None  # (the rollout's, on the rank that runs the environment)
        if self.environment is not None:
            self.marker = self.tokenizer.encode_batch([self.environment.marker])[0][0]
        self.pad_id = context.dataset.pad_id
        self.seed, self.device = cfg.trainer.seed, torch.device(context.device.type)
        self.replicas, self.replica_group = context.replicas.size, context.replicas.group
        if tp.size > 1:
            self.tp_group = tp.group
        self.sharded = cfg.parallel.dp_strategy != "replicate"
        self.micro_batch = cfg.data.micro_batch_size
        plan = OmegaConf.to_container(cfg.plan, resolve=True) if cfg.plan else {}
        self.block = tp.size if shards_sequence(plan) else 1  # (generate_groups' `block`)
        self.stale = StalePolicy(self.max_staleness) if self.max_staleness > 0 else None
        plain = not self.sharded and tp.size == 1
        if self.compile_decode if self.compile_decode is not None else self.device.type == "cuda" and plain:
            self.step = compiled_step(self.device)

    @torch.no_grad()
    def rollout(self, model: nn.Module, batch: Batch, step: int) -> Batch:
        """The prompts' completions as a batch to learn from (`generated`), or with num_iterations
        k > 1, within k steps of the last rollout, that rollout again."""
        self._ratio_max = torch.zeros((), dtype=torch.float64, device=self.device)  # (the step's largest ratio so far)
        if self._cycle is not None and 0 < step - self._cycle[0] < self.num_iterations:
            start = time.perf_counter()
            _, rolled_out, self._rollout_terms = self._cycle
            self._rollout_terms = dict(self._rollout_terms)
            self.rollout_s.append(time.perf_counter() - start)
            return rolled_out
        rolled_out = self.generated(model, batch, step)
        if self.num_iterations > 1:
            self._cycle = (step, rolled_out, dict(self._rollout_terms))
        return rolled_out

    def generated(self, model: nn.Module, batch: Batch, step: int) -> Batch:
        """The prompts' completions as a batch to learn from, a prompt's group together as DPO's
        pairs are (so micro-batches count prompts and never part a group): inputs (prompts,
        group_size, seq_len) each prompt + completion (padded), targets the completion's tokens (the
        rest -100), each completion's advantage (prompts, group_size), with beta > 0 the
        reference's per-token log-probabilities, with num_iterations > 1 the policy's."""
        start = time.perf_counter()
        rows, answer_rows = batch.inputs.cpu(), batch.targets.cpu()
        prompts = [row[row != IGNORE].tolist() for row in rows]
        answers = [self.tokenizer.decode(row[row != IGNORE].tolist()) or None for row in answer_rows]
        width, n = batch.inputs.shape[1], self.group_size
        generators = decoding_generators([sampling_seed(self.seed, step, index) for index in batch.index.tolist()],
                                         self.device)
        model.eval()
        if self.stale is not None:
            self.stale.record(model, step)
        with self.stale.generating(model, step) if self.stale is not None else nullcontext(0) as staleness:
            if self.environment is None:
                drawn = generate_groups(model, prompts, n, self.max_new_tokens, self.temperature, self.top_p,
                                        generators, self.stop, self.pad_id, self.device,
                                        stop_early=not self.sharded, block=self.block, last_only=self.select,
                                        capacity=width + self.block if self.step else None, step=self.step,
                                        with_logps=self.correct)
                tokens, counts = drawn[0].cpu(), drawn[1].cpu()  # the decoder's one transfer (two with logps)
                completions = [tokens[r, :length].tolist() for r, length in enumerate(counts.tolist())]
                logps = [row[:length].tolist() for row, length in zip(drawn[2].cpu(), counts.tolist())] \
                    if self.correct else None
                written = None
            else:
                completions, written, logps = self._in_turns(model, prompts, answers, generators, width, step,
                                                             batch.index.tolist())
        model.train()
        if self.sharded:
            reshard(model)
        inputs, targets, texts = self._sequences(prompts, completions, written, width)
        prompt_texts = [self.tokenizer.decode(p) for p in prompts for _ in range(n)]
        scores, curves = self._scored(prompt_texts, texts, [a for a in answers for _ in range(n)])
        rewards = torch.tensor(scores, dtype=torch.float64)
        advantages = group_advantages(rewards, n, self.scale_rewards, self._batch_std(rewards))
        lengths = torch.tensor([len(completion) for completion in completions], dtype=torch.float64)
        self._note_rollout(rewards, curves, lengths, targets)
        self._samples = "\n\n".join(f"{prompt_text!r} -> {text!r} (reward {reward:.4g})"
                                     for prompt_text, text, reward in zip(prompt_texts[:n], texts[:n], rewards.tolist()))
        reference = old = None
        if self.reference is not None:
            reference = self._logps(lambda rows, counted: self.reference.logits(model, rows, counted), model, inputs,
                                    targets)
        if self.num_iterations > 1:
            old = self._logps(lambda rows, counted: self.head(model, rows, counted, per_token=True), model,
                              inputs, targets)
        sampled = self._sampled(logps, prompts, targets) if self.correct else None
        if self.stale is not None:
            self._rollout_terms["staleness"] = torch.tensor(float(staleness), dtype=torch.float64)
        self.rollout_s.append(time.perf_counter() - start)
        grouped = (len(prompts), n, width)
        return Batch(inputs.view(grouped), targets.view(grouped),
                     reference=reference.view(grouped) if reference is not None else None,
                     advantages=advantages.float().to(self.device).view(grouped[:2]),
                     old_logps=old.view(grouped) if old is not None else None,
                     sampled_logps=sampled.view(grouped) if sampled is not None else None)

    def _sampled(self, logps: List[List[float]], prompts: List[List[int]], targets: torch.Tensor) -> torch.Tensor:
        """Each completion token's log-probability as the decoder drew it, where its target is
        (0 elsewhere): what the sampling correction weighs the learner against."""
        sampled = torch.zeros(targets.shape, dtype=torch.float32)
        for r, row in enumerate(logps):
            start = len(prompts[r // self.group_size]) - 1
            sampled[r, start:start + len(row)] = torch.tensor(row, dtype=torch.float32)
        return sampled.to(targets.device)

    def _in_turns(self, model: nn.Module, prompts: List[List[int]], answers: List[Optional[str]],
                  generators: List[torch.Generator], width: int, step: int,
                  indices: List[int]) -> Tuple[List[List[int]], List[List[bool]], List[List[float]]]:
        """Each completion decoded in turns with the environment (take_turns): its tokens, which
        of them the model wrote, and their log-probabilities as drawn. The first turn is sampled as without one (the prompts'
        generators); a later turn of a completion from a generator of its own, seeded by the
        step, the prompt's index, its place in the group and the turn (the same on every mesh).
        Under TP the environment runs on the group's rank 0 (`_led`), as the reward does."""
        n, stop = self.group_size, self.stop | {self.marker}
        rows = [p for p in prompts for _ in range(n)]
        prompt_texts = [self.tokenizer.decode(p) for p in rows]
        self._led(lambda: self._start_episodes(prompt_texts, [a for a in answers for _ in range(n)]))
        capacity = width + self.max_new_tokens + self.block  # (one shape for every turn: a compiled step's)

        def decoded(histories: List[List[int]], row_generators: List[torch.Generator], group: int,
                    new_tokens: int) -> Tuple[List[List[int]], List[List[float]]]:
            tokens, counts, logps = generate_groups(model, histories, group, new_tokens, self.temperature,
                                                    self.top_p, row_generators, stop, self.pad_id, self.device,
                                                    stop_early=not self.sharded, block=self.block,
                                                    last_only=self.select, capacity=capacity, step=self.step,
                                                    with_logps=True)
            lengths = counts.tolist()
            return ([row[:length] for row, length in zip(tokens.cpu().tolist(), lengths)],
                    [row[:length] for row, length in zip(logps.cpu().tolist(), lengths)])

        def decode(going: List[int], histories: List[List[int]], turn: int,
                   room: int) -> Tuple[List[List[int]], List[List[float]]]:
            if not going:  # (sharded: other replicas decode this turn, so this one decodes a stand-in)
                decoded([rows[0]], decoding_generators([0], self.device), 1, room)
                return [], []
            seeds = [sampling_seed(sampling_seed(self.seed, step, indices[r // n]), turn, r % n) for r in going]
            return decoded(histories, decoding_generators(seeds, self.device), 1, room)

        def answer(going: List[int], completions: List[List[int]]) -> List[Optional[List[int]]]:
            texts = [self._text(completion) for completion in completions]
            return self._led(lambda: [None if reply is None else self.tokenizer.encode_batch([reply])[0]
                                      for reply in self.episodes.respond(going, texts)])

        played = take_turns(decoded(prompts, generators, n, self.max_new_tokens), rows, self.max_new_tokens, self.environment.max_turns,
                            self.marker, answer, decode, self._agreed)
        self._turns = torch.tensor(played.turns, dtype=torch.float64)
        return played.tokens, played.written, played.logps

    def _start_episodes(self, prompts: List[str], answers: List[Optional[str]]) -> None:
        self.episodes = self.environment.episodes(prompts, answers)

    def _agreed(self, going: int, room: int) -> Tuple[int, int]:
        """Sharded: the most completions still going and the most room left over the replicas
        (each decodes that many positions), else this replica's own."""
        if not (self.sharded and self.replicas > 1):
            return going, room
        counts = torch.tensor([going, room], device=self.device)
        dist.all_reduce(counts, op=dist.ReduceOp.MAX, group=self.replica_group)
        return tuple(counts.tolist())

    def _text(self, completion: List[int]) -> str:
        return self.tokenizer.decode([t for t in completion if t not in self.stop])

    def _sequences(self, prompts: List[List[int]], completions: List[List[int]], written: Optional[List[List[bool]]],
                   width: int) -> Tuple[torch.Tensor, torch.Tensor, List[str]]:
        """Each prompt + completion as a row to learn from (inputs; targets the completion's
        tokens the model wrote, the rest -100; on the device) and the completions' texts."""
        n = self.group_size
        inputs = torch.full((len(prompts) * n, width), self.pad_id, dtype=torch.int64)
        targets = torch.full_like(inputs, IGNORE)
        texts = []
        for r, completion in enumerate(completions):
            prompt, tokens = prompts[r // n], torch.tensor(completion, dtype=torch.int64)
            sequence = torch.cat([torch.tensor(prompt, dtype=torch.int64), tokens])
            inputs[r, :len(sequence) - 1] = sequence[:-1]
            if written is not None:
                tokens = tokens.masked_fill(~torch.tensor(written[r], dtype=torch.bool), IGNORE)
            targets[r, len(prompt) - 1:len(sequence) - 1] = tokens
            texts.append(self._text(completion))
        return inputs.to(self.device), targets.to(self.device), texts

    def _scored(self, prompts: List[str], completions: List[str],
                answers: List[Optional[str]]) -> Tuple[List[float], Dict[str, List[float]]]:
        """The completions' rewards and the reward's curves: the environment's own reward where it
        has one, else the reward's, 0 for an episode that failed (whose share is noted)."""
        if self.environment is None:
            return self._led(lambda: (self.reward(prompts, completions, answers), self.reward.curves()))

        def scored():
            failed = [error is not None for error in self.episodes.failed]
            scores = self.episodes.rewards(completions) if self.environment.scores else \
                [0.0 if bad else score for bad, score in zip(failed, self.reward(prompts, completions, answers))]
            failed = [error is not None for error in self.episodes.failed]  # (scoring may fail one)
            return scores, self.reward.curves() if not self.environment.scores else {}, failed
        scores, curves, failed = self._led(scored)
        self._failed = torch.tensor(failed, dtype=torch.float64)
        return scores, curves

    def _led(self, run):
        """run() on this rank, or under TP on the TP group's rank 0, its result handed to the rest,
        so a user's reward or environment (which may call a compiler or a sandbox) runs once a
        replica; what it raises is raised on every rank of the group (none is left waiting)."""
        if self.tp_group is None:
            return run()
        result: List[object] = [None]
        if dist.get_rank(self.tp_group) == 0:
            try:
                result = [(run(),)]
            except Exception as error:  # noqa: BLE001 (handed to the group, raised below)
                result = [error]
        dist.broadcast_object_list(result, src=dist.get_global_rank(self.tp_group, 0), group=self.tp_group)
        if isinstance(result[0], Exception):
            raise result[0]
        return result[0][0]

    def _batch_std(self, rewards: torch.Tensor) -> Optional[torch.Tensor]:
        """scale_rewards=batch: the std of every replica's rewards (one all-reduce over DP)."""
        if self.scale_rewards != "batch":
            return None
        moments = torch.stack([rewards.sum(), (rewards ** 2).sum(), torch.tensor(float(rewards.numel()),
                                                                                 dtype=torch.float64)])
        if self.replicas > 1:
            moments = moments.to(self.device)
            dist.all_reduce(moments, group=self.replica_group)
            moments = moments.cpu()
        total, squares, count = moments
        return ((squares - total ** 2 / count) / (count - 1).clamp(min=1)).clamp(min=0).sqrt()

    def _note_rollout(self, rewards: torch.Tensor, curves: Dict[str, List[float]], lengths: torch.Tensor,
                      targets: torch.Tensor) -> None:
        """This replica's means of the rollout's metrics (the Trainer averages them over DP), and
        the longest completion of every replica (TRL's max_length: the global one)."""
        grouped = rewards.view(-1, self.group_size)
        self._rollout_terms = {
            "reward": rewards.mean(), "reward_std": grouped.std(1).mean(),
            "frac_reward_zero_std": torch.isclose(grouped.std(1), torch.zeros_like(grouped[:, 0])).double().mean(),
            "completions/mean_length": lengths.mean(), "completions/max_length": self._longest(lengths.max()),
            "completions/clipped_ratio": (lengths >= self.max_new_tokens).double().mean(),
            **{f"rewards/{name}": torch.tensor(scores, dtype=torch.float64).mean()
               for name, scores in curves.items()}}
        if self.environment is not None:
            self._rollout_terms.update({"environment/turns": self._turns.mean(),
                                        "environment/failures": self._failed.mean()})
        self._tokens = float((targets != IGNORE).sum())

    def _longest(self, length: torch.Tensor) -> torch.Tensor:
        """The longest completion over every DP replica (one all-reduce MAX: the same on all, so
        the Trainer's average over DP keeps it)."""
        if self.replicas > 1:
            length = length.to(self.device)
            dist.all_reduce(length, op=dist.ReduceOp.MAX, group=self.replica_group)
            length = length.cpu()
        return length

    def _logps(self, forward, model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Each completion token's log-probability (0 elsewhere) under `forward` (rows, their
        targets -> logits: the policy `model`'s or its reference's), in the step's micro-batches."""
        size, parts = (self.micro_batch or len(inputs)) * self.group_size, []
        for begin in range(0, len(inputs), size):
            rows, counted = inputs[begin:begin + size], targets[begin:begin + size]
            parts.append(token_logps(forward(rows, counted), counted))
        if self.sharded:
            reshard(model)
        return torch.cat(parts)

