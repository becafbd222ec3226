"""data=vision_preferences: image-grounded preference pairs for objective=dpo or simpo. A record
is data=vision's with two responses: `{"image": "a.png", "prompt": "...", "chosen": "...",
"rejected": "..."}`. Each sample is the pair's two conversations through the model's processor
(framework.data.vision: only each response and its end of turn are learned), (2, seq_len)
inputs and targets, and the record's images once: the objective runs the pair's two rows on the
same pixels (framework.training.objectives.preference.pair_inputs)."""
from typing import Dict, List

import numpy as np
import torch

from framework.data.vision import VisionDataset


class VisionPreferenceDataset(VisionDataset):
    kind = "preference"  # (the preference objectives' data: framework.data.dataset_config.kind_of)

    def __init__(self, path: str, processor: str, seq_len: int = 256, split: str = "train",
                 val_fraction: float = 0.05, image_field: str = "image", prompt_field: str = "prompt",
                 chosen_field: str = "chosen", rejected_field: str = "rejected"):
        self.rejected_field = rejected_field
        self.reference = None  # (objective.reference=precomputed is not offered for images)
        super().__init__(path, processor, seq_len, split, val_fraction, image_field, prompt_field, chosen_field)

    def text_fields(self, prompt_field: str, response_field: str) -> Dict[str, str]:
        return {"prompt": prompt_field, "chosen": response_field, "rejected": self.rejected_field}

    def answered(self, record: dict) -> List[dict]:
        return [record, {**record, "response": record["rejected"]}]

    def __getitem__(self, index: int) -> Dict[str, torch.Tensor]:
        record = self.records[self.first + index]
        images = [self._image(source) for source in record["images"]]
        chosen, rejected = (self._sample(answered, images) for answered in self.answered(record))
        pair = {key: torch.stack([chosen[key], rejected[key]]) for key in chosen if key != "pixels"}
        return {**pair, "pixels": chosen["pixels"]}

    def without_response(self) -> np.ndarray:
        """Per pair, whether either response was cut away: none (a record too long is refused)."""
        return np.zeros(len(self), dtype=bool)
