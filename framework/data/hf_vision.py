"""data=hf_vision: image-and-text records of a Hugging Face dataset as users have it (a
`save_to_disk` directory, a folder or file of Parquet / JSONL / Arrow, or a Hub name; read by
`datasets`, framework.data.hf.open_dataset), for a vision-language model: data=vision's samples
(framework.data.vision), its images from an image column instead of files.

The image column holds an image (datasets' Image feature: bytes or a path), a list of them, or
nothing (a text-only record). Opening the dataset reads the column undecoded and checks that each
image's header opens and each record has its prompt and response, so a bad record is refused
before launch naming its row; the images are decoded when a sample is read, in the loader's
workers. Streaming (data.streaming) is not offered yet: the records are counted and checked first.
"""
import io
from typing import Any, List, Optional

from framework.config.errors import ConfigError
from framework.data.hf import open_dataset
from framework.data.records import InputError
from framework.data.vision import VisionDataset

CHECK_BATCH = 256  # rows read at a time by the checks


class HFVisionDataset(VisionDataset):
    def __init__(self, path: str, processor: str, seq_len: int = 256, split: str = "train",
                 val_fraction: float = 0.05, image_field: str = "image", prompt_field: str = "prompt",
                 response_field: str = "response", hf_split: str = "train", name: Optional[str] = None):
        self.hf_split, self.name = hf_split, name
        super().__init__(path, processor, seq_len, split, val_fraction, image_field, prompt_field, response_field)

    def _read(self) -> List[dict]:
        """Every record, its images left undecoded (each header checked), as rows of the table."""
        import datasets
        from PIL import Image, UnidentifiedImageError

        table = open_dataset(self.path, self.hf_split, self.name)
        image_field, prompt_field, response_field = self.fields
        for key, field in zip(("image_field", "prompt_field", "response_field"), self.fields):
            if field not in table.column_names:
                raise ConfigError(f"data.dataset.{key}", field, f"is not a column of {self.path}; its columns: "
                                                                f"{', '.join(table.column_names)}")
        feature = table.features[image_field]
        undecoded = datasets.Image(decode=False)
        if isinstance(feature, datasets.Image):
            table = table.cast_column(image_field, undecoded)
        elif isinstance(feature, (list, datasets.Sequence)) and isinstance(getattr(feature, "feature", None) or
                                                                           (feature[0] if isinstance(feature, list)
                                                                            else None), datasets.Image):
            table = table.cast_column(image_field, [undecoded] if isinstance(feature, list)
                                      else datasets.Sequence(undecoded))
        self.table = table
        records = []
        for start in range(0, len(table), CHECK_BATCH):
            rows = table[start:start + CHECK_BATCH]
            for offset, (images, prompt, response) in enumerate(zip(rows[image_field], rows[prompt_field],
                                                                    rows[response_field])):
                row = start + offset
                where = f"{self.path} row {row}"
                for field, text in ((prompt_field, prompt), (response_field, response)):
                    if not isinstance(text, str) or not text:
                        raise InputError(where, f"no {field!r} text; name its column with "
                                                f"data.dataset.{'prompt' if field == prompt_field else 'response'}_field")
                images = [] if images is None else images if isinstance(images, list) else [images]
                for k, image in enumerate(images):
                    try:
                        with Image.open(self._file(image)) as opened:
                            opened.verify()
                    except (UnidentifiedImageError, OSError, SyntaxError, TypeError, ValueError) as error:
                        raise InputError(where, f"its {image_field!r} column holds no image Pillow reads "
                                                f"({type(error).__name__}: {error}); fix or drop the row") from None
                records.append({"images": [(row, k) for k in range(len(images))], "prompt": prompt,
                                "response": response, "where": where})
        if not records:
            raise ConfigError("data.path", self.path, "holds no records")
        return records

    @staticmethod
    def _file(image: Any):
        """An undecoded image of the column (datasets' {"bytes", "path"}, or a path) as Pillow opens it."""
        if isinstance(image, dict):
            return io.BytesIO(image["bytes"]) if image.get("bytes") else image.get("path")
        if isinstance(image, (bytes, str)):
            return io.BytesIO(image) if isinstance(image, bytes) else image
        raise TypeError(f"{type(image).__name__} is not an image")

    def _image(self, source) -> "Image.Image":
        from PIL import Image

        row, k = source
        images = self.table[row][self.fields[0]]
        return Image.open(self._file(images[k] if isinstance(images, list) else images)).convert("RGB")
