"""Typed batches between orchestrator and trainer, and the filesystem transport that carries them."""

from tidal.transport.batch import TrainingBatch
from tidal.transport.filesystem import BatchReader, BatchWriter

__all__ = ["BatchReader", "BatchWriter", "TrainingBatch"]
