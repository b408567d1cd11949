"""Draft training: streaming packed data, anchor-offset positions, flash noisy cross-attention, chunked LM loss,
and a loop for one CPU, one GPU or many GPUs under torchrun (DDP or FSDP2)."""
from .data import DataConfig, PackedStream
from .trainer import Parallel, TrainConfig, train

__all__ = ["DataConfig", "PackedStream", "Parallel", "TrainConfig", "train"]
