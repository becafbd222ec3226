"""objective=grpo's completions in turns, with an environment (framework.training.objectives.
environments): the first turn is decoded with every other completion's (the rollout's
generate_groups, which stops at the marker as at the end of text); then, while turns are left,
each completion that ended at the marker gets the environment's answer, appended as tokens the
model did not write, and the completions still going are decoded again from their prompt and all
they hold so far.

Every completion keeps to the budget (objective.max_new_tokens, answers included), so a prompt and
its completion still fit seq_len. A model sharded over the DP ranks (FSDP2) gathers its weights in
every forward, so every replica decodes the same turns with the same number of positions: the
count of completions still going and the longest room left are agreed over the replicas first
(`agree`), and a replica with none left decodes a stand-in and drops it.
"""
from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence, Tuple


@dataclass
class Turns:
    """Each completion's tokens (its turns and the environment's answers, in order), which of them
    the model wrote (True: a target; False: the environment's, left out of the loss), each one's
    log-probability as it was drawn (0 for the environment's), and how many turns it took."""
    tokens: List[List[int]]
    written: List[List[bool]]
    logps: List[List[float]]
    turns: List[int]


Answer = Callable[[List[int], List[List[int]]], List[Optional[List[int]]]]
Drawn = Tuple[List[List[int]], List[List[float]]]  # rows of tokens, and of their log-probabilities as drawn
Decode = Callable[[List[int], List[List[int]], int, int], Drawn]


def take_turns(first: Drawn, prompts: Sequence[Sequence[int]], budget: int, max_turns: int,
               marker: int, answer: Answer, decode: Decode,
               agree: Callable[[int, int], Tuple[int, int]] = lambda going, room: (going, room)) -> Turns:
    """Completions from their first turns (`first`, each cut at its marker, end of text or the
    budget, with its tokens' log-probabilities), over up to `max_turns` turns of the model's:
    - answer(rows, completions) -> each row's answer tokens (None: its episode ends there);
    - decode(rows, histories, turn, room) -> each row's next turn (prompt + completion so far as
      its prompt, at most `room` tokens, cut after its marker or end of text) and its log-probabilities;
    - agree(going, room) -> (going, room) agreed over the replicas (sharded: the max of each)."""
    tokens, logps = [list(row) for row in first[0]], [list(row) for row in first[1]]
    written = [[True] * len(row) for row in tokens]
    turns = [1] * len(tokens)
    for turn in range(2, max_turns + 1):
        waiting = [r for r, row in enumerate(tokens) if row and row[-1] == marker and len(row) < budget]
        going = []
        for r, reply in zip(waiting, answer(waiting, [tokens[r] for r in waiting]) if waiting else []):
            if reply is None:
                continue
            reply = list(reply)[:budget - len(tokens[r])]
            tokens[r] += reply
            written[r] += [False] * len(reply)
            logps[r] += [0.0] * len(reply)
            if len(tokens[r]) < budget:
                going.append(r)
        agreed, room = agree(len(going), max((budget - len(tokens[r]) for r in going), default=0))
        if not agreed:
            break
        drawn = decode(going, [list(prompts[r]) + tokens[r] for r in going], turn, room)
        for r, new, new_logps in zip(going, *drawn):
            new = list(new)[:budget - len(tokens[r])]
            tokens[r] += new
            written[r] += [True] * len(new)
            logps[r] += list(new_logps)[:len(new)]
            turns[r] += 1
    return Turns(tokens, written, logps, turns)

