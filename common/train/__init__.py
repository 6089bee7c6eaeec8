"""The training loop's plumbing: TrainingRun and its collaborators (flags, pre-emption, progress, meter,
record), mixed precision, evaluation, CUDA-graph capture."""
