"""Train a small byte-level MoE language model on real text: ``python -m sonic.train``.

The FFN of every transformer block is a `sonic.MoE` layer, trained with top-K or token-rounding
routing (SonicMoE §5.2) and validated with top-K routing.
"""

from sonic.train.data import ByteCorpus, load_text
from sonic.train.loop import PRESETS, TrainConfig, evaluate, preset_config, train
from sonic.train.model import ByteMoELM

__all__ = ["PRESETS", "ByteCorpus", "ByteMoELM", "TrainConfig", "evaluate", "load_text",
           "preset_config", "train"]
