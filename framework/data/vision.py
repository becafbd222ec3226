"""data=vision: image-and-text records for a vision-language model, turned into its inputs by the
model directory's own processor (AutoProcessor: its image processor, tokenizer and chat template).

A record is one JSON line: `{"image": "red.png", "prompt": "What colour is it?", "response": "red"}`.
`image` names a file beside the JSONL (or under it), a list of them, or nothing (a text-only
sample in the same batches). The images come first in the user's turn, then the prompt; the
response is the assistant's turn. Only the response's tokens (and the template's end of turn
after it) are learned: the prompt, the image tokens and the template's markers are masked.

Opening the dataset reads every record and checks its fields and that each image opens, so a bad
record is refused before launch, naming its line. Each sample is processed when it is read, in
the loader's workers. A sample is padded to seq_len tokens; its images are the processor's
pixel_values, padded to the batch's most images per sample (framework.models.vision takes the
real ones).
"""
import json
import os
from pathlib import Path
from typing import Dict, List

import torch
from torch.utils.data import Dataset

from framework.config.errors import ConfigError
from framework.data.batch import IGNORE
from framework.data.records import InputError
from framework.data.token_files import split_range


def load_processor(path: str):
    """The model directory's own processor; refused naming the key where it has none."""
    try:
        from transformers import AutoProcessor

        processor = AutoProcessor.from_pretrained(path)
    except ImportError as error:  # transformers, Pillow, or what the model's processor class imports
        raise ConfigError("data.dataset.processor", path, f"its processor cannot load here: {error}; pip install "
                                                          "'framework[transformers]'") from None
    except (OSError, ValueError, KeyError) as error:
        raise ConfigError("data.dataset.processor", path, f"holds no processor transformers can load "
                                                          f"({str(error).splitlines()[0]}); point it at the "
                                                          "model's directory") from None
    if getattr(processor, "image_processor", None) is None or getattr(processor, "chat_template", None) is None:
        raise ConfigError("data.dataset.processor", path, "its processor has no image processor or no chat template: "
                                                          "data=vision needs a vision-language model's directory")
    return processor


