"""model=hf: which path runs a Hugging Face directory, from its config.json. The native path
(framework.models.hf.HFTransformer: the framework's own Transformer, every parallelism, the
fastest step) for the model types and features it implements; transformers' own modeling code
(framework.models.transformers_model) for every other causal LM transformers has.
`model.backend` forces one: native for a model it does not implement is refused naming what it
lacks."""
import os
from typing import Optional, Sequence

from torch import nn

from framework.config.errors import ConfigError
from framework.models.hf import SUPPORTED, HFTransformer, read_config, refuse_unimplemented
from framework.models.transformers_model import TransformersModel

BACKENDS = ("auto", "native", "transformers")


def native_lacks(config: dict, path: str) -> Optional[ConfigError]:
    """What the native path does not implement of `config` (config.json in `path`; None: nothing)."""
    try:
        refuse_unimplemented(config, path)
    except ConfigError as error:
        return error
    return None


def hugging_face_model(path: str, backend: str = "auto", activation_checkpointing: str = "none",
                       max_positions: Optional[int] = None, freeze: Sequence[str] = ()) -> nn.Module:
    """The model of the Hugging Face directory `path`, on the meta device, through `backend`;
    a vision-language model's `freeze` parts frozen (framework.models.vision)."""
    if backend not in BACKENDS:
        raise ConfigError("model.backend", backend, f"use one of {', '.join(BACKENDS)}")
    path = os.path.abspath(os.path.expanduser(str(path)))
    lacks = native_lacks(read_config(path), path)
    if backend == "native" and lacks is not None:
        raise ConfigError("model.backend", "native", f"{lacks.fix}; use model.backend=transformers (or auto) for "
                                                     f"transformers' own classes")
    if backend == "native" or (backend == "auto" and lacks is None):
        if freeze:
            raise ConfigError("model.freeze", list(freeze), "freezes a vision-language model's parts; this model is a "
                                                            "language model alone: set model.freeze=[]")
        return HFTransformer(path, activation_checkpointing, max_positions)
    model = TransformersModel(path, activation_checkpointing, max_positions, list(freeze or ()))
    if backend == "auto":
        model.chosen_because = ("model.backend=auto: the native path does not implement it" if
                                read_config(path).get("model_type") not in SUPPORTED else f"model.backend=auto: {lacks.fix}")
    return model
