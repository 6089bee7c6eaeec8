"""The training loop's plumbing: TrainingRun (epochs, resume, stop, records), mixed precision, evaluation, CUDA-graph capture."""