class VisionDataset(Dataset):
    masked_targets = True  # (the lm objective counts the response tokens of the global batch)

    def __init__(self, path: str, processor: str, seq_len: int = 256, split: str = "train", val_fraction: float = 0.05,
                 image_field: str = "image", prompt_field: str = "prompt", response_field: str = "response"):
        self.path, self.seq_len, self.split = os.path.abspath(os.path.expanduser(str(path))), seq_len, split
        self.fields = (image_field, prompt_field, response_field)
        self.texts = self.text_fields(prompt_field, response_field)
        self.processor_path = processor
        self.processor = load_processor(processor)
        self.records = self._read()
        self._texts(self.records[0])  # the chat template's fit, before launch
        self.first, self.end = split_range(len(self.records), val_fraction, split)
        tokenizer = self.processor.tokenizer
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.vocab_size = len(tokenizer)
        from PIL import Image

        self.image_shape = self._pixels([Image.new("RGB", (32, 32))]).shape[1:]  # a padding slot's
        self._check_texts()

    def _read(self) -> List[dict]:
        """Every record, each image checked to open (header only)."""
        from PIL import Image, UnidentifiedImageError

        if not os.path.isfile(self.path):
            raise ConfigError("data.path", self.path, "no such file: give a JSONL of image-and-text records")
        image_field = self.fields[0]
        records, root = [], Path(self.path).parent
        with open(self.path, encoding="utf-8") as f:
            for number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                where = f"{self.path}:{number}"
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as error:
                    raise InputError(where, f"not JSON ({error.msg}); each line is one record") from None
                for role, field in self.texts.items():
                    if not isinstance(record.get(field), str) or not record[field]:
                        raise InputError(where, f"no {field!r} text; name its field with data.dataset.{role}_field")
                images = record.get(image_field) or []
                images = [images] if isinstance(images, str) else images
                if not isinstance(images, list) or not all(isinstance(i, str) for i in images):
                    raise InputError(where, f"{image_field!r} holds {record[image_field]!r}: give an image file's "
                                            f"name (relative to {root}) or a list of them")
                files = [str(root / name) for name in images]
                for file in files:
                    try:
                        with Image.open(file) as image:
                            image.verify()
                    except FileNotFoundError:
                        raise InputError(where, f"its image {file} does not exist; fix the name or remove the "
                                                "record") from None
                    except (UnidentifiedImageError, OSError, SyntaxError) as error:
                        raise InputError(where, f"its image {file} is not an image Pillow reads ({error})") from None
                records.append({"images": files, **{role: record[field] for role, field in self.texts.items()},
                                "response": record[self.fields[2]], "where": where})
        if not records:
            raise ConfigError("data.path", self.path, "holds no records")
        return records

    def _check_texts(self) -> None:
        """Before launch: no record's text holds the processor's image placeholder (its images
        come from the image field, one placeholder each), and each fits seq_len with its images'
        tokens. The length is counted from the text's tokens and a per-image count measured once
        on blank images (fixed-resolution processors: Gemma 3's, LLaVA's); a processor whose count
        depends on the image (tiles, dynamic resolution) fails that measurement's check against
        the first record, and its records are then measured as they are read, in the ranks."""
        placeholders = sorted({token for token in (getattr(self.processor, "image_token", None),
                                                   getattr(self.processor, "boi_token", None),
                                                   getattr(self.processor.tokenizer, "image_token", None)) if token})
        for record in self.records:
            for field, text in ((field, record[role]) for role, field in self.texts.items()):
                found = next((token for token in placeholders if token in text), None)
                if found:
                    raise InputError(record["where"], f"its {field!r} holds {found!r}, the processor's image "
                                                      f"placeholder; images come from the {self.fields[0]!r} field, "
                                                      f"one placeholder each: remove it from the text")
        counted = self._token_counter()
        if counted is None:
            return
        for record in (answered for record in self.records for answered in self.answered(record)):
            length = counted(record)
            if length - 1 > self.seq_len:
                raise InputError(record["where"], f"takes {length} tokens with its images' and the template's; "
                                                  f"data.dataset.seq_len={self.seq_len} holds {self.seq_len + 1}: "
                                                  f"raise it")

    def _token_counter(self):
        """record -> its processed length, from its text's tokens plus a constant and a count per
        image measured on blank images; None where the first record's real processing disagrees."""
        from PIL import Image

        blank = Image.new("RGB", (64, 64))
        text_tokens = lambda text: len(self.processor.tokenizer(text)["input_ids"])  # noqa: E731
        processed = lambda text, images: len(self.processor(text=[text], images=[images] if images else None,  # noqa: E731
                                                            return_tensors="pt")["input_ids"][0])
        probe = {"prompt": "x", "response": "y"}
        texts = [self._texts({**probe, "images": [blank] * n})[0] for n in (0, 1, 2)]
        offsets = [processed(text, [blank] * n) - text_tokens(text) for n, text in enumerate(texts)]
        per_image = offsets[1] - offsets[0]
        if offsets[2] - offsets[1] != per_image:
            return None

        def counted(record: dict) -> int:
            return text_tokens(self._texts(record)[0]) + offsets[0] + per_image * len(record["images"])
        first = self.records[0]
        images = [self._image(source) for source in first["images"]]
        return counted if counted(first) == processed(self._texts(first)[0], images) else None

    def _texts(self, record: dict) -> tuple:
        """The record's conversation through the chat template, and its prompt's (the user's turn
        and the assistant's opening), which the conversation begins with."""
        user = [{"type": "image"} for _ in record["images"]] + [{"type": "text", "text": record["prompt"]}]
        messages = [{"role": "user", "content": user},
                    {"role": "assistant", "content": [{"type": "text", "text": record["response"]}]}]
        template = self.processor.apply_chat_template
        text = template(messages, tokenize=False)
        prompt = template(messages[:1], tokenize=False, add_generation_prompt=True)
        if not text.startswith(prompt):
            raise ConfigError("data.dataset.processor", self.processor_path,
                              "its chat template's conversation does not begin with the prompt it makes for "
                              "generation, so the response cannot be told apart; data=vision needs a template whose "
                              "assistant turn follows its generation prompt")
        return text, prompt

    def text_fields(self, prompt_field: str, response_field: str) -> Dict[str, str]:
        """A record's text fields by role, each role's config key data.dataset.<role>_field."""
        return {"prompt": prompt_field, "response": response_field}

    def answered(self, record: dict) -> List[dict]:
        """The record once per response it holds (as `response`): one here, a pair's two."""
        return [record]

    def _image(self, source) -> "Image.Image":
        """A record's image, decoded (`source`: its file)."""
        from PIL import Image

        return Image.open(source).convert("RGB")

    def __len__(self) -> int:
        return self.end - self.first

    def _pixels(self, images: list) -> torch.Tensor:
        return self.processor.image_processor(images=images, return_tensors="pt")["pixel_values"]

    def __getitem__(self, index: int) -> Dict[str, torch.Tensor]:
        record = self.records[self.first + index]
        return self._sample(record, [self._image(source) for source in record["images"]])

    def _sample(self, record: dict, images: list) -> Dict[str, torch.Tensor]:
        """The record's conversation as the model's inputs and targets, with its images'."""
        text, prompt = self._texts(record)
        encoded = self.processor(text=[text], images=[images] if images else None, return_tensors="pt")
        ids = encoded["input_ids"][0]
        response = self.processor.tokenizer(text[len(prompt):], add_special_tokens=False)["input_ids"]
        if len(ids) - 1 > self.seq_len:
            raise InputError(record["where"], f"takes {len(ids)} tokens with its images' and the template's; "
                                              f"data.dataset.seq_len={self.seq_len} holds {self.seq_len + 1}: raise it")
        if ids[len(ids) - len(response):].tolist() != list(response):
            raise InputError(record["where"], "its response does not tokenize apart from its prompt")
        learned_from = len(ids) - len(response)  # the first learned token: the response's first
        sample = {"inputs": torch.full((self.seq_len,), self.pad_id, dtype=torch.int64),
                  "targets": torch.full((self.seq_len,), IGNORE, dtype=torch.int64)}
        sample["inputs"][:len(ids) - 1] = ids[:-1]
        sample["targets"][learned_from - 1:len(ids) - 1] = ids[learned_from:]
        if "token_type_ids" in encoded:  # (Gemma 3: its image tokens attend to each other both ways)
            sample["token_types"] = torch.zeros(self.seq_len, dtype=torch.int64)
            sample["token_types"][:len(ids) - 1] = encoded["token_type_ids"][0][:-1]
        sample["pixels"] = encoded["pixel_values"] if images else torch.zeros(0, *self.image_shape)
        return sample

    def collate(self, samples: List[Dict[str, torch.Tensor]]) -> Dict[str, torch.Tensor]:
        """The samples stacked, their images padded to the most any has (at least one slot)."""
        slots = max(1, max(len(s["pixels"]) for s in samples))
        batch = {key: torch.stack([s[key] for s in samples]) for key in samples[0] if key != "pixels"}
        batch["pixels"] = torch.zeros(len(samples), slots, *self.image_shape)
        for row, sample in enumerate(samples):
            batch["pixels"][row, :len(sample["pixels"])] = sample["pixels"]
        batch["image_counts"] = torch.tensor([len(s["pixels"]) for s in samples])
        return batch

