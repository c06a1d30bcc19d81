"""What crosses between orchestrator and trainer: typed batches (`batch`), their transports (`filesystem`,
`zmq_transport`, behind the `protocols`), and the weight-sync protocol (`weights`). Torch-free."""

from tidal.transport.batch import TrainingBatch
from tidal.transport.filesystem import BatchReader, BatchWriter
from tidal.transport.protocols import BatchSink, BatchSource

__all__ = ["BatchReader", "BatchSink", "BatchSource", "BatchWriter", "TrainingBatch"]
