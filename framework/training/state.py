"""What training carries across a checkpoint besides the model and optimizer: the last step
done, the data position and the history that summary.json reports. It follows torch's Stateful
protocol (state_dict / load_state_dict), as the checkpoint manager's other parts do."""
import copy
from dataclasses import dataclass, field
from typing import Any, Dict

from framework.data.loader import DataPosition


def new_history() -> Dict[str, list]:
    return {"losses": [], "grad_norms": [], "val_losses": [], "step_times_s": [], "checkpoints": []}


@dataclass
class TrainState:
    step: int = 0  # the step under way, or the last done (what a checkpoint saves); a run continues with step + 1
    position: DataPosition = field(default_factory=DataPosition)
    history: Dict[str, list] = field(default_factory=new_history)

    def state_dict(self) -> Dict[str, Any]:
        """A copy: an async save publishes it later, as it is now."""
        return {"step": self.step, "data": {"epoch": self.position.epoch, "samples": self.position.samples},
                "history": copy.deepcopy(self.history)}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.step = state["step"]
        self.position = DataPosition(state["data"]["epoch"], state["data"]["samples"])
        self.history = state["history"]
